"""A prefill worker process for the shared-memory tests: a tiny model's engine behind two
`KVTransfer` services (one sending after the prompt, one layer by layer as it computes).

    python -m tests.kvtransfer.shm_prefill_process MODEL_DIR NAME BLOCK_SIZE

prints "READY <port> <streamed port>" and serves until killed.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service


async def main(path: str, name: str, block_size: int) -> None:
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=path, block_size=block_size, num_kv_blocks=128, num_threads=1,
        served_model_name=name, max_num_batched_tokens=16)))
    ports, servers = [], []
    for stream_layers in (False, True):
        server = grpc.aio.server()
        servers.append(server)
        add_kv_transfer_service(server, KVTransferService(lambda: engine, name, "prefill",
                                                          stream_layers=stream_layers))
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
    print("READY", *ports, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
