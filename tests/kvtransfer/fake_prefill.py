"""A stand-in prefill worker for failure tests: a real `tandem.v1.KVTransfer` gRPC server
whose Prefill does what a test tells it (stall, serve damaged pages, ...). Its replies may
be raw bytes (sent as they are: messages that do not parse).

In-process: `FakePrefillServer(port)` runs a grpc.aio server on its own event loop in a
daemon thread; set `.behaviour` to an async generator function `(request, context) ->
chunks`.

As a process (`python -m tests.kvtransfer.fake_prefill PORT [shm]`): answers every Prefill
with a header that passes the receiver's checks and one chunk of page data (with `shm`: its
first layer through the receiver's shared-memory segment), prints "stalled" and waits, so a
test can SIGKILL a prefill server in the middle of a page stream.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Callable

import grpc
import torch

from tandem.kvtransfer.pages import PageLayout, header_for
from tandem.kvtransfer.service import add_kv_transfer_service
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.block_hash import HashKeys, hash_block_chain
from tandem.protocol.bundled import BUNDLED_NAME

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 << 20),
                   ("grpc.max_send_message_length", 16 << 20)]
# the bundled model's KV geometry on a CPU worker
LAYOUT = PageLayout(BUNDLED_NAME, num_layers=30, num_kv_heads=3, block_size=16, head_dim=64,
                    dtype=torch.float32)
Behaviour = Callable[[worker_pb2.PrefillRequest, grpc.aio.ServicerContext],
                     AsyncIterator[worker_pb2.PageChunk | bytes]]


def header(request: worker_pb2.PrefillRequest) -> worker_pb2.PageChunk:
    """The header a real prefill worker would send for `request` (the receiver accepts it)."""
    first, num, bs = request.first_block, request.num_blocks, LAYOUT.block_size
    hashes = hash_block_chain(list(request.token_ids[: (first + num) * bs]), bs,
                              HashKeys(request.model_id, "", request.cache_salt))[first:]
    return worker_pb2.PageChunk(header=header_for(LAYOUT, first, hashes, "fake-lease", 0))


class FakePrefill(worker_pb2_grpc.KVTransferServicer):
    def __init__(self) -> None:
        self.behaviour: Behaviour | None = None
        self.calls = 0

    async def Prefill(self, request: worker_pb2.PrefillRequest,  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[worker_pb2.PageChunk | bytes]:
        self.calls += 1
        assert self.behaviour is not None, "the test set no behaviour"
        async for chunk in self.behaviour(request, context):
            yield chunk

    async def ReleasePages(self, request: worker_pb2.ReleasePagesRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext
                           ) -> worker_pb2.ReleasePagesResponse:
        return worker_pb2.ReleasePagesResponse(released=True)


async def _serve(servicer: FakePrefill, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add_kv_transfer_service(server, servicer)  # a behaviour may yield raw bytes too
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    await server.start()
    return server


class FakePrefillServer:
    """`FakePrefill` served on 127.0.0.1:`port` from a background event loop."""

    def __init__(self, port: int) -> None:
        self.servicer = FakePrefill()
        self.target = f"127.0.0.1:{port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            _serve(self.servicer, port), self.loop).result(timeout=30)

    @property
    def behaviour(self) -> Behaviour | None:
        return self.servicer.behaviour

    @behaviour.setter
    def behaviour(self, fn: Behaviour | None) -> None:
        self.servicer.behaviour = fn

    @property
    def calls(self) -> int:
        return self.servicer.calls

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


async def header_data_then_stall(request: worker_pb2.PrefillRequest,
                                 context: grpc.aio.ServicerContext
                                 ) -> AsyncIterator[worker_pb2.PageChunk]:
    yield header(request)
    yield worker_pb2.PageChunk(data=worker_pb2.PageData(layer=0, offset=0, data=bytes(4096)))
    print("stalled", flush=True)
    await asyncio.Event().wait()


async def shm_layer_then_stall(request: worker_pb2.PrefillRequest,
                               context: grpc.aio.ServicerContext
                               ) -> AsyncIterator[worker_pb2.PageChunk]:
    """Takes the receiver's shared-memory offer: writes layer 0 into its segment, sends its
    digest, then stalls (the segment mapped here)."""
    from tandem.kvtransfer.base import SendJob
    from tandem.kvtransfer.shm_backend import ShmBackend

    first = header(request)
    first.header.transport = "shm"
    yield first
    n = request.num_blocks
    request.shm_layer_batches = False  # one layer_end per layer: layer 0's alone
    job = SendJob(request, LAYOUT, list(range(n)),
                  lambda layer: torch.zeros(LAYOUT.layer_shape(n)), 1e18)
    async for chunk in ShmBackend().send(job):
        yield chunk
        print("stalled", flush=True)
        await asyncio.Event().wait()


async def _main(port: int, behaviour: str) -> None:
    servicer = FakePrefill()
    servicer.behaviour = (shm_layer_then_stall if behaviour == "shm"
                          else header_data_then_stall)
    server = await _serve(servicer, port)
    print("serving", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""))
