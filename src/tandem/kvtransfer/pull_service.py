"""Holder side of a peer pull: `KVTransfer.Prefill` with `cached_only`.

A worker that holds a prompt's blocks serves another worker's pull of them without computing
anything: it leases the leading run of the asked blocks its cache holds (`HeldBlocks`; the
device pool's prefix cache, then, on a worker with KV tiers, the host and disk tiers' blocks
loaded into the pool: `TierHeld`), sends the header naming
exactly those blocks (possibly none: then the stream ends after the header) and their pages
through the asked backend, with the same per-layer digests and trailer as a P/D send. The
pins are one connector `PageLease` under the service's lease table: released by
`ReleasePages`, by a stream that fails or is cancelled, or at the lease's expiry (the
engine's). The only engine-thread work is the lease and (with tensor parallelism) the page
export, each run between two steps: a saturated holder answers after at most one step, never
behind its queue. Any role serves it (a decode worker's cache is as good as any).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from tandem.engine.kv_cache.leases import LeaseError, PageLease
from tandem.engine.kv_connector.base import KVConnector
from tandem.kvtransfer.base import SendJob
from tandem.kvtransfer.pages import KVTransferError, header_for
from tandem.protocol import worker_pb2
from tandem.protocol.block_hash import (
    BlockHash,
    hash_block_chain,
    request_hash_keys,
    root_hash,
)

if TYPE_CHECKING:
    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.kvtransfer.service import KVTransferService

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockRun:
    """The blocks a cached-only call asks for: `hashes` (a chain after `parent_hash`),
    `token_ids` (the blocks' tokens, `len(hashes)` full blocks), the adapter they were
    computed with ("": the base model)."""

    hashes: list[BlockHash]
    parent_hash: BlockHash
    token_ids: list[int]
    lora_name: str = ""
    lora_digest: str = ""


class HeldBlocks(Protocol):
    """Where a cached-only send finds the blocks it offers: `lease` pins, in the device
    pool, the leading run of `run.hashes` this worker can serve and returns the lease on
    them (possibly on none)."""

    async def lease(self, kv: KVConnector, owner: str, run: BlockRun,
                    lease_s: float) -> PageLease: ...


class DeviceHeld:
    """The device pool's prefix cache only (`KVConnector.lease_cached`)."""

    async def lease(self, kv: KVConnector, owner: str, run: BlockRun,
                    lease_s: float) -> PageLease:
        return await kv.lease_cached(owner, run.hashes, lease_s)


class TierHeld:
    """The device pool's prefix cache, then the KV tiers (`engine/kv_tiers`) under it: the
    blocks after the device-held run that the host or disk tier holds are loaded into
    device blocks and cached as computed, verified on the way in exactly as an admission's
    tier load (`OffloadConnector.load_into_cache`), and the whole run is leased. A tier
    block that is missing or fails verification ends the run there; with no room in the
    pool, the device run alone is served. One engine-thread call, between two steps."""

    async def lease(self, kv: KVConnector, owner: str, run: BlockRun,
                    lease_s: float) -> PageLease:
        from tandem.engine.kv_connector.offload import OffloadConnector

        if not isinstance(kv, OffloadConnector):
            return await kv.lease_cached(owner, run.hashes, lease_s)
        return await kv.lease_with_tiers(owner, run.hashes, run.parent_hash, run.token_ids,
                                         run.lora_name, run.lora_digest, lease_s)


def held_blocks_for(engine: AsyncLLMEngine) -> HeldBlocks:
    """The source a worker's cached-only sends use: its tiers too when it has them."""
    from tandem.engine.kv_connector.offload import OffloadConnector

    return TierHeld() if isinstance(engine.kv_connector, OffloadConnector) else DeviceHeld()


async def send_cached(service: KVTransferService, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext, engine: AsyncLLMEngine
                      ) -> AsyncIterator[worker_pb2.PageChunk]:
    """The reply stream of an authorized `cached_only` Prefill call (module doc)."""
    from tandem.kvtransfer.service import DEFAULT_LEASE_S, _adapter_digest

    problem = service._check(request, engine)
    if problem is None and request.tail_tokens:
        problem = "a cached_only request sends full blocks only: tail_tokens must be 0"
    if problem is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    digest, problem = _adapter_digest(request, engine)
    if problem is not None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
    kv = engine.kv_connector
    layout = kv.layout(service.model_id)
    bs = engine.state.block_size
    first, num = request.first_block, request.num_blocks
    keys = request_hash_keys(service.model_id, digest, request.cache_salt)
    chain = hash_block_chain(list(request.token_ids[: (first + num) * bs]), bs, keys)
    hashes = chain[first:]
    owner = f"pull-{request.request_id[:64] or 'anon'}-{next(service._ids)}"
    lease_s = request.lease_s or DEFAULT_LEASE_S
    parent = chain[first - 1] if first else root_hash(keys)
    run = BlockRun(hashes, parent, list(request.token_ids[first * bs: (first + num) * bs]),
                   request.lora_name if digest else "", digest or "")
    source_of = service.held_blocks or held_blocks_for(engine)
    held = await source_of.lease(kv, owner, run, lease_s)
    n = len(held.block_ids)
    if n == 0:  # nothing to pin: say so and end cleanly
        await kv.release(held)
        logger.info("[%s] peer pull: none of %d blocks held", owner, num)
        yield worker_pb2.PageChunk(header=header_for(layout, first, [], "", 0))
        return
    leases = service.leases(kv)
    lease = leases.add(owner, lease_s, held.lease_id)
    sent = False
    try:
        source = await kv.page_source(held)
        header = header_for(layout, first, hashes[:n], lease.lease_id, 0)
        transport = service.transport(request, header, n * layout.block_layer_bytes)
        yield worker_pb2.PageChunk(header=header)
        loop = asyncio.get_running_loop()
        job = SendJob(request, layout, list(source.block_ids), source.layer,
                      loop.time() + lease_s, source.views)
        async for chunk in service.backend(transport).send(job):
            yield chunk
        sent = True
        logger.info("[%s] peer pull: sent %d of %d blocks x %d layers (%s), lease %.0f s",
                    owner, n, num, layout.num_layers, transport, lease_s)
    except KVTransferError as exc:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if exc.reason == "expired"
                            else grpc.StatusCode.INTERNAL, str(exc))
    except LeaseError as exc:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if exc.expired
                            else grpc.StatusCode.INTERNAL, str(exc))
    finally:
        if not sent:  # nobody will acknowledge these pages
            await leases.release(lease.lease_id, "stream not completed")
