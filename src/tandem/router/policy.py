"""Routing policies: pick one worker among the filtered candidates (interface + registry).

* `cache-aware` — weighted sum of scorers (`prefix` hit, `queue` depth, `kv_usage`,
  `inflight_tokens`, `cache_churn`: the uncached prompt tokens routed to a worker lately,
  against its KV capacity), each on an absolute [0, 1] scale. Saturation guard ("sticky
  until saturated"): a worker whose queue depth reaches
  `saturation_queue` or whose KV use reaches `saturation_kv` gets no prefix credit, so a hot
  prefix spills onto other replicas instead of piling up. With no hit anywhere (a cold
  request) only the load and churn scorers speak: cold traffic spreads by load, and among
  equally loaded workers goes to the one that has taken the least new text lately, so
  distinct prefix groups spread evenly. With the default weights a hit on a share `f` of the
  prompt outweighs a churn gap of `2f` of capacity (any hit over half the prompt beats a full
  gap, like vllm-router's 50% match threshold), and a full churn gap weighs as much as
  `saturation_queue` requests of queue depth. `lora_affinity` prefers replicas running the
  requested adapter, then those with a free adapter slot (constant for base-model requests).
  `session_affinity` (default SESSION_WEIGHT) adds its weight to the worker a request's
  session token names.
* `cost` — the lowest cost in seconds (`scorers.cost`: uncached prefill tokens x the
  worker's measured prefill rate + the queued prefill and decode work ahead of it + a LoRA
  miss), as Dynamo's KV router; the session token's worker counts at
  `cost / (1 + weights.session_affinity)`. Costs within COST_TIE_BAND (20 %) of the lowest
  count as equal: among them the session token's worker, else the one with the least
  cache churn (`cache_churn`), wins.
* `least-loaded` — lowest queue depth, then fewest in-flight tokens.
* `round-robin`, `random` — baselines.

Ties break at random (seeded by the caller's `random.Random`), so equal replicas share load.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.router.scorers import SCORERS, LoadLimits, RoutingContext
from tandem.router.scorers.base import share_free
from tandem.router.scorers.columns import Columns
from tandem.router.scorers.cost import costs
from tandem.router.workers import Worker

DEFAULT_WEIGHTS = {"prefix": 2.0, "queue": 1.0, "kv_usage": 0.5, "inflight_tokens": 0.5,
                   "cache_churn": 1.0, "lora_affinity": 1.0}
# the `session_affinity` weight when router.yaml sets none (both policies; not in
# DEFAULT_WEIGHTS: it adds nothing to a request without a session token)
SESSION_WEIGHT = 1.0
# the cost policy takes costs within this share of the lowest as equal (measured rates are
# noisy) and picks among them the worker with the least cache churn, as cache-aware spreads
# cold prefix groups
COST_TIE_BAND = 0.2
# candidates from which the cache-aware policy scores with numpy (`pick_vector`); fewer are
# scored list by list (numpy's fixed cost per call is more there)
VECTOR_FROM = 16


@dataclass
class Decision:
    worker: Worker
    reason: str  # prefix_hit | load | saturated | round_robin | random
    matched_tokens: int  # of the prompt, already cached on the winner
    scores: dict[str, float] = field(default_factory=dict)  # the winner's, for debugging
    # what `Router.route` recorded for it, so `Router.retract` can take it back: the tokens
    # charged to the winner's churn, and its speculative blocks (hashes, expiry), or in
    # approximate mode the routing's sequence number and the hashes it added
    charged_tokens: int = 0
    speculative: tuple[list[bytes], float] | None = None
    approximate: tuple[int, list[bytes]] | None = None


class Policy(ABC):
    name: str

    @abstractmethod
    def pick(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        """`candidates` is non-empty and already filtered."""

    def uses(self, scorer: str) -> bool:
        """Whether `pick` reads that scorer (so the router fills its context inputs)."""
        return False


POLICIES: dict[str, Callable[..., Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def _argmax(values: Sequence[float], rng: random.Random) -> int:
    best = max(values)
    return rng.choice([i for i, v in enumerate(values) if v >= best - 1e-12])


@register_policy
class CacheAwarePolicy(Policy):
    name = "cache-aware"

    def __init__(self, weights: Mapping[str, float] | None = None,
                 saturation_queue: int = 8, saturation_kv: float = 0.9,
                 rng: random.Random | None = None) -> None:
        """`weights`: the whole set, a scorer absent or at 0 is off (None: `DEFAULT_WEIGHTS`;
        router.yaml's `weights` reach here merged over the defaults, `config.merged_weights`);
        ValueError for an unknown scorer or a negative weight."""
        weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self.session_weight = _session_weight(weights.pop("session_affinity", SESSION_WEIGHT))
        unknown = set(weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorers {sorted(unknown)}; known: {sorted(SCORERS)}")
        negative = sorted(n for n, w in weights.items() if not w >= 0)
        if negative:
            raise ValueError(f"scorer weights must be >= 0: {negative}")
        self.limits = LoadLimits(saturation_queue, saturation_kv)
        self.scorers = [(SCORERS[n](self.limits), w) for n, w in weights.items() if w > 0]
        self.rng = rng or random.Random()

    def uses(self, scorer: str) -> bool:
        return any(s.name == scorer for s, _ in self.scorers)

    def saturated(self, w: Worker) -> bool:
        return (w.queue_depth >= self.limits.saturation_queue
                or w.load.kv_cache_usage >= self.limits.saturation_kv)

    def pick(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        if len(candidates) >= VECTOR_FROM:
            return self.pick_vector(ctx, candidates)
        return self.pick_scalar(ctx, candidates)

    def pick_vector(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        """`pick_scalar`'s decision (the same floats, the same tie-break draw), scored with
        each scorer's `vector` form over candidate columns (`scorers.columns`); a scorer
        without one is scored through `score`."""
        cols = Columns(ctx, candidates)
        per_scorer: dict[str, np.ndarray] = {}
        for s, _ in self.scorers:
            v = s.vector(ctx, cols)
            per_scorer[s.name] = np.array(s.score(ctx, candidates), np.float64) \
                if v is None else v
        if "prefix" in per_scorer:
            saturated = ((cols.queue_depth >= self.limits.saturation_queue)
                         | (cols.kv_usage >= self.limits.saturation_kv))
            per_scorer["prefix"] = np.where(saturated, 0.0, per_scorer["prefix"])
        totals = np.zeros(len(candidates))
        for s, wt in self.scorers:  # summed in scorer order, as `pick_scalar`
            totals = totals + wt * per_scorer[s.name]
        if ctx.session_worker is not None and self.session_weight > 0:
            home = [i for i, w in enumerate(candidates) if w.id == ctx.session_worker]
            totals[home] = totals[home] + self.session_weight
        best = max(totals.tolist())  # Python's max: NaN handled as `_argmax` does
        i = self.rng.choice(np.flatnonzero(totals >= best - 1e-12).tolist())
        prefix = per_scorer.get("prefix")
        return self._decision(ctx, candidates, i, prefix is not None and prefix[i] > 0,
                              {k: float(v[i]) for k, v in per_scorer.items()})

    def pick_scalar(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        per_scorer = {s.name: s.score(ctx, candidates) for s, _ in self.scorers}
        if "prefix" in per_scorer:
            per_scorer["prefix"] = [0.0 if self.saturated(w) else v
                                    for w, v in zip(candidates, per_scorer["prefix"],
                                                    strict=True)]
        totals: list[float] = [0] * len(candidates)  # type: ignore[list-item]
        for s, wt in self.scorers:  # summed in scorer order, as sum() over each candidate's
            totals = [t + wt * v for t, v in zip(totals, per_scorer[s.name], strict=True)]
        if ctx.session_worker is not None and self.session_weight > 0:
            totals = [t + self.session_weight if w.id == ctx.session_worker else t
                      for w, t in zip(candidates, totals, strict=True)]
        i = _argmax(totals, self.rng)
        prefix = per_scorer.get("prefix")
        return self._decision(ctx, candidates, i, prefix is not None and prefix[i] > 0,
                              {k: v[i] for k, v in per_scorer.items()})

    def _decision(self, ctx: RoutingContext, candidates: Sequence[Worker], i: int,
                  prefix_credit: bool, scores: dict[str, float]) -> Decision:
        """Candidate `i` won (`prefix_credit`: its prefix score is above 0): the reason."""
        winner = candidates[i]
        matched = ctx.matched_tokens.get(winner.id, 0)
        if matched and prefix_credit:
            reason = "prefix_hit"
        elif any(ctx.matched_tokens.get(w.id) for w in candidates):
            reason = "saturated" if any(self.saturated(w) for w in candidates
                                        if ctx.matched_tokens.get(w.id)) else "load"
        else:
            reason = "load"
        return Decision(winner, reason, matched, scores)


def _session_weight(value: float) -> float:
    if not value >= 0:
        raise ValueError(f"scorer weights must be >= 0: ['session_affinity'] ({value})")
    return float(value)


@register_policy
class CostPolicy(Policy):
    name = "cost"

    def __init__(self, weights: Mapping[str, float] | None = None,
                 saturation_queue: int = 8, saturation_kv: float = 0.9,
                 rng: random.Random | None = None) -> None:
        """Reads `weights["session_affinity"]` only (default SESSION_WEIGHT);
        `saturation_queue` scales the LoRA miss (`scorers.cost`)."""
        self.session_boost = _session_weight((weights or {}).get("session_affinity",
                                                                 SESSION_WEIGHT))
        self.limits = LoadLimits(saturation_queue, saturation_kv)
        self.rng = rng or random.Random()

    def pick(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        values = costs(ctx, candidates, self.limits)
        if ctx.session_worker is not None and self.session_boost > 0:
            values = [v / (1.0 + self.session_boost) if w.id == ctx.session_worker else v
                      for w, v in zip(candidates, values, strict=True)]
        bound = min(values) * (1.0 + COST_TIE_BAND) + 1e-12  # once, not per candidate
        near = [i for i, v in enumerate(values) if v <= bound]
        home = [i for i in near if candidates[i].id == ctx.session_worker]
        if home:  # the session's worker among the near-equal: it stays there
            near = home
        if len(near) > 1:  # near-equal costs: the one that took the least new text lately
            fresh = [share_free(ctx.churn_tokens.get(candidates[i].id, 0.0), candidates[i])
                     for i in near]
            i = near[_argmax(fresh, self.rng)]
        else:
            i = near[0]
        winner = candidates[i]
        matched = ctx.matched_tokens.get(winner.id, 0)
        return Decision(winner, "prefix_hit" if matched else "load", matched,
                        {"cost": values[i]})

    def uses(self, scorer: str) -> bool:
        return scorer == "cache_churn"  # the tie-break among near-equal costs


@register_policy
class LeastLoadedPolicy(Policy):
    name = "least-loaded"

    def __init__(self, rng: random.Random | None = None, **_: object) -> None:
        self.rng = rng or random.Random()

    def pick(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        keys = [-(w.queue_depth * 1e9 + w.load.in_flight_tokens) for w in candidates]
        w = candidates[_argmax(keys, self.rng)]
        return Decision(w, "load", ctx.matched_tokens.get(w.id, 0))


@register_policy
class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self, **_: object) -> None:
        self._counter = itertools.count()

    def pick(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        ordered = sorted(candidates, key=lambda w: w.id)
        w = ordered[next(self._counter) % len(ordered)]
        return Decision(w, "round_robin", ctx.matched_tokens.get(w.id, 0))


@register_policy
class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None, **_: object) -> None:
        self.rng = rng or random.Random()

    def pick(self, ctx: RoutingContext, candidates: Sequence[Worker]) -> Decision:
        w = self.rng.choice(list(candidates))
        return Decision(w, "random", ctx.matched_tokens.get(w.id, 0))


def make_policy(name: str, **kwargs: object) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
