"""Peer pulls: a worker that lacks a prefix another replica holds pulls the blocks over KV
transfer instead of recomputing them, when the router's cost model says the pull is faster.

For the picked decode-side worker `c`, if it can pull (its /ready names a KV transfer backend;
`annotate`, after the pick), the holder is the routable
worker (any role) with the longest leading run of the prompt's blocks in any medium
(`index.Hit`), longer than `c`'s own, that hashes the prompt as `c` does, has a known gRPC
address and a KV cache dtype `c` can take (`pd.kv_compatible`'s rule). For the `extra`
blocks the holder has beyond `c`'s run:

    pull_s      = extra x c's measured peer_pull_s_per_block
                  (unmeasured: kv_block_bytes / DEFAULT_PULL_BYTES_PER_S, the measured gRPC
                  transfer rate; no block size known either: no pull)
                  + the holder's load of those blocks it holds only in its host or disk tier
                  (its measured host/disk_load_s_per_block; unmeasured: one more pull time)
    recompute_s = extra x block tokens x c's prefill_s_per_token (`kvcredit.fallback_rate`
                  when unmeasured)

The pull is offered when `pull_s < recompute_s`. The ranking does not credit it: a holder
keeps the prompt unless its load makes another worker cheaper even at full recompute
(pulled copies on every replica would churn their caches), so only the winner is costed,
and only when it lacks part of the prompt. Its offer becomes the request's
`x-tandem-kv-peer`
(the holder's gRPC target) and `x-tandem-kv-peer-blocks` (the holder's run, a hint) headers,
signed with the router's key (`web.forward_target`); never with a P/D prefill worker
(`pd.Route`), and only where the router signs requests (`RouterSettings.peer_pull`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.protocol.block_hash import BlockHash
from tandem.protocol.kv_events import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST
from tandem.router.index import Hit, PrefixIndex
from tandem.router.kvcredit import fallback_rate, saved_tokens
from tandem.router.scorers.base import RoutingContext
from tandem.router.workers import HashGroup, Worker

DEFAULT_PULL_BYTES_PER_S = 1.0e9  # the gRPC KV transfer's measured ~1.1 GB/s, rounded down
HOLDERS_TRIED = 8  # longest runs considered per hash group (the first compatible one wins)


@dataclass(frozen=True)
class PeerPull:
    """A pull of `extra` blocks by the chosen worker from `holder`."""

    holder: Worker
    blocks: int  # the holder's leading run of the prompt's blocks (the blocks header)
    extra: int  # blocks beyond the chosen worker's own run
    medium: str  # the slowest medium the pulled blocks come from on the holder
    pull_s: float  # estimated seconds to pull them
    recompute_s: float  # estimated seconds to compute them instead
    saved_tokens: float  # prompt tokens' worth of prefill the pull saves


def _eligible_holder(w: Worker, model: str, now: float) -> bool:
    return (w.grpc_target is not None and w.events_connected and w.serves(model)
            and w.routable(now))


def _compatible(a: Worker, b: Worker) -> bool:
    x, y = a.kv_cache_dtype, b.kv_cache_dtype
    return x is None or y is None or x == y


def holders(index: PrefixIndex, workers: Mapping[str, Worker], chain: Sequence[BlockHash],
            group: HashGroup, lora: str | None, model: str, now: float
            ) -> list[tuple[Worker, Hit]]:
    """The eligible holders of `chain` among `workers` (those hashing as `group`), longest
    run of confirmed blocks first (a block only routed there may not be computed yet), at
    most HOLDERS_TRIED. One index walk; only the workers holding its first block are
    checked."""
    hits = index.match_media(chain, now, speculative=False)
    out: list[tuple[Worker, Hit]] = []
    for wid, hit in sorted(hits.items(), key=lambda kv: -kv[1].total):
        w = workers.get(wid)
        if w is not None and _eligible_holder(w, model, now) and w.hash_group(lora) == group:
            out.append((w, hit))
            if len(out) == HOLDERS_TRIED:
                break
    return out


def offer(c: Worker, own: int, holder: Worker, hit: Hit, rate: float) -> PeerPull | None:
    """`c`'s pull of the blocks `holder` holds beyond `c`'s `own` run, if it beats
    recomputing them (module doc)."""
    extra = hit.total - own
    if extra <= 0 or holder.id == c.id or not _compatible(holder, c):
        return None
    per_block = c.load.peer_pull_s_per_block
    if per_block <= 0.0:
        block_bytes = c.load.kv_block_bytes or holder.load.kv_block_bytes
        if not block_bytes:
            return None
        per_block = block_bytes / DEFAULT_PULL_BYTES_PER_S
    # the holder's host and disk blocks among those pulled: loaded there first
    host = max(0, min(hit.device + hit.host, hit.total) - max(own, hit.device))
    disk = max(0, hit.total - max(own, hit.device + hit.host))
    load = holder.load
    pull_s = extra * per_block + host * (load.host_load_s_per_block or per_block) \
        + disk * (load.disk_load_s_per_block or per_block)
    tokens = extra * c.kv_block_size
    recompute_s = tokens * rate
    if not pull_s < recompute_s:
        return None
    medium = MEDIUM_DISK if disk else MEDIUM_HOST if host else MEDIUM_DEVICE
    return PeerPull(holder, hit.total, extra, medium, pull_s, recompute_s,
                    saved_tokens(tokens, pull_s, rate))


def annotate(index: PrefixIndex, workers: Mapping[str, Worker], ctx: RoutingContext,
             c: Worker, candidates: Sequence[Worker], now: float) -> None:
    """Set `ctx.peers[c.id]` to the picked worker `c`'s best pull, if any (module doc; the
    candidates give the fleet's prefill rate when `c` has not measured its own). Reads the
    whole fleet's holders of the prompt, not only the candidates (the holder may be
    saturated or filtered out)."""
    if c.kv_transfer_backend is None:  # not a Tandem worker: it cannot pull
        return
    group = c.hash_group(ctx.lora)
    chain = ctx.hashes.get(group)
    if not chain:
        return
    tier = ctx.tier_hits.get(c.id)
    own = tier.total if tier is not None else ctx.matched_tokens.get(c.id, 0) // c.kv_block_size
    if own >= len(chain):  # it holds the whole chain: nothing to pull
        return
    found = holders(index, workers, chain, group, ctx.lora, ctx.model, now)
    if not found or found[0][1].total <= own:
        return
    rate = c.load.prefill_s_per_token or fallback_rate(candidates)
    for holder, hit in found:
        if hit.total <= own:
            break
        pull = offer(c, own, holder, hit, rate)
        if pull is not None:
            ctx.peers[c.id] = pull
            break
