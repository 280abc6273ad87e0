"""Prefill side: the `tandem.v1.KVTransfer` gRPC service and its page leases.

`Prefill`: validate the request (INVALID_ARGUMENT otherwise, also when the decode worker's KV
cache dtype is not this worker's: its pages could not be used), run the prompt for one greedy
token with `keep_blocks` (the engine's prefix cache serves what it already holds, so cached
blocks are not recomputed), pin the finished request's blocks under a lease, send the header
and the requested blocks' pages (the full blocks, then the prompt's partial last block when
`tail_tokens` asks for it) through the chosen backend. Everything on the engine goes
through its KV connector (`engine.kv_connector`): the finished prompt's blocks are the
connector's lease (`lease_kept`, set to the request's `lease_s`), read through its
`page_source`. With `stream_layers`, where the connector can save a step layer by layer
(`save_layers`, whatever the engine's tensor-parallel size), the header goes out when the
prompt's last step starts and each layer's pages as soon as that step has written the layer
(`layer_stream.LayerStream`), so the transfer overlaps the compute; the trailer waits for
the run to finish with those blocks kept. The pages stay pinned until `ReleasePages`, the
lease's expiry (the engine unpins them), or a failed or cancelled stream, so a decode
worker that dies cannot hold prefill memory for longer than the lease. The header's lease
id is this service's: it names the prompt's request, whose engine lease it releases.
A `cached_only` call (a peer pull) computes nothing and sends only blocks already cached
(`pull_service`).
A draining worker (`draining()`) refuses new Prefill calls (UNAVAILABLE) and keeps serving
those under way and ReleasePages; `held()` counts what it must wait for before it exits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.errors import InvalidRequestError, QueueFullError
from tandem.engine.kv_cache.leases import MAX_LEASE_S, LeaseError
from tandem.engine.kv_connector.base import KVConnector
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.base import BACKENDS, SendJob, TransferBackend, make_backend
from tandem.kvtransfer.grpc_backend import serialize_chunk
from tandem.kvtransfer.layer_stream import LayerStream
from tandem.kvtransfer.pages import KVTransferError, Offer, header_for
from tandem.kvtransfer.pull_service import send_cached
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.block_hash import hash_block_chain, request_hash_keys
from tandem.protocol.signing import (
    PREFILL_RPC,
    RELEASE_PAGES_RPC,
    TENANT_SALT_PREFIX,
    WorkerKey,
)
from tandem.serving.worker_auth import check_rpc

logger = logging.getLogger(__name__)
DEFAULT_LEASE_S = 30.0


class _Refused(Exception):
    """Ends a Prefill call with `code` and `message`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Lease:
    lease_id: str  # the header's
    request_id: str  # the engine request whose kept blocks are the connector's lease
    expires: float  # time.monotonic(): forgotten here after it (the engine expires it)
    engine_lease: str = ""  # a cached-only send's: the connector lease on cached blocks


class LeaseTable:
    """The header's lease ids, each naming the prompt request whose kept blocks the
    connector leases; `release` ends that lease (on the engine thread) at most once. The
    engine expires the leases; ids past their time are forgotten here as others come."""

    def __init__(self, kv: KVConnector) -> None:
        self.kv = kv
        self.leases: dict[str, Lease] = {}

    def active(self) -> int:
        """Leases neither released nor past their time."""
        now = time.monotonic()
        return sum(1 for lease in self.leases.values() if lease.expires >= now)

    def add(self, request_id: str, lease_s: float, engine_lease: str = "") -> Lease:
        now = time.monotonic()
        for lid in [lid for lid, lease in self.leases.items() if lease.expires < now]:
            del self.leases[lid]
        lease = Lease(uuid.uuid4().hex, request_id, now + lease_s, engine_lease)
        self.leases[lease.lease_id] = lease
        return lease

    async def release(self, lease_id: str, why: str) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        rid = lease.request_id
        # an engine call runs even if this coroutine is cancelled while it waits
        released = await (self.kv.release(lease.engine_lease) if lease.engine_lease
                          else self.kv.release_kept(rid))
        if released:
            logger.info("[%s] pages unpinned (%s)", rid, why)
        return released


