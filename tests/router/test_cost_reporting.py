"""The measured costs a worker reports for the cost-based pick: the engine's step-cost EWMA
and its queued prefill tokens (plain values), and a real tiny worker's `GetLoad` read by the
router's monitor into `WorkerLoad`."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.step_costs import StepCosts, pending_prefill_tokens, split_tokens
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.router.index import PrefixIndex
from tandem.router.monitor import MonitorSettings, WorkerMonitor
from tandem.router.workers import Worker
from tandem.serving.api_server import ServerSettings
from tests.engine.utils import make_tiny_model_dir
from tests.serving.helpers import free_port
from tests.serving.tiny_worker import tiny_worker


def _req(prompt: int, computed: int = 0, outputs: int = 0) -> Request:
    r = Request("r", list(range(3, 3 + prompt)), SamplingParams(max_tokens=8), max_tokens=8)
    for t in range(outputs):
        r.append_output_token(100 + t)
    r.num_computed_tokens = computed
    return r


def test_step_costs_are_an_ewma_by_step_kind():
    c = StepCosts()
    c.observe(0.5, 1000, 0)  # the first prefill sample: 0.5 s / 1000 (no decode known yet:
    assert c.prefill_s_per_token == pytest.approx(5e-4)  # at least half the step is prefill)
    c.observe(0.02, 0, 8)
    c.observe(0.04, 0, 8)
    assert c.decode_step_s == pytest.approx(0.02 + 0.2 * 0.02)  # 0.024
    # 0.224 - 0.024 = 0.2 s beyond the decodes for 200 tokens: the EWMAs of seconds and
    # tokens move to 0.44 s and 840 tokens (token-weighted, not 1e-3 s a token's weight)
    c.observe(0.224, 200, 4)
    assert c.prefill_s_per_token == pytest.approx((0.5 - 0.2 * 0.3) / (1000 - 0.2 * 800))
    for bad in (0.0, -1.0, 61.0, float("nan")):
        c.observe(bad, 100, 1)
        c.observe(bad, 0, 1)
    assert (c.prefill_s_per_token, c.decode_step_s) == pytest.approx((0.44 / 840, 0.024))
    c.observe(0.5, 0, 0)  # no work: nothing to learn
    assert c.decode_step_s == pytest.approx(0.024)


def test_prefill_chunks_decodes_and_pending_prompt_tokens():
    fresh, chunked, decoding = _req(40), _req(100, computed=64), _req(10, computed=12, outputs=3)
    steps = [ScheduledRequest(fresh, 0, 32), ScheduledRequest(chunked, 64, 36),
             ScheduledRequest(decoding, 12, 1), ScheduledRequest(decoding, 12, 3, [7, 8])]
    assert split_tokens(steps) == (32 + 36, 2)
    recompute = _req(10, outputs=5)  # preempted: prompt and outputs recomputed at once
    assert split_tokens([ScheduledRequest(recompute, 0, 15)]) == (15, 0)
    # a prompt imported from a prefill worker (or all cached) computes only its last token:
    # a decode's cost, not a 1-token prefill (which would read as one step per token)
    imported = _req(96, computed=95)
    assert split_tokens([ScheduledRequest(imported, 95, 1), ScheduledRequest(decoding, 12, 1)]
                        ) == (0, 2)
    # waiting: every token (their cache hits are unknown until admission); running: the
    # prompt tokens not computed yet
    assert pending_prefill_tokens(running=[chunked, decoding], waiting=[fresh, recompute]) \
        == 36 + 0 + 40 + 15


def test_waiting_requests_count_only_what_is_neither_cached_nor_computed_ahead():
    # block size 4: two waiting requests share their first 3 blocks (12 tokens); a third's
    # first 2 blocks are cached
    group = list(range(10, 22))
    first, second = _req(0), _req(0)
    first.prompt_token_ids[:] = first.all_token_ids[:] = [*group, 1, 2, 3, 4, 5]  # 17
    second.prompt_token_ids[:] = second.all_token_ids[:] = [*group, 6, 7, 8, 9, 40, 41]  # 18
    warm = _req(0)
    warm.prompt_token_ids[:] = warm.all_token_ids[:] = list(range(50, 61))  # 11
    cached = set(warm.update_block_hashes(4)[:2])
    got = pending_prefill_tokens([], [first, second, warm], 4, cached.__contains__)
    assert got == 17 + (18 - 12) + (11 - 8)
    # without a prefix cache every waiting token counts
    assert pending_prefill_tokens([], [first, second, warm]) == 17 + 18 + 11


@pytest.fixture(scope="module")
def grpc_tiny_worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-costs")
    make_tiny_model_dir(path, "llama", seed=5)
    port = free_port()
    server, _ = tiny_worker(path, ServerSettings(served_model_name="tiny", grpc_port=port))
    yield server, port
    server.stop()


def test_a_real_workers_measured_costs_reach_the_routers_worker_load(grpc_tiny_worker):
    server, port = grpc_tiny_worker
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    before = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert (before.prefill_s_per_token, before.decode_step_s,
            before.pending_prefill_tokens) == (0.0, 0.0, 0)  # nothing measured yet
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": list(range(5, 69)), "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    channel.close()
    assert 0.0 < load.prefill_s_per_token < 0.1 and 0.0 < load.decode_step_s < 10.0
    assert load.pending_prefill_tokens == 0 and load.num_running == 0  # all done

    async def monitored() -> Worker:
        w = Worker(id=server.url)
        async with httpx.AsyncClient() as http:
            mon = WorkerMonitor(w, PrefixIndex(), http, MonitorSettings(load_interval_s=0.05))
            await mon.probe()  # learns the gRPC port, starts the load loop
            deadline = time.monotonic() + 20
            while w.load.decode_step_s == 0.0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await mon.stop()
        return w

    w = asyncio.run(monitored())
    # float32 on the wire, the same values on both sides (the engine is idle: unchanged)
    assert (w.load.prefill_s_per_token, w.load.decode_step_s, w.load.pending_prefill_tokens) \
        == (load.prefill_s_per_token, load.decode_step_s, 0)
    # how its scheduler shares a step (/ready), for the P/D cost estimate: no per-request
    # chunk cap on a CPU "both" worker, vLLM's default budget
    assert (w.prefill_chunk_cap, w.max_batched_tokens) == (0, 1024)


class _AbsurdWorker(worker_pb2_grpc.WorkerServicer):
    """A gRPC Worker whose load report states impossible costs."""

    def __init__(self, costs: tuple[float, float, int]) -> None:
        self.costs = costs

    async def GetLoad(self, request, context):  # noqa: N802, ANN001, ANN201
        rate, step, pending, *transfer = self.costs
        pull, block_bytes = transfer or (0.0, 0)
        return worker_pb2.Load(num_running=2, prefill_s_per_token=rate, decode_step_s=step,
                               pending_prefill_tokens=pending, peer_pull_s_per_block=pull,
                               kv_block_bytes=block_bytes)


@pytest.mark.parametrize(("reported", "want"), [
    ((float("nan"), float("-inf"), 0), (0.0, 0.0, 0)),
    ((-3.0, 1e30, (1 << 64) - 1), (0.0, 10.0, 1 << 32)),
    ((0.25, 0.5, 77), (0.1, 0.5, 77)),
    # the transfer costs the P/D cost decision reads (peer pull s per block, block bytes)
    ((0.0, 0.0, 0, float("nan"), 0), (0.0, 0.0, 0, 0.0, 0)),
    ((0.0, 0.0, 0, 1e9, (1 << 64) - 1), (0.0, 0.0, 0, 10.0, 1 << 34)),
    ((0.0, 0.0, 0, 0.002, 737_280), (0.0, 0.0, 0, 0.002, 737_280)),
])
def test_the_monitor_bounds_what_a_worker_reports(reported, want):
    async def scenario() -> Worker:
        server = grpc.aio.server()
        servicer = _AbsurdWorker(reported)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        w = Worker(id="http://127.0.0.1:1", grpc_target=f"127.0.0.1:{port}")
        mon = WorkerMonitor(w, PrefixIndex(), None, MonitorSettings(load_interval_s=0.02))
        mon._start_grpc_loops()  # as a probe does once it learns the gRPC port
        deadline = time.monotonic() + 10
        while w.load.num_running != 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await mon.stop()
        await server.stop(None)
        return w

    w = asyncio.run(scenario())
    got = (w.load.prefill_s_per_token, w.load.decode_step_s, w.load.pending_prefill_tokens,
           w.load.peer_pull_s_per_block, w.load.kv_block_bytes)
    assert got[:len(want)] == pytest.approx(want)
