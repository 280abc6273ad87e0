"""A prefill worker whose kept pages' lease runs out before it reads them (a short lease on a
busy engine: leases expire at every step) answers the decode worker DEADLINE_EXCEEDED, as it
does when the lease ends mid-send; a lease ended any other way is INTERNAL. Never UNKNOWN."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache.leases import LeaseError
from tandem.engine.llm_engine import LLMEngine
from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tests.engine.utils import make_tiny_model_dir

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("lease-deadline")
    make_tiny_model_dir(path, "llama", seed=3)
    made = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(path), block_size=4, num_kv_blocks=64, num_threads=1,
        served_model_name=MODEL)))
    yield made
    made.shutdown()


@pytest.mark.parametrize(("expired", "code"), [(True, grpc.StatusCode.DEADLINE_EXCEEDED),
                                               (False, grpc.StatusCode.INTERNAL)])
def test_a_lease_ended_before_its_pages_are_read_is_a_clear_status(engine, monkeypatch,
                                                                   expired, code):
    why = "expired" if expired else "was released"

    async def ended(*args, **kwargs):
        raise LeaseError(f"lease abc {why}: its pages are no longer pinned", expired=expired)

    monkeypatch.setattr(engine.kv_connector, "page_source", ended)

    async def main() -> grpc.aio.AioRpcError:
        server = grpc.aio.server()
        service = KVTransferService(lambda: engine, MODEL, "prefill")
        add_kv_transfer_service(server, service)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = worker_pb2_grpc.KVTransferStub(channel)
                request = worker_pb2.PrefillRequest(
                    model_id=MODEL, token_ids=list(range(10, 30)), block_size=4,
                    num_blocks=2, backend="grpc", lease_s=30.0)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Prefill(request, timeout=60):
                        pass
                return err.value
        finally:
            await service.close()
            await server.stop(0)

    error = asyncio.run(main())
    assert error.code() == code, (error.code(), error.details())
    assert why in error.details()
