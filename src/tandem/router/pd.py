"""Prefill/decode disaggregation: whether a request's prefill runs on a prefill worker.

The decode worker is picked first (`Router.route`, role "decode": decode or both workers, by
prefix hit and load). The prompt tokens it lacks are estimated from its match; when they
reach `RouterSettings.pd_threshold`, the decode worker can fetch KV pages (its /ready reports
a KV-transfer backend) and a routable prefill worker (role "prefill", gRPC port known) serves
the model, one is picked the same cache-aware way (its own prefix hits and
load; the prompt's blocks are then recorded as speculatively present on it) and the request
goes to the decode worker with `x-tandem-prefill: <its gRPC host:port>`: the decode worker
fetches the missing KV pages from there, then decodes. Otherwise it is served aggregated,
and `Route.reason` says why. A prefill worker whose KV cache dtype (/ready) is known to
differ from the decode worker's is passed over: its pages would be refused.

Conditional disaggregation (`RouterSettings.pd_max_prefill_queue`, as NVIDIA Dynamo's
prefill-queue bound): prefill workers that already hold that many requests (running +
waiting) are passed over; when all are, the decode worker prefills locally instead of
queueing behind them. A saturated prefill pool then costs the decode worker's inter-token
latency, not unbounded TTFT (and remote prefills that time out and are recomputed anyway).
Only up to a point: a prompt lacking more than `pd_max_local_prefill` tokens (as Dynamo's
max local prefill length) would stall every stream on the decode worker for its whole
prefill, so it still goes to the best prefill worker and queues there.

Cost-based decision (`RouterSettings.pd_decision` "cost"; default "threshold"): once a prefill
worker is picked, `pd_cost.estimate` weighs its backlog, rate and the transfer against
prefilling on the decode worker (and the stall that costs its running streams); the request
is aggregated when local wins, with reason `prefill_backlog` or `local_faster`. While the
prefill worker has not measured its prefill rate, the threshold rule above decides. The
prompt tokens sent to each prefill worker are recorded (`Router.pd_ledger`) until its next
load report counts them (only under the cost decision, their only reader), and the decode
steps each decode worker's local prefills stall (`Router.pd_stalls`, the stall budget's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tandem.protocol.block_hash import BlockHash
from tandem.protocol.web import PEER_BLOCKS_HEADER, PEER_HEADER, PREFILL_HEADER
from tandem.router import prompt as prompts
from tandem.router.core import Router
from tandem.router.pd_cost import Estimate, estimate
from tandem.router.peer import PeerPull
from tandem.router.policy import Decision
from tandem.router.scorers import RoutingContext
from tandem.router.workers import HashGroup, Worker

CHARS_PER_TOKEN = 4  # approximate mode (no tokenizer): uncached characters -> tokens


@dataclass
class Route:
    """Where one attempt goes."""

    decision: Decision  # the worker the request is sent to (decode, or aggregated)
    prefill: Decision | None = None  # set: disaggregated, the prefill runs there
    uncached_tokens: int = 0  # prompt tokens the decode worker is estimated to lack
    # why it is aggregated (prefill None): below_threshold, prompt_logprobs (echo with
    # logprobs: the decode worker computes the prompt anyway), decode_not_capable,
    # unsigned (the router has no worker auth key, and workers act on no unsigned
    # prefill target), no_prefill_worker, prefill_busy, or (the cost decision)
    # prefill_backlog or local_faster
    reason: str = ""
    # set: aggregated, and the worker pulls the prefix it lacks from this peer (`peer`)
    peer: PeerPull | None = None
    # the cost decision's estimates (`pd_cost`), when it decided
    estimate: Estimate | None = None

    @property
    def worker(self) -> Worker:
        return self.decision.worker

    def headers(self) -> dict[str, str]:
        """Extra request headers for the decode worker: its P/D prefill worker, else the KV
        peer it pulls from (never both)."""
        if self.prefill is not None:
            if self.prefill.worker.grpc_target is None:
                return {}
            return {PREFILL_HEADER: self.prefill.worker.grpc_target}
        if self.peer is not None and self.peer.holder.grpc_target is not None:
            return {PEER_HEADER: self.peer.holder.grpc_target,
                    PEER_BLOCKS_HEADER: str(self.peer.blocks)}
        return {}


def uncached_tokens(ctx: RoutingContext, decision: Decision, text_mode: bool) -> int:
    """Prompt tokens not cached on the decision's worker (estimated from text length in
    approximate mode, where lengths and matches are in characters)."""
    missing = max(ctx.prompt_tokens - decision.matched_tokens, 0)
    return missing // CHARS_PER_TOKEN if text_mode else missing


def plan(router: Router, parsed: prompts.ParsedPrompt, model: str, now: float,
         exclude: Iterable[str] = (), keep_prefill: Decision | None = None,
         hashes: Mapping[HashGroup, list[BlockHash]] | None = None,
         external: Mapping[HashGroup, Mapping[str, int]] | None = None, signed: bool = True,
         session: str | None = None) -> tuple[Route | None, RoutingContext]:
    """The decode worker (None if none passes the filters), and a prefill worker when the
    decode worker lacks at least `pd_threshold` prompt tokens. `keep_prefill` (an earlier
    attempt's prefill pick) is reused while it is still routable. Unless `signed` (the
    request will carry the router's signature) there is no prefill worker. `session`: the
    worker a session token named (decode side only)."""
    decision, ctx = router.route(parsed, model, now, exclude=exclude, role="decode",
                                 hashes=hashes, external=external, session=session)
    if decision is None:
        return None, ctx
    route = Route(decision, uncached_tokens=uncached_tokens(ctx, decision,
                                                            parsed.token_ids is None))
    # only a Tandem decode worker (its /ready names its KV-transfer backend) can fetch pages;
    # a stock server would ignore the header and prefill itself anyway
    if route.uncached_tokens < router.settings.pd_threshold:
        route.reason = "below_threshold"
    elif parsed.prompt_logits:
        route.reason = "prompt_logprobs"
    elif decision.worker.kv_transfer_backend is None:
        route.reason = "decode_not_capable"
    elif not signed and any(w.role == "prefill" for w in router.workers.values()):
        route.reason = "unsigned"
    elif keep_prefill is not None and _usable(router, keep_prefill.worker, now) \
            and kv_compatible(keep_prefill.worker, decision.worker):
        route.prefill = keep_prefill
    elif not any(w.role == "prefill" for w in router.workers.values()):
        route.reason = "no_prefill_worker"  # aggregated: no scans of the fleet below
    else:
        settings = router.settings
        bound = settings.pd_max_prefill_queue
        busy = [w.id for w in router.workers.values()
                if bound and w.role == "prefill" and w.queue_depth >= bound]
        # a prefill worker whose KV cache dtype differs would have its pages refused
        other_kv = [w.id for w in router.workers.values()
                    if not kv_compatible(w, decision.worker)]
        route.prefill = pick_prefill(router, parsed, model, now, ctx, external,
                                     [*busy, *other_kv])
        if route.prefill is None and busy and 0 < settings.pd_max_local_prefill \
                < route.uncached_tokens:  # too long to prefill locally: queue for one
            route.prefill = pick_prefill(router, parsed, model, now, ctx, external, other_kv)
        if route.prefill is None:
            route.reason = "prefill_busy" if busy else "no_prefill_worker"
        elif settings.pd_decision == "cost":
            decide(router, route, ctx, parsed.token_ids is None, now)
    return route, ctx


def decide(router: Router, route: Route, ctx: RoutingContext, text_mode: bool,
           now: float) -> None:
    """The cost decision on a route with a prefill pick: keeps it, or drops it (its
    speculative blocks retracted) with the reason, as `pd_cost.estimate` says; no
    estimate (an unmeasured prefill worker) keeps it, as the threshold rule does. A kept
    prefill's prompt tokens go into `Router.pd_ledger` (which only this decision reads)."""
    assert route.prefill is not None
    settings, prefill = router.settings, route.prefill
    uncached = uncached_tokens(ctx, prefill, text_mode)
    route.estimate = est = estimate(
        route.worker, prefill.worker, route.uncached_tokens, uncached,
        router.pd_ledger.unseen(prefill.worker, now), settings.pd_itl_weight,
        settings.pd_max_local_prefill, router.pd_stalls.share(route.worker, now),
        settings.pd_stall_budget)
    if est is not None and not est.disaggregate:
        router.retract(prefill, now)
        route.prefill, route.reason = None, est.reason
        router.pd_stalls.record(route.worker, est.stalled_steps, now)
    else:
        router.pd_ledger.record(prefill.worker, uncached, now)


def pick_prefill(router: Router, parsed: prompts.ParsedPrompt, model: str, now: float,
                 ctx: RoutingContext, external: Mapping[HashGroup, Mapping[str, int]] | None = None,
                 busy: Iterable[str] = ()) -> Decision | None:
    """The best routable prefill worker with a known gRPC address, not in `busy`, or None.
    Reuses the hash chains in `ctx`; records the prompt's blocks as speculative on the
    winner."""
    if not any(w.role == "prefill" for w in router.workers.values()):
        return None  # the common aggregated deployment: no second pass
    no_grpc = [w.id for w in router.workers.values() if w.grpc_target is None]
    decision, _ = router.route(parsed, model, now, exclude=[*no_grpc, *busy], role="prefill",
                               hashes=ctx.hashes, external=external)
    return decision


def kv_compatible(prefill: Worker, decode: Worker) -> bool:
    """Whether `decode` can take `prefill`'s KV pages: the same KV cache dtype, or one of
    them not known (an older worker: a mismatch is still refused by the decode worker, which
    then computes the prompt itself)."""
    a, b = prefill.kv_cache_dtype, decode.kv_cache_dtype
    return a is None or b is None or a == b


def _usable(router: Router, w: Worker, now: float) -> bool:
    return (router.workers.get(w.id) is w and w.grpc_target is not None
            and w.routable(now))
