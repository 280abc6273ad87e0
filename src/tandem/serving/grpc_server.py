"""The worker's gRPC control service (`tandem.v1.Worker`, see `protocol/worker.proto`).

`SubscribeKVEvents` streams a snapshot of every block hash the worker holds, then live
KV events with sequence numbers (hashes only: never the blocks' token ids, so a reader
learns no prompt text); `GetLoad` reports queue depth, free blocks and in-flight tokens.
A worker with a key (`--worker-auth-key-file`) serves both only when the call is signed
(`worker_auth.check_rpc`: PERMISSION_DENIED otherwise, counted in
`tandem_worker_auth_rejected_total`), and at most `max_subscribers` streams at once
(RESOURCE_EXHAUSTED beyond; a stream that ends frees its slot). Runs on grpc.aio in the
same event loop as the HTTP server. Messages are protobuf only: nothing received is
unpickled or evaluated; bytes that do not parse end INVALID_ARGUMENT (`MalformedRequests`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.errors import ConfigError
from tandem.engine.lora.request import LoRAState
from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.kv_events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from tandem.protocol.signing import GET_LOAD_RPC, SUBSCRIBE_RPC, WorkerKey
from tandem.protocol.tls import TLSFiles
from tandem.protocol.tls_peers import server_interceptors
from tandem.serving.worker_auth import check_rpc

logger = logging.getLogger(__name__)
MAX_EVENTS_PER_MESSAGE = 1024
MAX_SUBSCRIBERS = 16  # KV event streams at once (each router process holds one per worker)


def _medium(medium: str) -> str:
    """On the wire "" is the device (what events before media carried)."""
    return "" if medium == MEDIUM_DEVICE else medium


def event_to_proto(seq: int, event: KVEvent) -> worker_pb2.KVEvent:
    if isinstance(event, BlockStored):
        return worker_pb2.KVEvent(seq=seq, stored=worker_pb2.BlockStored(
            block_hashes=list(event.block_hashes), parent_hash=event.parent_hash,
            block_size=event.block_size, lora_name=event.lora_name,
            lora_digest=event.lora_digest, medium=_medium(event.medium)))  # no token ids
    if isinstance(event, BlockRemoved):
        return worker_pb2.KVEvent(seq=seq, removed=worker_pb2.BlockRemoved(
            block_hashes=list(event.block_hashes), medium=_medium(event.medium)))
    if isinstance(event, AllBlocksCleared):
        return worker_pb2.KVEvent(seq=seq, cleared=worker_pb2.AllBlocksCleared())
    raise TypeError(f"unknown KV event {event!r}")


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, get_engine: Callable[[], AsyncLLMEngine | None], worker_id: str,
                 model: str, role: str, key: WorkerKey | None = None,
                 max_subscribers: int = MAX_SUBSCRIBERS,
                 on_reject: Callable[[str], None] | None = None,
                 draining: Callable[[], bool] = lambda: False) -> None:
        """`key`: calls must be signed with it (module doc); `on_reject(reason)` counts
        refused calls; `draining()`: the worker is stopping (`Load.draining`)."""
        self.draining = draining
        self.get_engine = get_engine
        self.worker_id = worker_id
        self.model = model
        self.role = role
        self.key = key
        self.max_subscribers = max_subscribers
        self.on_reject = on_reject
        self.subscribers = 0  # KV event streams open now
        # measured seconds per block a peer pull brought (`serving.peer_pull.PullCosts`)
        self.peer_pull_s_per_block: Callable[[], float] = lambda: 0.0
        # bytes of one KV block of every layer (`kv_block_bytes`); 0: not reported
        self.kv_block_bytes: Callable[[], int] = lambda: 0

    async def _authorize(self, request: object, context: grpc.aio.ServicerContext,
                         target: str) -> None:
        refused = check_rpc(self.key, context.invocation_metadata(), request, target,
                            context.peer(), self.on_reject)
        if refused is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)

    async def _engine(self, context: grpc.aio.ServicerContext) -> AsyncLLMEngine:
        engine = self.get_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        return engine

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext) -> worker_pb2.Load:
        await self._authorize(request, context, GET_LOAD_RPC)
        engine = await self._engine(context)
        s, state = engine.snapshot, engine.state
        return worker_pb2.Load(
            worker_id=self.worker_id, model=self.model, role=self.role,
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_free_blocks=s.num_free_blocks, num_total_blocks=state.num_usable_blocks,
            block_size=state.block_size, in_flight_tokens=s.in_flight_tokens,
            kv_cache_usage=s.kv_cache_usage, running_loras=s.lora_running,
            waiting_loras=s.lora_waiting, resident_loras=s.lora_resident,
            max_loras=s.max_loras, lora_adapters=s.lora_adapters,
            prefill_s_per_token=s.prefill_s_per_token, decode_step_s=s.decode_step_s,
            pending_prefill_tokens=s.pending_prefill_tokens,
            peer_pull_s_per_block=self.peer_pull_s_per_block(),
            kv_block_bytes=self.kv_block_bytes(),
            host_load_s_per_block=s.host_load_s_per_block,
            disk_load_s_per_block=s.disk_load_s_per_block,
            draining=self.draining(),
            **_lora_version(s.lora_state))

    async def SubscribeKVEvents(  # noqa: N802 - gRPC name
            self, request: worker_pb2.SubscribeKVEventsRequest,
            context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.KVEventBatch]:
        await self._authorize(request, context, SUBSCRIBE_RPC)
        if self.subscribers >= self.max_subscribers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this worker already streams KV events to "
                                f"{self.max_subscribers} subscribers "
                                "(--max-kv-event-subscribers); retry later")
        self.subscribers += 1  # no await since the check: the count cannot overshoot
        try:
            async with contextlib.aclosing(self._stream(context)) as stream:
                async for batch in stream:
                    yield batch
        finally:
            self.subscribers -= 1

    async def _stream(self, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[worker_pb2.KVEventBatch]:
        engine = await self._engine(context)
        hub = engine.kv_hub
        if hub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are disabled")
        sid, sub = await engine.subscribe_kv_events()
        block_size = engine.state.block_size
        logger.info("KV subscriber %d joined at seq %d (%d blocks)", sid, sub.snapshot_seq,
                    len(sub.snapshot))
        try:
            yield worker_pb2.KVEventBatch(
                worker_id=self.worker_id, model=self.model, block_size=block_size,
                snapshot=worker_pb2.Snapshot(seq=sub.snapshot_seq,
                                             block_hashes=sub.snapshot,
                                             instance_id=hub.instance_id,
                                             host_block_hashes=sub.snapshot_host,
                                             disk_block_hashes=sub.snapshot_disk))
            while True:
                batch = await hub.next_batch(sub)
                if batch is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "subscriber fell too far behind; resubscribe")
                for i in range(0, len(batch), MAX_EVENTS_PER_MESSAGE):
                    yield worker_pb2.KVEventBatch(
                        worker_id=self.worker_id, model=self.model, block_size=block_size,
                        events=[event_to_proto(seq, e)
                                for seq, e in batch[i : i + MAX_EVENTS_PER_MESSAGE]])
        finally:
            hub.unsubscribe(sid)
            logger.info("KV subscriber %d left", sid)


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Request bytes that do not parse as the method's message end INVALID_ARGUMENT (grpc.aio
    would answer UNKNOWN and log the parser's traceback as a server error): each unary-request
    handler gets the raw bytes and parses them itself."""

    async def intercept_service(self, continuation: Any,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception as exc:  # noqa: BLE001 - whatever the parser refuses
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"malformed request message ({type(exc).__name__})")

        if not handler.response_streaming:
            inner = handler.unary_unary

            async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await inner(await parsed(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        streamed = handler.unary_stream

        async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            async for message in streamed(await parsed(raw, context), context):
                yield message

        return grpc.unary_stream_rpc_method_handler(stream, **kw)


async def start_grpc_server(service: WorkerService, host: str, port: int,
                            kv_transfer: KVTransferService | None = None,
                            tls: TLSFiles | None = None) -> grpc.aio.Server:
    """The Worker service (and KVTransfer when given) on host:port. With `tls`: mutual TLS
    (client certificates signed by its CA, renewed files used by new connections) and, when
    it names a server name, only clients whose certificate carries that identity."""
    # a Prefill request carries a whole prompt's token ids (4 bytes each at most)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 8 << 20)],
                             interceptors=[MalformedRequests(), *server_interceptors(tls)])
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    if kv_transfer is not None:
        add_kv_transfer_service(server, kv_transfer)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, tls.server_credentials()) if tls is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    logger.info("gRPC Worker service on %s:%d", host, bound)
    return server


def kv_block_bytes(engine: AsyncLLMEngine, model: str) -> int:
    """Bytes of one KV block of every layer, as pages travel (`PageLayout`); 0 for an engine
    whose pages do not travel (a hybrid or sliding-window model's KV groups)."""
    try:
        layout = engine.kv_connector.layout(model)
    except ConfigError:
        return 0
    return layout.num_layers * layout.block_layer_bytes


def _lora_version(state: LoRAState | None) -> dict[str, object]:
    """`Load`'s adapter digests and adapter-set version (the router orders reports by it)."""
    if state is None:
        return {}
    return {"lora_digests": dict(state.adapters), "lora_instance": state.instance,
            "lora_version": state.version}
