"""A sliding-window model's KV pool reserves block 0 as its null block: the totals a worker
reports (gRPC `GetLoad.num_total_blocks`, `tandem_kv_total_blocks` on /metrics) count only
the blocks requests can hold, so an idle worker reports every block free and none in use."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.serving.api_server import ServerSettings
from tandem.serving.routes import WorkerApp
from tests.serving.helpers import free_port

BLOCKS = 12


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> str:
    from tests.engine.utils import make_tiny_model_dir

    path = tmp_path_factory.mktemp("mistral")
    make_tiny_model_dir(path, "mistral", seed=1, sliding_window=8)
    return str(path)


def _metric(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


async def _idle_worker_reports(model: str) -> tuple[worker_pb2.Load, str, int]:
    config = EngineConfig(model=model, device="cpu", dtype="float32", block_size=4,
                          num_kv_blocks=BLOCKS, enforce_eager=True)
    port = free_port()
    wa = WorkerApp(ServerSettings(served_model_name="m", grpc_port=port,
                                  log_stats_interval_s=None),
                   lambda: AsyncLLMEngine.from_config(config))
    async with wa.lifespan(None):  # type: ignore[arg-type]
        for _ in range(600):
            if wa.holder.engine is not None:  # its metrics attached in the same callback
                break
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                                 timeout=10)
        text = (await wa.prometheus()).body.decode()
        pool = wa.holder.engine.state.num_kv_blocks
    return load, text, pool


def test_an_idle_sliding_window_worker_reports_no_block_in_use(tiny_mistral):
    load, text, pool = asyncio.run(_idle_worker_reports(tiny_mistral))
    assert pool == BLOCKS  # block 0 is the null block: BLOCKS - 1 usable
    assert (load.num_total_blocks, load.num_free_blocks, load.kv_cache_usage) == (
        BLOCKS - 1, BLOCKS - 1, 0.0)
    assert _metric(text, "tandem_kv_total_blocks") == BLOCKS - 1
    assert _metric(text, "tandem_kv_free_blocks") == BLOCKS - 1
    assert _metric(text, "vllm:kv_cache_usage_perc") == 0.0