class KVTransferService(worker_pb2_grpc.KVTransferServicer):
    """Serves Prefill on workers whose role is `prefill` or `both`."""

    def __init__(self, get_engine: Callable[[], AsyncLLMEngine | None], model_id: str,
                 role: str, stream_layers: bool = False, key: WorkerKey | None = None,
                 on_reject: Callable[[str], None] | None = None,
                 draining: Callable[[], bool] = lambda: False) -> None:
        """`stream_layers`: send each layer's pages as soon as the prompt's last step has
        written it (`LayerStream`), instead of after the whole prompt. `key` (the worker
        auth key): every Prefill and ReleasePages call must be signed with it
        (`protocol.signing`, PERMISSION_DENIED otherwise; `on_reject(reason)` counts
        refusals); without one, a Prefill call for a tenant's `cache_salt` is refused.
        `draining()`: the worker is stopping (module doc)."""
        self.draining = draining
        self.calls = 0  # Prefill calls under way
        self.key = key
        self.on_reject = on_reject
        self.get_engine = get_engine
        self.model_id = model_id
        self.role = role
        self.stream_layers = stream_layers
        self.backends: dict[str, TransferBackend] = {}
        self._leases: LeaseTable | None = None
        self._ids = itertools.count()

    def held(self) -> int:
        """What a draining worker waits for: Prefill calls under way and unexpired leases
        of pages sent."""
        return self.calls + (0 if self._leases is None else self._leases.active())

    def leases(self, kv: KVConnector) -> LeaseTable:
        if self._leases is None:
            self._leases = LeaseTable(kv)
        return self._leases

    def transport(self, request: worker_pb2.PrefillRequest, header: worker_pb2.PageHeader,
                  layer_bytes: int) -> str:
        """The backend that carries this send's pages of `layer_bytes` per layer, named in
        `header.transport` when it is not the request's: a grpc request offering a
        shared-memory segment gets `shm` when on this node."""
        offered = "shm" if request.shm_segment and request.backend == "grpc" else None
        transport = self.backend(offered or request.backend).transport(request, layer_bytes)
        if transport != request.backend:
            header.transport = transport
        return transport

    def backend(self, name: str) -> TransferBackend:
        if name not in self.backends:
            self.backends[name] = make_backend(name)
        return self.backends[name]

    async def close(self) -> None:
        for b in self.backends.values():
            await b.close()

    def _check(self, req: worker_pb2.PrefillRequest, engine: AsyncLLMEngine) -> str | None:
        """Why `req` cannot be served, or None."""
        state = engine.state
        n = len(req.token_ids)
        if req.model_id != self.model_id:
            return f"model {req.model_id!r} is not served here ({self.model_id!r})"
        if req.block_size != state.block_size:
            return f"block size {req.block_size} differs from this worker's {state.block_size}"
        theirs = req.kv_cache_dtype or "auto"
        mine = engine.kv_connector.layout(self.model_id).cache_dtype
        if theirs != mine:  # its header would be refused: do not compute for nothing
            return (f"kv cache dtype {theirs[:32]} on the decode worker, {mine} here: the "
                    "pages cannot be shared")
        if req.backend not in BACKENDS:
            return f"unknown backend {req.backend!r}; known: {sorted(BACKENDS)}"
        if not 0 < n < state.max_model_len:
            return f"the prompt must have 1..{state.max_model_len - 1} tokens, got {n}"
        if any(t >= state.vocab_size for t in req.token_ids):
            return f"token ids must be below {state.vocab_size}"
        if req.num_blocks < 1 or req.first_block + req.num_blocks > n // state.block_size:
            return (f"blocks [{req.first_block}, {req.first_block + req.num_blocks}) are not "
                    f"full blocks of a {n}-token prompt")
        end = req.first_block + req.num_blocks
        if req.tail_tokens and (end != (n - 1) // state.block_size
                                or req.tail_tokens != n - 1 - end * state.block_size):
            return (f"tail_tokens {req.tail_tokens} is not the part of a {n}-token prompt "
                    f"between block {end} and its last token")
        if not 0 <= req.lease_s <= MAX_LEASE_S:
            return f"lease_s must be in [0, {MAX_LEASE_S:g}]"
        if len(req.request_id) > 256 or len(req.cache_salt) > 4096:
            return "request_id or cache_salt too long"
        if req.lora_name:
            lora = engine.lora
            if lora is None or not lora.has(req.lora_name):
                return f"LoRA adapter {req.lora_name[:256]!r} is not loaded here"
        return None

    def _unauthorized(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> str | None:
        """Why this call may not be served (see `__init__`), or None."""
        if self.key is None:
            if request.cache_salt.startswith(TENANT_SALT_PREFIX):
                return ("this worker has no --worker-auth-key-file, so it serves no tenant "
                        "cache_salt")
            return None
        return check_rpc(self.key, context.invocation_metadata(), request, PREFILL_RPC,
                         context.peer(), self.on_reject, who="a decode worker")

    async def Prefill(self, request: worker_pb2.PrefillRequest,  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[worker_pb2.PageChunk]:
        refused = self._unauthorized(request, context)  # before anything is revealed
        if refused is not None:
            logger.warning("[kv-%s] Prefill refused: %s", request.request_id[:64] or "anon",
                           refused)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        if self.draining():  # the decode worker prefills locally (or fails, by its policy)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is draining")
        engine = self.get_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        if request.cached_only:  # a peer pull: any role, nothing computed (`pull_service`)
            async for chunk in send_cached(self, request, context, engine):
                yield chunk
            return
        if self.role == "decode":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker's role is decode; it does not prefill")
        problem = self._check(request, engine)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        digest, problem = _adapter_digest(request, engine)
        if problem is not None:  # pages of other weights must never be sent for it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        rid = f"kv-{request.request_id or 'anon'}-{next(self._ids)}"
        tokens = list(request.token_ids)
        kv = engine.kv_connector
        layout = kv.layout(self.model_id)
        loop = asyncio.get_running_loop()
        stream = (LayerStream(loop, layout.num_layers, kv.device)
                  if self.stream_layers else None)
        if stream is not None and not kv.save_layers(rid, stream):
            stream = None  # this engine cannot follow a step layer by layer
        run = asyncio.ensure_future(self._run_prompt(engine, rid, tokens, request.cache_salt,
                                                     request.lora_name or None))
        if stream is not None:
            run.add_done_callback(lambda _: stream.fail("the prompt run ended early"))
        leases = self.leases(kv)
        lease_s = request.lease_s or DEFAULT_LEASE_S
        lease: Lease | None = None
        sent = False
        self.calls += 1
        try:
            first, num = request.first_block, request.num_blocks
            tail = request.tail_tokens
            sent_blocks = Offer(num, tail).num_blocks  # the partial block after the full ones
            if stream is None:  # the whole prompt first, then every layer at once
                first_token = await run
                kept = await kv.lease_kept(rid, lease_s)
                table = None if kept is None else list(kept.block_ids)
            else:  # from the start of its last step, layer by layer as each is written
                kept, first_token, table = None, 0, await self._started(stream, run)
            lease = leases.add(rid, lease_s)
            if table is None or len(table) < first + sent_blocks:
                raise _Refused(grpc.StatusCode.INTERNAL, "the prompt's blocks are gone")
            if _adapter_digest(request, engine)[0] != digest:  # replaced while it ran
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"LoRA adapter {request.lora_name[:256]!r} was replaced")
            keys = request_hash_keys(self.model_id, digest, request.cache_salt)
            block_size = engine.state.block_size
            hashes = hash_block_chain(tokens[: (first + num) * block_size], block_size,
                                      keys)[first:]
            block_ids = table[first:first + sent_blocks]
            header = header_for(layout, first, hashes, lease.lease_id, first_token, tail)
            transport = self.transport(request, header, sent_blocks * layout.block_layer_bytes)
            yield worker_pb2.PageChunk(header=header)
            source = (await kv.page_source(kept, first, sent_blocks) if kept is not None
                      else await kv.saved_page_source(rid, block_ids))  # every KV head
            job = SendJob(request, layout, block_ids, source.layer, loop.time() + lease_s,
                          source.views, stream, source.gather_into)
            async for chunk in self.backend(transport).send(job):
                if stream is not None and not isinstance(chunk, bytes) and chunk.HasField(
                        "trailer"):  # every layer sent: the run must have kept these blocks
                    await run
                    kept = await kv.lease_kept(rid, lease_s)
                    if kept is None or list(kept.block_ids[first:first + sent_blocks]) != (
                            block_ids):
                        raise _Refused(grpc.StatusCode.INTERNAL, "the prompt's blocks moved")
                yield chunk
            sent = True
            logger.info("[%s] sent %d blocks%s x %d layers (%s%s), lease %.0f s", rid, num,
                        f" + a {tail}-token tail" if tail else "", layout.num_layers,
                        transport, ", layer by layer" if stream is not None else "",
                        lease_s)
        except _Refused as exc:
            await context.abort(exc.code, exc.message)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED
                                if exc.reason == "expired" else grpc.StatusCode.INTERNAL,
                                str(exc))
        except LeaseError as exc:  # the kept pages' lease ended before they were sent
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if exc.expired
                                else grpc.StatusCode.INTERNAL, str(exc))
        finally:
            self.calls -= 1
            if stream is not None:
                kv.unsave_layers(rid)
            if not run.done():
                run.cancel()  # aborts the request; its kept blocks are released after it
            elif not run.cancelled() and run.exception() is None and lease is None:
                await kv.release_kept(rid)  # kept, but the stream ended before it was sent
            if not sent and lease is not None:  # nobody will acknowledge these pages
                await leases.release(lease.lease_id, "stream not completed")

    @staticmethod
    async def _started(stream: LayerStream, run: asyncio.Future) -> list[int]:
        """The block table once the prompt's last step begins; the run's error if it ends
        first."""
        begun = asyncio.ensure_future(stream.started())
        try:
            await asyncio.wait({begun, run}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not begun.done():
                begun.cancel()
        if begun.done() and not begun.cancelled() and begun.exception() is None:
            return begun.result()
        await run  # raises the run's error
        raise _Refused(grpc.StatusCode.INTERNAL, "the prompt finished without computing")

    async def _run_prompt(self, engine: AsyncLLMEngine, rid: str, tokens: list[int],
                          cache_salt: str, lora_name: str | None = None) -> int:
        """Prefill `tokens` (one greedy token) keeping the blocks; the token. Raises
        `_Refused` when the engine refuses or fails the prompt."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        try:
            try:
                _, outputs = await engine.add(tokens, params, rid,
                                              cache_salt=cache_salt or None, keep_blocks=True,
                                              lora_name=lora_name)
            except QueueFullError as exc:
                raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
            except InvalidRequestError as exc:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
            while True:
                out = await outputs.get()
                if out.finished:
                    break
        except asyncio.CancelledError:
            # The caller left (its timeout, its death) while the prompt ran. The request may
            # finish, keeping its blocks, before the abort reaches the engine, and no lease
            # may exist yet to expire them: release after the abort (the engine thread takes
            # commands in order), a no-op when the abort came first.
            engine.abort(rid)
            asyncio.ensure_future(engine.kv_connector.release_kept(rid))
            raise
        comp = out.outputs[0]
        if comp.finish_reason not in ("length", "stop") or not comp.token_ids:
            await engine.kv_connector.release_kept(rid)
            raise _Refused(grpc.StatusCode.INTERNAL,
                           f"prefill failed: {out.error or comp.finish_reason}")
        return comp.token_ids[0]

    async def ReleasePages(self, request: worker_pb2.ReleasePagesRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext
                           ) -> worker_pb2.ReleasePagesResponse:
        refused = check_rpc(self.key, context.invocation_metadata(), request,
                            RELEASE_PAGES_RPC, context.peer(), self.on_reject,
                            who="a decode worker")
        if refused is not None:  # else anyone could unpin another request's pages
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        if self._leases is None:
            return worker_pb2.ReleasePagesResponse(released=False)
        released = await self._leases.release(request.lease_id, "acknowledged")
        return worker_pb2.ReleasePagesResponse(released=released)


def add_kv_transfer_service(server: grpc.aio.Server, service: KVTransferService) -> None:
    """Register `service` like the generated `add_KVTransferServicer_to_server`, except that
    Prefill's replies may be pre-encoded `PageChunk` bytes (`grpc_backend.encode_pages`)."""
    handlers = {
        "Prefill": grpc.unary_stream_rpc_method_handler(
            service.Prefill, request_deserializer=worker_pb2.PrefillRequest.FromString,
            response_serializer=serialize_chunk),
        "ReleasePages": grpc.unary_unary_rpc_method_handler(
            service.ReleasePages,
            request_deserializer=worker_pb2.ReleasePagesRequest.FromString,
            response_serializer=worker_pb2.ReleasePagesResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tandem.v1.KVTransfer", handlers),))


def _adapter_digest(request: worker_pb2.PrefillRequest, engine: AsyncLLMEngine
                    ) -> tuple[str | None, str | None]:
    """(the weight digest of the adapter the call names, as loaded here (None: the base
    model), why it may not be served: a digest the caller sent that differs)."""
    lora = engine.lora
    if not request.lora_name or lora is None:
        return None, None
    digest = lora.digests.get(request.lora_name)
    if digest is None:
        return None, f"LoRA adapter {request.lora_name[:256]!r} is not loaded here"
    if request.lora_digest and request.lora_digest != digest:
        return digest, (f"LoRA adapter {request.lora_name[:256]!r} has other weights here "
                        f"(digest {digest[:12]}, the caller's {request.lora_digest[:12]})")
    return digest, None
