"""The routing decision: candidates -> filters -> prefix matches -> policy -> one worker.

Pure state and logic on plain values (no sockets): the HTTP layer parses requests and
proxies, the monitor keeps `workers` and the index current. `route()` is synchronous and
cheap: one tokenization happens before it (in `prompt.parse`), then one hash chain per
block size in use and one index walk. Each decision also charges the winner's uncached
prompt tokens to its cache churn (`churn.ChurnTracker`, read by the `cache_churn` scorer).

Large fleets (more than `FULL_SCAN_UP_TO` workers) are not filtered and scored whole: the
candidates are the workers the index (or the shared store) finds holding the prompt's first
block, the `MAX_HITS` longest matches, plus a uniform random sample of `SAMPLE` workers of
the model and role, plus the `LEAST_LOADED` least loaded of them (fewest running + waiting
requests, then in-flight tokens) as of a snapshot taken at most `POOL_TTL_S` ago. Filters
and scorers then run on those (~70 workers) only, with the workers' current state. On a
uniformly loaded fleet the winner is the best of 40 by load (the best of d random
choices keeps the load gap at O(log log n / log d): d = 32 puts the pick in the least
loaded ~3 %), the least-loaded few catch idle workers (a new replica) at once, and no prefix
hit is ever sampled away. Smaller fleets are scored whole, as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tandem.protocol.block_hash import BlockHash
from tandem.protocol.tokenizer import Tokenizer
from tandem.router import peer
from tandem.router import prompt as prompts
from tandem.router.churn import ChurnTracker, ChurnView
from tandem.router.flowcontrol.base import ModelCapacity
from tandem.router.index import ApproximateIndex, PrefixIndex
from tandem.router.kvcredit import add_tier_credits
from tandem.router.pd_cost import PrefillLedger, StallLedger
from tandem.router.policy import Decision, make_policy
from tandem.router.saturation import SaturationBook
from tandem.router.scorers import FILTERS, RoutingContext
from tandem.router.scorers.filters import SERVES, HealthFilter, ModelFilter, RoleFilter
from tandem.router.workers import DEFAULT_BLOCK_SIZE, BreakerState, HashGroup, Worker

FULL_SCAN_UP_TO = 64  # workers; above this a decision scores a bounded candidate set
SAMPLE = 32  # random candidates of the model and role per decision
LEAST_LOADED = 8  # ... plus the least loaded at the last snapshot
MAX_HITS = 32  # ... plus at most this many prefix holders, longest match first
POOL_TTL_S = 1.0  # how long a (model, role, adapter) snapshot of the candidates is used
_CLOSED = BreakerState.CLOSED


@dataclass
class Pool:
    """The workers that passed the filters for one (model, role, adapter) at `built`."""

    built: float
    members: list[Worker]
    least_loaded: list[Worker]
    groups: set[HashGroup]
    guessed: list[Worker]  # members with no KV event stream (the approximate index)


@dataclass
class RouterSettings:
    policy: str = "cache-aware"
    weights: Mapping[str, float] | None = None  # cache-aware scorer weights
    saturation_queue: int = 8  # a prefix hit stops counting at this queue depth
    saturation_kv: float = 0.9  # ... or at this KV-cache use
    speculative_ttl_s: float = 2.0  # routed blocks count as present this long
    churn_half_life_s: float = 30.0  # half-life of a worker's routed uncached tokens
    approx_capacity: int = 100_000  # blocks remembered per worker in approximate mode
    filters: tuple[str, ...] = ("model", "role", "health")
    pd_threshold: int = 16  # uncached prompt tokens from which prefill goes to a prefill worker
    # conditional disaggregation: serve aggregated when the best prefill worker already has
    # this many requests (running + waiting); 0 = no bound
    pd_max_prefill_queue: int = 0
    # ... except for prompts lacking more than this many tokens: a long local prefill would
    # stall every stream on the decode worker, so they queue on a prefill worker; 0 = no cap
    pd_max_local_prefill: int = 1024
    # how the P/D decision is made (`pd`): "threshold" or "cost" (`pd_cost`: measured rates
    # and backlogs; the threshold rule while a prefill worker is unmeasured); and the weight
    # of a local prefill's stall of the decode worker's running streams in "cost"
    pd_decision: str = "cost"
    pd_itl_weight: float = 1.0
    # ... and the share of a decode worker's steps its local prefills may stall while it has
    # running streams (`pd_cost` stall budget; 0: no budget)
    pd_stall_budget: float = 0.005
    seed: int | None = None
    # flow control (`flowcontrol`): a worker is saturated at >= this many waiting requests
    # or this KV-cache use; `served_models` (model -> start timeout, s) may have no worker
    flow_saturation_waiting: int = 4
    flow_saturation_kv: float = 0.9
    served_models: Mapping[str, float] = field(default_factory=dict)
    # peer pulls (`peer`): name a KV peer holding more of the prompt than the chosen worker
    # (the router must sign requests: main sets this only with a worker auth key)
    peer_pull: bool = False


class Router:
    def __init__(self, settings: RouterSettings,
                 tokenizer_for: Callable[[str], Tokenizer | None]) -> None:
        self.settings = settings
        self.tokenizer_for = tokenizer_for
        self.workers: dict[str, Worker] = {}
        self.index = PrefixIndex(settings.speculative_ttl_s)
        self.approx = ApproximateIndex(settings.approx_capacity)
        self.churn = ChurnTracker(settings.churn_half_life_s)
        self.pd_ledger = PrefillLedger()  # prompt tokens sent to prefill workers (`pd_cost`)
        self.pd_stalls = StallLedger()  # decode steps stalled by local prefills (`pd_cost`)
        rng = self._rng = random.Random(settings.seed)
        self._pools: dict[tuple[str, str, str | None], Pool] = {}
        kwargs: dict = {"rng": rng}
        if settings.policy in ("cache-aware", "cost"):
            kwargs.update(weights=settings.weights, saturation_queue=settings.saturation_queue,
                          saturation_kv=settings.saturation_kv)
        self.policy = make_policy(settings.policy, **kwargs)
        self._churn_scored = self.policy.uses("cache_churn")  # else no per-request churn reads
        self.filters = [FILTERS[name]() for name in settings.filters]
        # the built-in model, role and health filters, in that order: `_keep` checks them
        # inline (the same checks in the same order, without three calls per candidate)
        self._builtin_filters = [type(f) for f in self.filters] == [
            ModelFilter, RoleFilter, HealthFilter]
        self.book = SaturationBook(self.is_saturated)  # flow control's capacity, kept current

    # -- membership ------------------------------------------------------------------------
    def add_worker(self, worker: Worker) -> None:
        self.workers[worker.id] = worker
        self._pools.clear()
        worker.watcher = self.book.refresh
        self.book.refresh(worker)

    def remove_worker(self, worker_id: str) -> None:
        gone = self.workers.pop(worker_id, None)
        self._pools.clear()
        self.book.drop(worker_id)
        if gone is not None and gone.watcher == self.book.refresh:
            gone.watcher = None
        self.index.drop(worker_id)
        self.approx.drop(worker_id)
        self.churn.drop(worker_id)
        self.pd_ledger.forget(worker_id)
        self.pd_stalls.forget(worker_id)

    def models(self) -> list[str]:
        """Models and LoRA adapters served by ready workers (for the others
        `startup.StartupState` answers 503 or 404)."""
        ready = [w for w in self.workers.values() if w.model and w.ready]
        return sorted({w.model for w in ready} | {a for w in ready for a in w.aliases}
                      | {a for w in ready for a in w.lora_adapters})

    def base_model(self, model: str) -> tuple[str, str | None]:
        """(base model, adapter) a request's `model` means: a base model some worker
        serves is itself; else the base of a worker holding it as an adapter."""
        if any(w.model == model for w in self.workers.values()):
            return model, None
        primary = next((w.model for w in self.workers.values() if model in w.aliases), None)
        if primary is not None:  # another served name: hashed under the primary one
            return primary, None
        base = next((w.model for w in self.workers.values() if model in w.lora_adapters),
                    None)
        return (model, None) if base is None else (base, model)

    def max_model_len(self, model: str) -> int | None:
        """The smallest context length the ready workers of `model` report (None: none
        reported one): a prompt that fits it fits wherever it is routed."""
        lengths = [w.max_model_len for w in self.workers.values()
                   if w.serves(model) and w.ready and w.max_model_len]
        return min(lengths) if lengths else None

    def capacity(self, model: str, now: float) -> ModelCapacity:
        """Whether `model`'s decode-side workers can take one more request (flow control's
        `Capacity`): AVAILABLE when a routable one is below `flow_saturation_waiting`
        waiting requests (its report, or this router's own open requests beyond the
        running ones it reported, as the report lags) and `flow_saturation_kv` KV use;
        SATURATED when all are at or past it; STARTING when none is routable yet but one
        is known (starting, draining, failing probes) or the model is a `served_models`
        one; else NONE. O(1): read from `book`, kept current as workers change."""
        return self.book.capacity(model, now, model in self.settings.served_models)

    def is_saturated(self, w: Worker) -> bool:
        """`w` is at or past flow control's thresholds (`capacity`)."""
        load, s = w.load, self.settings
        waiting = max(load.num_waiting, w.local_in_flight - load.num_running)
        return waiting >= s.flow_saturation_waiting or load.kv_cache_usage >= s.flow_saturation_kv

    def saturated(self, model: str) -> set[str]:
        """`model`'s decode-side workers at or past flow control's thresholds: with flow
        control on, a request goes to one of the others while there is one. The set `book`
        maintains (read it, do not change it)."""
        return self.book.saturated(model)

    # -- routing ---------------------------------------------------------------------------
    @staticmethod
    def hash_groups(candidates: Iterable[Worker], lora: str | None
                    ) -> dict[HashGroup, list[Worker]]:
        """Candidates by how they hash a prompt for adapter `lora`: block size and the
        adapter's weight digest there (workers may hold other weights under one name)."""
        groups: dict[HashGroup, list[Worker]] = {}
        if lora is None:  # `Worker.hash_group(None)`, without two calls per candidate
            candidates = candidates if isinstance(candidates, list) else list(candidates)
            sizes = {w.block_size for w in candidates}
            if len(sizes) == 1:  # the usual fleet: one block size, one group
                return {(sizes.pop() or DEFAULT_BLOCK_SIZE, ""): list(candidates)}
            for w in candidates:
                groups.setdefault((w.block_size or DEFAULT_BLOCK_SIZE, ""), []).append(w)
            return groups
        for w in candidates:
            groups.setdefault(w.hash_group(lora), []).append(w)
        return groups

    def hashes(self, parsed: prompts.ParsedPrompt, model: str
               ) -> dict[HashGroup, list[BlockHash]]:
        """The prompt's hash chain for each hash group among this model's workers."""
        base, lora = self.base_model(model)
        groups = {w.hash_group(lora) for w in self.workers.values()
                  if w.serves(model) or not w.model}
        return {g: prompts.block_hashes(parsed, base, *g) for g in sorted(groups)}

    def context(self, parsed: prompts.ParsedPrompt, model: str, now: float,
                candidates: Iterable[Worker],
                hashes: Mapping[HashGroup, list[BlockHash]] | None = None,
                external: Mapping[HashGroup, Mapping[str, int]] | None = None,
                found: Mapping[HashGroup, Mapping[str, int]] | None = None
                ) -> RoutingContext:
        """Hash the prompt once per hash group (block size, adapter digest) in use (unless
        `hashes` has them) and look up every candidate; `external` adds per-group matches
        from a shared index store, `found` the in-memory index's over every worker (so it
        is not walked again). Also
        fills each candidate's cache churn as of `now` when the policy scores it."""
        candidates = list(candidates)
        base, lora = self.base_model(model)
        ctx = RoutingContext(model=model, prompt_tokens=len(parsed.token_ids or parsed.text),
                             now=now, lora=lora)
        if self._churn_scored:
            ctx.churn_tokens = ChurnView(self.churn, now, {w.id for w in candidates})
        units: dict[str, int] = {}
        for key, group in self.hash_groups(candidates, lora).items():
            size = key[0]
            chain = hashes.get(key) if hashes else None
            if chain is None:
                chain = prompts.block_hashes(parsed, base, *key)
            ctx.hashes[key] = chain
            precise = [w.id for w in group if w.events_connected]
            guessed = [w.id for w in group if not w.events_connected]
            unit = size if parsed.token_ids is not None else prompts.TEXT_CHUNK_CHARS
            if found is not None and key in found:
                hits = found[key]
                matched = {wid: hits[wid] for wid in precise if wid in hits}
            else:
                matched = self.index.match(chain, now, precise)
            if external and key in external:  # the shared store knows every worker
                keep = {w.id for w in group}
                for wid, n in external[key].items():
                    if wid in keep and n > matched.get(wid, 0):
                        matched[wid] = n
            for wid, n in matched.items():
                ctx.matched_tokens[wid] = n * unit
            if precise and self.index.has_tiers():  # host / disk tier blocks: credits
                for wid, hit in self.index.match_media(chain, now, precise).items():
                    if hit.host or hit.disk:
                        ctx.tier_hits[wid] = hit
                        units[wid] = unit
            for wid, n in self.approx.match(chain, guessed).items():
                ctx.matched_tokens[wid] = max(n * unit, ctx.matched_tokens.get(wid, 0))
        if ctx.tier_hits:
            add_tier_credits(ctx, candidates, units)
        return ctx

    def route(self, parsed: prompts.ParsedPrompt, model: str, now: float,
              exclude: Iterable[str] = (), role: str = "decode",
              hashes: Mapping[HashGroup, list[BlockHash]] | None = None,
              external: Mapping[HashGroup, Mapping[str, int]] | None = None,
              session: str | None = None) -> tuple[Decision | None, RoutingContext]:
        """Pick a worker (None if no candidate passes the filters), record the routed
        blocks as speculatively present on it and charge its uncached prompt tokens
        (`prompt_tokens - matched_tokens`) to its cache churn. `session`: the worker id a
        session token named (`scorers.session`), favoured while it is a candidate."""
        skip = set(exclude)
        probe = RoutingContext(model=model, prompt_tokens=0, role=role, now=now,
                               lora=self.base_model(model)[1])
        sampled = None
        if len(self.workers) > FULL_SCAN_UP_TO:
            sampled = self._sample(parsed, model, probe, skip, hashes, external, session)
        if sampled is not None:
            candidates, hashes, found = sampled
        else:
            candidates = self._candidates(probe, skip)
            found = None
        ctx = self.context(parsed, model, now, candidates, hashes, external, found)
        ctx.role = role
        ctx.session_worker = session
        if not candidates:
            return None, ctx
        decision = self.policy.pick(ctx, candidates)
        w = decision.worker
        if self.settings.peer_pull and role == "decode" and parsed.token_ids is not None:
            peer.annotate(self.index, self.workers, ctx, w, candidates, now)
        hashes = ctx.chain(w)
        if w.events_connected:
            decision.speculative = (hashes, self.index.add_speculative(w.id, hashes, now))
        else:
            decision.approximate = self.approx.routed(w.id, hashes)
        decision.charged_tokens = max(ctx.prompt_tokens - decision.matched_tokens, 0)
        self.churn.add(w.id, decision.charged_tokens, now)
        return decision, ctx

    def _candidates(self, probe: RoutingContext, skip: set[str]) -> list[Worker]:
        """The workers passing every filter, not in `skip`, in fleet order. With the built-in
        filters, their checks in one pass (`Worker.serves`, the role, `ready`, the breaker
        as `CircuitBreaker.allows`, a closed one without a call): ~0.6 us a worker less."""
        if not self._builtin_filters:
            keep = self._keep
            return [w for w in self.workers.values() if w.id not in skip and keep(probe, w)]
        model, now = probe.model, probe.now
        if not model:  # `Worker.serves("")` is False
            return []
        roles = SERVES.get(probe.role, (probe.role,))
        return [w for w in self.workers.values()
                if w.ready and w.role in roles
                and (model == w.model or model in w.aliases or model in w.lora_digests)
                and (w.breaker.state is _CLOSED or w.breaker.allows(now))
                and w.id not in skip]

    def _keep(self, probe: RoutingContext, w: Worker) -> bool:
        """`w` passes every filter (as `all(...)`, without a generator per worker)."""
        if self._builtin_filters:
            return (w.serves(probe.model) and w.role in SERVES.get(probe.role, (probe.role,))
                    and w.ready and w.breaker.allows(probe.now))
        for f in self.filters:  # noqa: SIM110 - the generator costs ~0.3 us per worker
            if not f.keep(probe, w):
                return False
        return True

    def _pool(self, probe: RoutingContext) -> Pool:
        key = (probe.model, probe.role, probe.lora)
        pool = self._pools.get(key)
        if pool is None or not 0 <= probe.now - pool.built < POOL_TTL_S:
            members = [w for w in self.workers.values()
                       if all(f.keep(probe, w) for f in self.filters)]
            least = sorted(members, key=lambda w: (w.queue_depth, w.load.in_flight_tokens))
            pool = self._pools[key] = Pool(probe.now, members, least[:LEAST_LOADED],
                                           {w.hash_group(probe.lora) for w in members},
                                           [w for w in members if not w.events_connected])
        return pool

    def _sample(self, parsed: prompts.ParsedPrompt, model: str, probe: RoutingContext,
                skip: set[str], hashes: Mapping[HashGroup, list[BlockHash]] | None,
                external: Mapping[HashGroup, Mapping[str, int]] | None,
                session: str | None = None) -> tuple[list[Worker], dict, dict] | None:
        """A large fleet's candidates (module doc; the worker a session token names is
        always drawn), filtered now, with the chains hashed and the index's matches over
        every worker; None when none passes (the caller then filters the whole fleet, so "no
        candidate" is never a sampling accident)."""
        pool, lora, now = self._pool(probe), probe.lora, probe.now
        base = self.base_model(model)[0]
        chains = dict(hashes or {})
        found: dict[HashGroup, dict[str, int]] = {}
        hits: list[tuple[int, float, Worker]] = []
        rand = self._rng.random
        for key in sorted(pool.groups):
            chain = chains.get(key)
            if chain is None:
                chain = chains[key] = prompts.block_hashes(parsed, base, *key)
            matched = found[key] = self.index.match(chain, now)
            if external and key in external:
                for wid, n in external[key].items():
                    if n > matched.get(wid, 0):
                        matched[wid] = n
            for wid, n in matched.items():
                w = self.workers.get(wid)
                if w is not None and w.hash_group(lora) == key:
                    hits.append((n, rand(), w))
            if self.index.has_tiers():  # holders in host / disk tiers are candidates too
                for wid, hit in self.index.match_media(chain, now).items():
                    w = self.workers.get(wid)
                    if (hit.host or hit.disk) and w is not None and w.hash_group(lora) == key:
                        hits.append((hit.total, rand(), w))
        for w in pool.guessed:  # no KV events: the approximate index, by worker
            chain = chains.get(w.hash_group(lora))
            n = self.approx.match(chain, [w.id]).get(w.id, 0) if chain else 0
            if n:
                hits.append((n, rand(), w))
        hits.sort(key=lambda h: (-h[0], h[1]))
        members = pool.members
        drawn = self._rng.sample(members, min(SAMPLE, len(members)))
        chosen = {w.id: w for _, _, w in hits[:MAX_HITS]}
        named = self.workers.get(session) if session is not None else None
        for w in (*pool.least_loaded, *drawn, *((named,) if named is not None else ())):
            chosen.setdefault(w.id, w)
        workers, keep = self.workers, self._keep
        candidates = [w for w in chosen.values() if w.id not in skip
                      and workers.get(w.id) is w and keep(probe, w)]
        return (candidates, chains, found) if candidates else None

    def retract(self, decision: Decision, now: float) -> None:
        """The attempt `decision` routed failed before any byte (no connection, no answer in
        time, 429 / 503) and is retried elsewhere: take back its churn charge and its
        speculative blocks, so the retry's pick and later prompts with the same prefix do
        not count on them. (If a timed-out worker did compute the prompt, its KV events
        report the blocks as usual.)"""
        wid = decision.worker.id
        self.churn.refund(wid, decision.charged_tokens, now)
        if decision.speculative is not None:
            self.index.retract_speculative(wid, *decision.speculative)
        if decision.approximate is not None:
            self.approx.retract(wid, *decision.approximate)
        decision.charged_tokens, decision.speculative, decision.approximate = 0, None, None
