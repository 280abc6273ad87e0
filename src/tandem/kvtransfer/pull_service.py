"""Holder side of a peer pull: `KVTransfer.Prefill` with `cached_only`.

A worker that holds a prompt's blocks serves another worker's pull of them without computing
anything: it leases the leading run of the asked blocks its cache holds (`_lease_held`: the
device pool's prefix cache, then, on a worker with KV tiers, the host and disk tiers' blocks
loaded into the pool), sends the header naming
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
from typing import TYPE_CHECKING

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


async def _lease_held(kv: KVConnector, owner: str, hashes: list[BlockHash],
                      parent: BlockHash, token_ids: list[int], lora_name: str,
                      lora_digest: str, lease_s: float) -> PageLease:
    """A lease on the leading run of `hashes` (a chain after `parent`, of `token_ids`) this
    worker can serve (possibly on none): the device pool's prefix cache, then, on a worker
    with KV tiers, the blocks after it the host or disk tier holds, loaded into device
    blocks and verified on the way in exactly as an admission's tier load
    (`OffloadConnector.lease_with_tiers`: a tier block missing or failing verification ends
    the run there; with no room in the pool the device run alone is served). One
    engine-thread call, between two steps."""
    from tandem.engine.kv_connector.offload import OffloadConnector

    if isinstance(kv, OffloadConnector):
        return await kv.lease_with_tiers(owner, hashes, parent, token_ids, lora_name,
                                         lora_digest, lease_s)
    return await kv.lease_cached(owner, hashes, lease_s)


_releases: set[asyncio.Task] = set()  # leases of cancelled calls, ended once made


def _release_once_made(kv: KVConnector, leasing: asyncio.Future) -> None:
    async def run() -> None:
        try:
            held = await leasing
        except BaseException:  # noqa: BLE001 - nothing was leased
            return
        await kv.release(held)

    task = asyncio.ensure_future(run())
    _releases.add(task)
    task.add_done_callback(_releases.discard)


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
    leasing = asyncio.ensure_future(_lease_held(
        kv, owner, hashes, parent, list(request.token_ids[first * bs: (first + num) * bs]),
        request.lora_name if digest else "", digest or "", lease_s))
    try:
        held = await asyncio.shield(leasing)
    except asyncio.CancelledError:  # the engine leases all the same: end it once made
        _release_once_made(kv, leasing)
        raise
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
                      loop.time() + lease_s, source.views, gather_into=source.gather_into)
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
