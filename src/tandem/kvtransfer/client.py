"""Decode side: fetch the KV pages of a prompt's missing blocks from a prefill worker.

`RemotePrefill.fetch(target, request_id, token_ids, cache_salt)`:
1. hash the prompt as the engine does and count the leading blocks this worker already
   holds; the full blocks after those (up to the last one before the prompt's last token)
   are asked for, and the partial block after them that holds the tokens up to the last
   one (`tail_tokens`). Those local blocks are pinned on the engine thread (through its KV
   connector, `engine.kv_connector`, as every engine call here) while the request goes
   out, so they cannot be evicted before the request is admitted (which would
   waste every imported block after the gap);
2. call `KVTransfer.Prefill` on the prefill worker (the request names this worker's KV cache
   dtype), check the header against this worker's layout (KV cache dtype included) and its
   own hash chain, then pin blocks for the offered ones on the engine thread,
   all or none (reusing any that appeared meanwhile), plus a fresh block for the prompt's
   last block when the offer reaches it, so the request is admitted without a free block;
   with no room for them all, the prompt is computed here instead;
3. receive the pages through the backend: each layer, once validated, goes to the engine's
   `PageSink` for the pinned blocks from a writer thread while the next one arrives
   (nothing references blocks that are not registered yet, so the engine keeps stepping);
   the sink decides how pages reach the cache, whatever the engine's tensor-parallel size;
4. on the engine thread: register the full blocks in the prefix cache (KV events go out)
   and stage the last one (its partial tokens, if any) for `request_id`
   (`KVCacheManager.stage_tail`), then acknowledge the lease. On any failure the pins are
   dropped once no write is running.

The engine then schedules the request as usual (needing no free block, it is admitted even
past a waiting request that does not fit): its prefix lookup hits the local and imported
blocks, takes over the staged block, and computes only the prompt's last token (whose
logits give the first token), as a one-token step in the decode batch. An offer of fewer
full blocks than asked is refused (`partial`). Failures raise `KVTransferError`; the caller
applies its policy (`recompute`: serve it locally; `fail`: answer an error), except
`NoRoomForImport`, after which the prompt is always computed here. Everything is bounded by
`timeout_s`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.block_pool import KVBlock
from tandem.engine.kv_connector.base import KVConnector, PageSinkAPI
from tandem.engine.kv_pages import ImportCommit, ImportPins
from tandem.kvtransfer.base import TransferBackend, make_backend
from tandem.kvtransfer.grpc_backend import decode_chunk
from tandem.kvtransfer.pages import KVTransferError, Offer, check_header
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.block_hash import BlockHash, hash_block_chain, request_hash_keys, root_hash
from tandem.protocol.signing import (
    PREFILL_RPC,
    RELEASE_PAGES_RPC,
    SIGNATURE_HEADER,
    WorkerKey,
    rpc_body,
    rpc_metadata,
)
from tandem.protocol.tls import TLSFiles
from tandem.protocol.tls_peers import PeerChannel

logger = logging.getLogger(__name__)
POLICIES = ("recompute", "fail")
# a layer of 4096 blocks of a large model exceeds any sane message; pages come in chunks
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 8 << 20),
                   ("grpc.max_send_message_length", 8 << 20)]


@dataclass(frozen=True)
class RemotePrefillSettings:
    backend: str = "grpc"
    policy: str = "recompute"  # on failure: "recompute" locally or "fail" the request
    timeout_s: float = 30.0  # the whole fetch: prefill compute + transfer + import
    lease_s: float = 30.0
    advertise_host: str = "127.0.0.1"  # torch backend: where prefill workers reach this one

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.backend == "torch":  # the store binds there: fail at start, not per fetch
            try:
                socket.getaddrinfo(self.advertise_host, 0, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise ConfigError(f"kv transfer host {self.advertise_host!r} does not "
                                  f"resolve: {exc}") from exc


@dataclass(frozen=True)
class FetchPlan:
    """What to ask a prefill worker for: full blocks [first, first + num) of the prompt's
    hash `chain` (this worker holds the ones before `first`), then `tail_tokens` tokens of
    its partial block (0: none)."""

    chain: list[BlockHash]  # the prompt's full blocks before its last token
    first: int
    num: int
    tail_tokens: int


@dataclass
class Imported:
    """Blocks pinned for request `request_id` until `RemotePrefill.unpin` (which also drops
    its staged partial block, unless the request took it over)."""

    request_id: str
    blocks: list[KVBlock]  # the full blocks
    local: list[KVBlock]  # the local prefix before them, pinned for the request's admission
    num_transferred: int  # full blocks whose pages arrived (the rest were already here)
    tail_tokens: int  # tokens of the staged partial block (0: none)
    first_token: int  # the prefill worker's greedy first token (informational)
    bytes: int


class RemotePrefill:
    def __init__(self, engine: AsyncLLMEngine, model_id: str,
                 settings: RemotePrefillSettings | None = None,
                 tls: TLSFiles | None = None, key: WorkerKey | None = None) -> None:
        """`tls`: mutual TLS to prefill workers, each verified against `tls.server_name`
        when set; a channel is rebuilt once the files changed (renewed certificates).
        `key`: the worker auth key each Prefill call is signed with (`protocol.signing`)."""
        self.key = key
        self.engine = engine
        self.kv: KVConnector = engine.kv_connector
        self.model_id = model_id
        self.settings = settings or RemotePrefillSettings()
        self.tls = tls
        self.layout = self.kv.layout(model_id)
        self._channels: dict[str, PeerChannel] = {}
        self._backend: TransferBackend = make_backend(self.settings.backend)
        self._backend.configure(device=self.kv.device,
                                advertise_host=self.settings.advertise_host,
                                layout=self.layout)
        self._writer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-import")
        self._releases: set[asyncio.Task] = set()  # unpins and lease releases, in flight

    def _channel(self, target: str) -> grpc.aio.Channel:
        ch = self._channels.get(target)
        if ch is None:  # a replaced channel's fetches get the whole fetch timeout to end
            ch = self._channels[target] = PeerChannel(target, self.tls, CHANNEL_OPTIONS,
                                                      self.settings.timeout_s)
        return ch.get()

    def _stub(self, target: str) -> worker_pb2_grpc.KVTransferStub:
        return worker_pb2_grpc.KVTransferStub(self._channel(target))

    def lora_digest(self, lora_name: str | None) -> str | None:
        """The weight digest of this engine's adapter `lora_name` (None: the base model, or
        an adapter not loaded here: nothing is imported for it)."""
        return self.engine.lora_digest(lora_name)

    def plan(self, token_ids: list[int], cache_salt: str,
             lora_digest: str | None = None) -> FetchPlan:
        """Reads the prefix cache without locking: a stale answer only moves work between
        sides. `lora_digest`: the adapter's weight digest (None: the base model)."""
        bs = self.layout.block_size
        usable = (len(token_ids) - 1) // bs  # the engine never serves the last token cached
        chain = hash_block_chain(token_ids[: usable * bs], bs,
                                 request_hash_keys(self.model_id, lora_digest, cache_salt))
        local = self.kv.cached_prefix_len(chain)
        return FetchPlan(chain, local, usable - local, len(token_ids) - 1 - usable * bs)

    async def fetch(self, target: str, request_id: str, token_ids: list[int],
                    cache_salt: str = "", lora_name: str | None = None) -> Imported | None:
        """Import the missing blocks' pages from `target` (host:port of its gRPC) for engine
        request `request_id`, computed there with adapter `lora_name` (None: the base
        model); None when no full block is missing. Raises KVTransferError."""
        if not self.kv.prefix_caching:
            return None  # imported blocks could never be hit: compute the prompt here
        digest = self.lora_digest(lora_name)
        if lora_name and digest is None:
            return None  # not loaded here (any more): the engine answers the request 404
        plan = self.plan(token_ids, cache_salt, digest)
        chain, first = plan.chain, plan.first
        if plan.num <= 0:
            return None
        # pinned at the next step boundary, while the prefill worker computes
        local_pin = asyncio.ensure_future(self.kv.pin_cached(chain[:first]))
        req = worker_pb2.PrefillRequest(
            request_id=request_id, model_id=self.model_id, token_ids=token_ids,
            cache_salt=cache_salt, block_size=self.layout.block_size, first_block=first,
            num_blocks=plan.num, backend=self._backend.name, lease_s=self.settings.lease_s,
            tail_tokens=plan.tail_tokens, kv_cache_dtype=self.layout.cache_dtype,
            lora_name=lora_name or "", lora_digest=digest or "")
        writer: _PageWriter | None = None
        header: worker_pb2.PageHeader | None = None
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                async with self._prefill_call(req, target) as it:
                    header, offer = await self._header(it, chain[first:], first,
                                                       plan.tail_tokens)
                    if offer.num_full < plan.num:
                        # its pins would hold blocks while the request still needs free
                        # ones for the rest of the prompt: that can wedge the pool
                        raise KVTransferError(
                            "partial", f"the prefill worker offered {offer.num_full} of "
                                       f"the {plan.num} blocks asked for")
                    local = await self.pin_local(local_pin, request_id, first)
                    hashes = chain[first:first + offer.num_full]
                    writer = _PageWriter(self._writer_pool, offer)
                    await writer.pin(self.kv, hashes)
                    if not writer.pins.pinned:
                        raise NoRoomForImport(request_id, offer.num_blocks)
                    await self.receive(req, header, offer, it, writer)
                await writer.flush()
                n = offer.num_full
                parent = chain[first - 1] if first else root_hash(
                    request_hash_keys(self.model_id, digest, cache_salt))
                bs = self.layout.block_size
                tokens = token_ids[first * bs:(first + n) * bs]
                tail_ids = token_ids[(first + n) * bs:(first + n) * bs + offer.tail_tokens]
                tail = writer.split()[1]
                writer.committed = True  # once sent, the commit runs even if we are cancelled
                # staged, the tail block is the request's to drop; the commit updates the
                # pins in place (release reads them)
                full = await self.kv.commit_import(writer.pins, ImportCommit(
                    request_id, hashes[:n], parent, tokens, first + n, tail_ids,
                    lora_name or "", digest or ""))
        except BaseException as exc:
            if writer is not None:  # after the commit (if sent) and every running write
                writer.release(self.kv, self._releases, request_id)
            self._release_later(local_pin)
            if header is not None:  # its pages may all be sent: the lease is not waited out
                self._ack_later(target, header.lease_id)
            raise_transfer_error(exc, f"remote prefill from {target}", self.settings.timeout_s)
            raise
        self._ack_later(target, header.lease_id)
        return Imported(request_id, full, local, n,
                        offer.tail_tokens if tail is not None else 0,
                        header.first_token,
                        offer.num_blocks * self.layout.num_layers * self.layout.block_layer_bytes)

    @contextlib.asynccontextmanager
    async def _prefill_call(self, req: worker_pb2.PrefillRequest, target: str
                            ) -> AsyncIterator[AsyncIterator[Any]]:
        """The signed Prefill call for `req` on `target`, as its reply stream; the backend
        prepares `req` first and is released after, whatever happens."""
        await self._backend.prepare(req, target)
        try:
            raw = rpc_body(req)  # encoded once: signed, and sent as is
            metadata = None if self.key is None else (
                (SIGNATURE_HEADER, self.key.sign(raw, PREFILL_RPC)),)
            call = prefill_method(self._channel(target))(raw, metadata=metadata)
            try:
                yield call.__aiter__()
            finally:
                call.cancel()  # a no-op once complete; frees the stream otherwise
        finally:
            await self._backend.release(req)

    async def _header(self, it: AsyncIterator[Any], expected: list[BlockHash], first: int,
                      tail_tokens: int, sender: str = "prefill worker", none_ok: bool = False
                      ) -> tuple[worker_pb2.PageHeader, Offer]:
        """The stream's header from `sender`, checked; and what it offers (at least one full
        block unless `none_ok`)."""
        try:
            msg = await it.__anext__()
        except StopAsyncIteration as exc:
            raise KVTransferError("incomplete", f"the {sender}'s stream ended at once") from exc
        if not isinstance(msg, worker_pb2.PageChunk) or msg.WhichOneof("kind") != "header":
            raise KVTransferError("invalid", f"the {sender}'s stream did not start with a "
                                             "header")
        header = msg.header
        offer = check_header(header, self.layout, first, expected, tail_tokens)
        if offer.num_full == 0 and not none_ok:
            raise KVTransferError("invalid", f"the {sender} offered no blocks")
        return header, offer

    async def pin_local(self, local_pin: asyncio.Future, request_id: str,
                        first: int) -> list[KVBlock]:
        """The pins of the `first` local blocks (`local_pin`'s), warning of any evicted
        before they were pinned."""
        local = await asyncio.shield(local_pin)
        if len(local) < first:
            logger.warning("[%s] local blocks %d..%d were evicted before they were pinned; "
                           "they will be recomputed", request_id, len(local), first - 1)
        return local

    async def receive(self, req: worker_pb2.PrefillRequest, header: worker_pb2.PageHeader,
                      offer: Offer, it: AsyncIterator[Any], writer: _PageWriter) -> None:
        """The offered pages from `it` into `writer`'s pinned blocks, through the backend
        the header names (else the request's)."""
        backend = self._backend.for_transport(header.transport or req.backend)
        await backend.receive(req, self.layout, offer.num_blocks, it, writer)

    def _ack_later(self, target: str, lease_id: str) -> None:
        """Release the sender's lease `lease_id` (none: "") in the background: after an
        import, or a fetch that failed once the header named it."""
        if lease_id:
            task = asyncio.ensure_future(self._ack(target, lease_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _ack(self, target: str, lease_id: str) -> None:
        try:
            req = worker_pb2.ReleasePagesRequest(lease_id=lease_id)
            await self._stub(target).ReleasePages(  # signed: the prefill worker checks
                req, timeout=5, metadata=rpc_metadata(self.key, req, RELEASE_PAGES_RPC))
        except grpc.RpcError as exc:  # the lease expires on its own
            logger.warning("could not release lease %s on %s: %s", lease_id, target,
                           _details(exc))

    def _release_later(self, pin: asyncio.Future) -> None:
        """Unpin what the local-prefix pin call pinned, once it has run (a failed fetch)."""
        async def run() -> None:
            try:
                blocks = await pin
            except BaseException:  # noqa: BLE001 - nothing was pinned
                return
            await self.kv.unpin(blocks)

        task = asyncio.ensure_future(run())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def unpin(self, imported: Imported) -> None:
        """Drop the pins of the imported and the local blocks, and the staged partial block
        if still staged."""
        await self.kv.unpin(imported.local + imported.blocks,
                                drop_tail=imported.request_id)

    async def close(self) -> None:
        await self._backend.close()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._writer_pool.shutdown(wait=False)


class NoRoomForImport(KVTransferError):
    """The pool cannot supply every block of an import at once: the prompt is computed
    where it decodes (whatever the failure policy: nothing failed)."""

    def __init__(self, request_id: str, num_blocks: int) -> None:
        super().__init__("no_room", f"[{request_id}] no room to pin {num_blocks} imported "
                                    "blocks")


def prefill_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """`KVTransfer.Prefill` whose data replies decode without copying their payload; the
    request is a `PrefillRequest` or its encoding (`rpc_body`, as signed)."""
    return channel.unary_stream("/tandem.v1.KVTransfer/Prefill",
                                request_serializer=_encode_request,
                                response_deserializer=decode_chunk)


def _encode_request(request: worker_pb2.PrefillRequest | bytes) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


_T = TypeVar("_T")

# a layer of at most this many bytes (host memory) is written on the event loop: tens of
# microseconds, less than the hand-off to the writer thread and back
INLINE_WRITE = 256 << 10


def inline_write(pages: torch.Tensor) -> bool:
    """True for pages a sink writes on the event loop (host, at most `INLINE_WRITE`)."""
    return pages.device.type == "cpu" and pages.numel() * pages.element_size() <= INLINE_WRITE


class _PageWriter:
    """Pins the blocks of one import and writes validated layers into them through the
    connector's page sink on `executor` (one thread: the copies are memory-bound). Tracks the
    pins and the writes, so a failed import unpins only after every write into those blocks
    has ended."""

    def __init__(self, executor: ThreadPoolExecutor, offer: Offer) -> None:
        self.executor = executor
        self.offer = offer
        self.pins = ImportPins([], [])  # the full blocks, then the staged one if pinned
        self.released = False  # no write starts after `release`
        self.committed = False  # the commit (which stages the partial block) was sent
        self._pin: asyncio.Future | None = None
        self._ids: list[int] = []
        self._sink: PageSinkAPI | None = None  # None: nothing to write (every block was here)
        self._select: torch.Tensor | None = None
        self._select_list: list[int] | None = None  # the same positions, for `write_hashed`
        self._writes: list[concurrent.futures.Future] = []

    async def pin(self, kv: KVConnector, hashes: list[BlockHash], tail: bool = True) -> None:
        """Pin blocks for `hashes` (every full block up to the prompt's last one) and one for
        the last block (engine thread), all or none: `pins` stays empty when the pool
        cannot supply them (without `tail`: the full blocks only, as a peer pull pins). The
        positions to write are the fresh ones among those the offer has pages for (the last
        block has none without a partial block in the offer)."""
        self._pin = asyncio.ensure_future(kv.import_blocks(hashes, tail=tail))
        self.pins = await asyncio.shield(self._pin)
        fresh = [i for i in self.pins.fresh if i < self.offer.num_blocks]
        self._ids = [self.pins.blocks[i].block_id for i in fresh]
        if fresh != list(range(self.offer.num_blocks)):
            self._select = torch.tensor(fresh, dtype=torch.int64)
            self._select_list = fresh
        if self._ids:
            self._sink = kv.page_sink(self._ids)

    def split(self) -> tuple[list[KVBlock], KVBlock | None]:
        """(the pinned full blocks, the pinned block for the last one, or None)."""
        n = self.offer.num_full
        pinned = self.pins.blocks
        return pinned[:n], (pinned[n] if len(pinned) > n else None)

    async def write(self, layer: int, pages: torch.Tensor) -> None:
        """The backend's sink: write one layer's `[2, n, kvh, bs, row]` pages."""
        if self._sink is None or self.released:
            return
        await self._run(pages, self._write, layer, pages)

    async def __call__(self, layer: int, pages: torch.Tensor) -> None:
        await self.write(layer, pages)

    async def write_hashed(self, layer: int, pages: torch.Tensor) -> int | None:
        """`HashingSink`'s: write the layer's fresh blocks while hashing every page; None
        (nothing written) where the page sink cannot hash (`PageSink.write_hashed`)."""
        if self._sink is None or self.released:
            return None
        return await self._run(pages, self._sink.write_hashed, layer, pages,
                               self._select_list)

    async def _run(self, pages: torch.Tensor, fn: Callable[..., _T], *args: object) -> _T:
        """`fn(*args)` writing `pages`: on the event loop when they are small
        (`inline_write`), else on the writer thread, tracked until it ends."""
        if inline_write(pages):
            return fn(*args)
        cf = self.executor.submit(fn, *args)
        self._writes.append(cf)
        return await asyncio.wrap_future(cf)

    def _write(self, layer: int, pages: torch.Tensor) -> None:
        if self._select is not None:
            pages = pages.index_select(1, self._select)
        self._sink.write(layer, pages)  # type: ignore[union-attr]

    async def flush(self) -> None:
        """Every layer received: the pages are in the engine's cache when this returns."""
        if self._sink is None or self.released:
            return
        try:
            await self._sink.finish()
        except ValueError as exc:
            raise KVTransferError("incomplete", str(exc)) from exc

    def release(self, kv: KVConnector, tasks: set[asyncio.Task],
                request_id: str) -> None:
        """Unpin once the pin call and every write have ended (in the background: this runs
        on failure and cancellation). A committed partial block is staged for `request_id`
        by then, and dropped from there."""
        self.released = True
        committed = self.committed

        async def run() -> None:
            if self._pin is not None and not self._pin.done():
                with contextlib.suppress(BaseException):
                    await self._pin
            if self._pin is None or self._pin.cancelled() or self._pin.exception():
                return
            running = [cf for cf in self._writes if not cf.done()]
            if running:
                await asyncio.get_running_loop().run_in_executor(
                    None, concurrent.futures.wait, running)
            # the pin's own result (`self.pins` is unset when `pin` was cancelled waiting),
            # its blocks read on the engine thread: a commit sent before swapped some; once
            # committed, the last block is staged: dropped from there
            pins: ImportPins = self._pin.result()  # type: ignore[union-attr]
            await kv.unpin(pins.blocks, limit=self.offer.num_full if committed else None,
                               drop_tail=request_id if committed else None)

        task = asyncio.ensure_future(run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def _details(exc: grpc.RpcError) -> str:
    return exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


def raise_transfer_error(exc: BaseException, what: str, timeout_s: float) -> None:
    """Raise the `KVTransferError` a fetch's timeout or RPC failure `exc` stands for (`what`
    names the fetch: "remote prefill from HOST:PORT"); return for any other exception."""
    if isinstance(exc, TimeoutError):
        raise KVTransferError("timeout", f"{what} took over {timeout_s:g} s") from exc
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        raise KVTransferError("unavailable" if code == grpc.StatusCode.UNAVAILABLE else "rpc",
                              f"{what} failed: {code}: {_details(exc)}") from exc
