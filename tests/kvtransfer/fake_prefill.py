"""A stand-in prefill worker for failure tests: a real `tandem.v1.KVTransfer` gRPC server
whose Prefill does what a test tells it (stall, relay a real prefill worker's pages with
bytes flipped, ...).

In-process: `FakePrefillServer()` runs a grpc.aio server on its own event loop in a daemon
thread; set `.behaviour` to an async generator function `(request, context, relay) -> chunks`.

As a process (`python -m tests.kvtransfer.fake_prefill PORT UPSTREAM`): relays the header and
the first data chunk of the real prefill worker at UPSTREAM, prints "stalled" and waits, so a
test can SIGKILL a prefill server in the middle of a page stream.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from tandem.protocol import worker_pb2, worker_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 << 20),
                   ("grpc.max_send_message_length", 16 << 20)]
Relay = Callable[[worker_pb2.PrefillRequest], Awaitable[list[worker_pb2.PageChunk]]]
Behaviour = Callable[[worker_pb2.PrefillRequest, grpc.aio.ServicerContext, Relay],
                     AsyncIterator[worker_pb2.PageChunk]]


class FakePrefill(worker_pb2_grpc.KVTransferServicer):
    def __init__(self, upstream: str | None = None) -> None:
        self.upstream = upstream
        self.behaviour: Behaviour | None = None
        self.calls = 0
        self._stub: worker_pb2_grpc.KVTransferStub | None = None

    def stub(self) -> worker_pb2_grpc.KVTransferStub:
        if self._stub is None:
            assert self.upstream, "no upstream prefill worker to relay"
            ch = grpc.aio.insecure_channel(self.upstream, options=CHANNEL_OPTIONS)
            self._stub = worker_pb2_grpc.KVTransferStub(ch)
        return self._stub

    async def relay(self, request: worker_pb2.PrefillRequest) -> list[worker_pb2.PageChunk]:
        """The real prefill worker's whole reply (its lease released at once)."""
        chunks = [c async for c in self.stub().Prefill(request, timeout=60)]
        await self.stub().ReleasePages(
            worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id), timeout=10)
        return chunks

    async def Prefill(self, request: worker_pb2.PrefillRequest,  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PageChunk]:
        self.calls += 1
        assert self.behaviour is not None, "the test set no behaviour"
        async for chunk in self.behaviour(request, context, self.relay):
            yield chunk

    async def ReleasePages(self, request: worker_pb2.ReleasePagesRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext
                           ) -> worker_pb2.ReleasePagesResponse:
        return worker_pb2.ReleasePagesResponse(released=True)


async def _serve(servicer: FakePrefill, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    worker_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    await server.start()
    return server


class FakePrefillServer:
    """`FakePrefill` served on 127.0.0.1:`port` from a background event loop."""

    def __init__(self, port: int, upstream: str | None = None) -> None:
        self.servicer = FakePrefill(upstream)
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

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


async def relay_header_then_stall(request: worker_pb2.PrefillRequest,
                                  context: grpc.aio.ServicerContext, relay: Relay
                                  ) -> AsyncIterator[worker_pb2.PageChunk]:
    chunks = await relay(request)
    yield chunks[0]
    yield chunks[1]
    print("stalled", flush=True)
    await asyncio.Event().wait()


async def _main(port: int, upstream: str) -> None:
    servicer = FakePrefill(upstream)
    servicer.behaviour = relay_header_then_stall
    server = await _serve(servicer, port)
    print("serving", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), sys.argv[2]))
