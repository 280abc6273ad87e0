"""Decode side: fetch the KV pages of a prompt's missing blocks from a prefill worker.

`RemotePrefill.fetch(target, request_id, token_ids, cache_salt)`:
1. hash the prompt as the engine does and count the leading blocks this worker already
   holds; only the full blocks after those (up to the last one the engine could ever serve
   from cache) are asked for;
2. call `KVTransfer.Prefill` on the prefill worker, check the header against this worker's
   layout and its own hash chain, receive the pages through the backend (validated,
   checksum verified);
3. on the engine thread: pin blocks (reusing any that appeared meanwhile), write the pages,
   register them in the prefix cache (KV events go out), then acknowledge the lease.

The engine then schedules the request as usual: its prefix lookup hits the imported blocks
and it computes only the prompt's tail (less than one block, and at least the last token,
whose logits give the first token). A block that could not be imported is simply computed.
Failures raise `KVTransferError`; the caller applies its policy (`recompute`: serve it
locally; `fail`: answer an error). Everything is bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.kv_cache.block_pool import KVBlock
from tandem.kvtransfer.base import TransferBackend, make_backend
from tandem.kvtransfer.grpc_backend import decode_chunk
from tandem.kvtransfer.pages import KVTransferError, PageLayout, check_header, scatter_layer
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.block_hash import BlockHash, HashKeys, hash_block_chain, root_hash

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


@dataclass
class Imported:
    """Blocks pinned for one request until `RemotePrefill.unpin`."""

    blocks: list[KVBlock]
    num_transferred: int  # blocks whose pages arrived (the rest were already here)
    first_token: int  # the prefill worker's greedy first token (informational)
    bytes: int


class RemotePrefill:
    def __init__(self, engine: AsyncLLMEngine, model_id: str,
                 settings: RemotePrefillSettings | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.engine = engine
        self.model_id = model_id
        self.settings = settings or RemotePrefillSettings()
        self.credentials = credentials
        self.layout = PageLayout.of(model_id, engine.engine.runner.kv_caches)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._backend: TransferBackend = make_backend(self.settings.backend)
        self._backend.configure(device=engine.engine.runner.kv_caches[0][0].device,
                                advertise_host=self.settings.advertise_host)

    def _channel(self, target: str) -> grpc.aio.Channel:
        ch = self._channels.get(target)
        if ch is None:
            if self.credentials is not None:
                ch = grpc.aio.secure_channel(target, self.credentials, options=CHANNEL_OPTIONS)
            else:
                ch = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            self._channels[target] = ch
        return ch

    def _stub(self, target: str) -> worker_pb2_grpc.KVTransferStub:
        return worker_pb2_grpc.KVTransferStub(self._channel(target))

    def plan(self, token_ids: list[int], cache_salt: str) -> tuple[list[BlockHash], int, int]:
        """(the prompt's usable block hashes, first missing block, blocks to fetch). Reads
        the prefix cache without locking: a stale answer only moves work between sides."""
        bs = self.layout.block_size
        usable = (len(token_ids) - 1) // bs  # the engine never serves the last token cached
        chain = hash_block_chain(token_ids[: usable * bs], bs,
                                 HashKeys(self.model_id, "", cache_salt))
        pool = self.engine.engine.kv.pool
        local = 0
        while local < usable and pool.get_cached_block(chain[local]) is not None:
            local += 1
        return chain, local, usable - local

    async def fetch(self, target: str, request_id: str, token_ids: list[int],
                    cache_salt: str = "") -> Imported | None:
        """Import the missing blocks' pages from `target` (host:port of its gRPC); None when
        nothing is missing. Raises KVTransferError."""
        chain, first, num = self.plan(token_ids, cache_salt)
        if num <= 0:
            return None
        req = worker_pb2.PrefillRequest(
            request_id=request_id, model_id=self.model_id, token_ids=token_ids,
            cache_salt=cache_salt, block_size=self.layout.block_size, first_block=first,
            num_blocks=num, backend=self.settings.backend, lease_s=self.settings.lease_s)
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await self._backend.prepare(req, target)
                try:
                    call = prefill_method(self._channel(target))(req)
                    try:
                        pages, header, n = await self._receive(req, call, chain[first:],
                                                               first)
                    finally:
                        call.cancel()  # a no-op once complete; frees the stream otherwise
                finally:
                    await self._backend.release(req)
                parent = chain[first - 1] if first else root_hash(
                    HashKeys(self.model_id, "", cache_salt))
                hashes = chain[first:first + n]
                bs = self.layout.block_size
                tokens = token_ids[first * bs:(first + n) * bs]
                blocks = await self._import(hashes, parent, tokens, pages)
        except TimeoutError as exc:
            raise KVTransferError("timeout", f"remote prefill from {target} took over "
                                             f"{self.settings.timeout_s:g} s") from exc
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            raise KVTransferError("unavailable" if code == grpc.StatusCode.UNAVAILABLE
                                  else "rpc", f"remote prefill from {target} failed: "
                                              f"{code}: {_details(exc)}") from exc
        asyncio.ensure_future(self._ack(target, header.lease_id))
        return Imported(blocks, n, header.first_token, n * self.layout.num_layers
                        * self.layout.block_layer_bytes)

    async def _import(self, hashes: list[BlockHash], parent: BlockHash, tokens: list[int],
                      pages: list[torch.Tensor]) -> list[KVBlock]:
        """Pin fresh blocks (engine thread), write the pages into them (a worker thread: the
        engine keeps stepping; nothing references unregistered blocks), register them
        (engine thread). Shielded from the fetch's timeout: queued engine calls run anyway,
        so when the timeout fires first the pinned blocks are unpinned once it is done."""
        task = asyncio.ensure_future(self._import_steps(hashes, parent, tokens, pages))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._drop_import)
            raise

    async def _import_steps(self, hashes: list[BlockHash], parent: BlockHash,
                            tokens: list[int], pages: list[torch.Tensor]) -> list[KVBlock]:
        pinned, fresh = await self.engine.call(lambda e: e.kv.import_blocks(hashes))
        try:
            if fresh:
                caches = self.engine.engine.runner.kv_caches
                await asyncio.to_thread(_write_pages, caches, pinned, fresh, pages)
            await self.engine.call(lambda e: e.kv.commit_import(pinned, hashes, parent,
                                                                tokens))
        except BaseException:
            await self.engine.call(lambda e: e.kv.unpin(pinned))
            raise
        return pinned

    def _drop_import(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            blocks = task.result()
            asyncio.ensure_future(self.engine.call(lambda e: e.kv.unpin(blocks)))

    async def _receive(self, req: worker_pb2.PrefillRequest, call: grpc.aio.UnaryStreamCall,
                       expected: list[BlockHash], first: int
                       ) -> tuple[list[torch.Tensor], worker_pb2.PageHeader, int]:
        it = call.__aiter__()
        try:
            msg = await it.__anext__()
        except StopAsyncIteration as exc:
            raise KVTransferError("incomplete", "the prefill stream ended at once") from exc
        if not isinstance(msg, worker_pb2.PageChunk) or msg.WhichOneof("kind") != "header":
            raise KVTransferError("invalid", "the prefill stream did not start with a header")
        header = msg.header
        n = check_header(header, self.layout, first, expected)
        if n == 0:
            raise KVTransferError("invalid", "the prefill worker offered no blocks")
        pages = await self._backend.receive(req, self.layout, n, it)
        return pages, header, n

    async def _ack(self, target: str, lease_id: str) -> None:
        try:
            await self._stub(target).ReleasePages(
                worker_pb2.ReleasePagesRequest(lease_id=lease_id), timeout=5)
        except grpc.RpcError as exc:  # the lease expires on its own
            logger.warning("could not release lease %s on %s: %s", lease_id, target,
                           _details(exc))

    async def unpin(self, imported: Imported) -> None:
        blocks = imported.blocks
        await self.engine.call(lambda e: e.kv.unpin(blocks))

    async def close(self) -> None:
        await self._backend.close()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


def prefill_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """`KVTransfer.Prefill` whose data replies decode without copying their payload."""
    return channel.unary_stream("/tandem.v1.KVTransfer/Prefill",
                                request_serializer=worker_pb2.PrefillRequest.SerializeToString,
                                response_deserializer=decode_chunk)


def _write_pages(caches: list[tuple[torch.Tensor, torch.Tensor]], pinned: list[KVBlock],
                 fresh: list[int], pages: list[torch.Tensor]) -> None:
    """Write the received pages of the `fresh` chain positions into their pinned blocks."""
    ids = [pinned[i].block_id for i in fresh]
    n = pages[0].shape[1] if pages else 0
    sel = None if fresh == list(range(n)) else torch.tensor(fresh, dtype=torch.int64)
    for layer, layer_pages in enumerate(pages):
        scatter_layer(caches, layer, ids,
                      layer_pages if sel is None else layer_pages.index_select(1, sel))


def _details(exc: grpc.RpcError) -> str:
    return exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
