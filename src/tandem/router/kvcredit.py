"""What KV held outside a worker's device pool is worth to a routing decision, in prompt tokens.

A block in a worker's host or disk tier is loaded, not computed: it saves the prefill of its
tokens minus its load time. With the worker's measured prefill rate `rate` (seconds per
token, `WorkerLoad.prefill_s_per_token`) and measured load time `load_s` for those blocks
(`host_load_s_per_block` / `disk_load_s_per_block` x blocks, from `Load`), the blocks count
as `saved_tokens(tokens, load_s, rate) = max(0, tokens - load_s / rate)` cached tokens: a
credit factor between 0 (loading is no faster than computing) and 1 (free) per token. The
prefix and cost scorers add it to the device match (`RoutingContext.credit_tokens`).

Prior: a tier whose load time the worker has not measured yet (0) is credited as a miss, so
an unmeasured tier never wins a route; the worker measures it on its own prefix misses. A
worker with no measured prefill rate is costed at the candidates' median
(`scorers.cost.fleet_rate`, else DEFAULT_PREFILL_S_PER_TOKEN), as the cost policy does.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.index import Hit
from tandem.router.scorers.base import RoutingContext
from tandem.router.scorers.cost import DEFAULT_PREFILL_S_PER_TOKEN, fleet_rate
from tandem.router.workers import Worker


def saved_tokens(tokens: float, load_s: float, rate: float) -> float:
    """Prefill tokens' worth of `tokens` loaded in `load_s` seconds instead of computed at
    `rate` seconds per token: `max(0, tokens - load_s / rate)`; 0 without a rate."""
    if rate <= 0.0 or tokens <= 0:
        return 0.0
    saved = tokens - load_s / rate
    return saved if saved > 0.0 else 0.0


def tier_credit(hit: Hit, w: Worker, rate: float, unit: int) -> float:
    """The prompt tokens `w`'s host and disk blocks of `hit` save (`unit` tokens a block);
    an unmeasured tier saves none (module doc)."""
    load, credit = w.load, 0.0
    if hit.host and load.host_load_s_per_block > 0.0:
        credit += saved_tokens(hit.host * unit, hit.host * load.host_load_s_per_block, rate)
    if hit.disk and load.disk_load_s_per_block > 0.0:
        credit += saved_tokens(hit.disk * unit, hit.disk * load.disk_load_s_per_block, rate)
    return credit


def fallback_rate(workers: Sequence[Worker]) -> float:
    """The prefill seconds per token of a worker that has not measured its own: the median
    of `workers`' measured ones, else DEFAULT_PREFILL_S_PER_TOKEN (read only when needed:
    a median over the fleet)."""
    return fleet_rate([w.load.prefill_s_per_token for w in workers],
                      DEFAULT_PREFILL_S_PER_TOKEN)


def add_tier_credits(ctx: RoutingContext, candidates: Sequence[Worker],
                     units: dict[str, int]) -> None:
    """Fill `ctx.credit_tokens` from `ctx.tier_hits` (`units`: tokens per block for each
    candidate, as its match counts them)."""
    if not ctx.tier_hits:
        return
    fallback = None
    for w in candidates:
        hit = ctx.tier_hits.get(w.id)
        if hit is not None and (hit.host or hit.disk):
            rate = w.load.prefill_s_per_token
            if not rate:
                if fallback is None:
                    fallback = fallback_rate(candidates)
                rate = fallback
            credit = tier_credit(hit, w, rate, units.get(w.id, w.kv_block_size))
            if credit > 0.0:
                ctx.credit_tokens[w.id] = ctx.credit_tokens.get(w.id, 0.0) + credit
