"""The cache-aware policy's numpy scoring (`pick_vector`) against its list-by-list form
(`pick_scalar`): the same winner, reason, matched tokens and scores, and the same tie-break
draw, over thousands of seeded random candidate sets built to tie often."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tandem.router import policy as policy_module
from tandem.router.policy import CacheAwarePolicy
from tandem.router.scorers import SCORERS, RoutingContext, Scorer
from tandem.router.scorers.columns import Columns
from tandem.router.workers import Worker, WorkerLoad

LORAS = ("ad1", "ad2")


class Plain(Scorer):
    """A plugin scorer with no vectorized form (ints, to check the fallback's types)."""

    name = "plain"

    def score(self, ctx, workers):
        return [len(w.id) % 2 for w in workers]


def random_worker(rng: random.Random, i: int) -> Worker:
    pick = rng.choice
    loras = frozenset(rng.sample(LORAS, rng.randint(0, 2)))
    w = Worker(id=f"w{i}", model="m", block_size=pick((None, 16, 32)), ready=True,
               load=WorkerLoad(num_running=pick((0, 0, 1, 2, 7, 8, 20)),
                               num_waiting=pick((0, 0, 0, 1, 3)),
                               num_total_blocks=pick((0, 0, 100, 1000)),
                               kv_cache_usage=pick((0.0, 0.25, 0.5, 0.9, 0.95, 1.0, 1.5,
                                                    rng.random(), math.nan)),
                               in_flight_tokens=pick((0, 0, 160, 1600, 5000, -3)),
                               running_loras=loras, resident_loras=loras,
                               max_loras=pick((0, 1, 2))))
    w.local_in_flight = pick((0, 0, 0, 3, 9))
    return w


def random_case(rng: random.Random) -> tuple[CacheAwarePolicy, RoutingContext, list[Worker]]:
    names = [n for n in sorted(SCORERS) if n != "cost"]
    chosen = rng.sample(names, rng.randint(1, len(names)))
    weights = {n: rng.choice((0, 1, 2, 0.5, 1.25, rng.random())) for n in chosen}
    if rng.random() < 0.3:
        weights["session_affinity"] = rng.choice((0, 1, 3.5))
    pol = CacheAwarePolicy(weights=weights, saturation_queue=rng.choice((1, 4, 8)),
                           saturation_kv=rng.choice((0.5, 0.9)))
    if rng.random() < 0.2:
        pol.scorers.append((Plain(pol.limits), rng.choice((1, 0.5))))
    n = rng.choice((1, 2, 5, 16, 40, 70))
    workers = [random_worker(rng, i) for i in range(n)]
    tokens = rng.choice((0, 16, 100, 512, 4096))
    ids = [w.id for w in workers]
    ctx = RoutingContext(
        model="m", prompt_tokens=tokens, lora=rng.choice((None, None, *LORAS)),
        matched_tokens={w: rng.choice((0, 16, 64, tokens, tokens + 16))
                        for w in rng.sample(ids, rng.randint(0, n))},
        churn_tokens={w: rng.choice((0.0, 100.0, 1600.0, 1e9, -5.0, rng.random() * 3000))
                      for w in rng.sample(ids, rng.randint(0, n))},
        session_worker=rng.choice((None, rng.choice(ids), "gone")))
    return pol, ctx, workers


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_vectorized_picks_exactly_what_the_scalar_path_picks():
    rng = random.Random(20261205)
    reasons = set()
    for case in range(3000):
        pol, ctx, workers = random_case(rng)
        seed = rng.random()
        pol.rng = random.Random(seed)
        try:
            want = pol.pick_scalar(ctx, workers)
        except IndexError:  # a NaN total first: no candidate compares >= it, in both paths
            pol.rng = random.Random(seed)
            with pytest.raises(IndexError):
                pol.pick_vector(ctx, workers)
            continue
        state = pol.rng.getstate()
        pol.rng = random.Random(seed)
        got = pol.pick_vector(ctx, workers)
        assert pol.rng.getstate() == state, case  # the same tie-break draw
        assert (got.worker.id, got.reason, got.matched_tokens) == \
            (want.worker.id, want.reason, want.matched_tokens), case
        assert got.scores.keys() == want.scores.keys(), case
        assert all(same(got.scores[k], want.scores[k]) for k in want.scores), case
        reasons.add(got.reason)
    assert reasons == {"prefix_hit", "load", "saturated"}


def test_each_vectorized_scorer_equals_its_scores():
    rng = random.Random(7)
    for _ in range(500):
        pol, ctx, workers = random_case(rng)
        cols = Columns(ctx, workers)
        for name, make in SCORERS.items():
            scorer = make(pol.limits)
            v = scorer.vector(ctx, cols)
            if v is None:
                continue
            want = scorer.score(ctx, workers)
            assert v.dtype == np.float64 and len(v) == len(want)
            assert all(same(a, b) for a, b in zip(v.tolist(), want, strict=True)), name


def test_large_candidate_sets_take_the_vectorized_path(monkeypatch):
    calls = []
    monkeypatch.setattr(CacheAwarePolicy, "pick_vector",
                        lambda self, ctx, c: calls.append(len(c)))
    pol = CacheAwarePolicy()
    ctx = RoutingContext(model="m", prompt_tokens=10)
    rng = random.Random(1)
    pol.pick(ctx, [random_worker(rng, i) for i in range(policy_module.VECTOR_FROM)])
    pol.pick(ctx, [random_worker(rng, i) for i in range(policy_module.VECTOR_FROM - 1)])
    assert calls == [policy_module.VECTOR_FROM]


def test_reported_kv_use_is_bounded_so_no_report_breaks_a_pick():
    """A worker's KV use as the monitor stores it (`bounded_kv_usage`): whatever a worker
    reports (NaN included), both paths pick a worker."""
    from tandem.router.workers import bounded_kv_usage

    assert [bounded_kv_usage(v) for v in (math.nan, -0.5, 0.3, 1.5, math.inf, -math.inf)] == \
        [1.0, 0.0, 0.3, 1.0, 1.0, 0.0]
    rng = random.Random(7)
    for case in range(1000):
        pol, ctx, workers = random_case(rng)
        for w in workers:
            w.load = WorkerLoad(**{**vars(w.load),
                                   "kv_cache_usage": bounded_kv_usage(w.load.kv_cache_usage)})
        seed = rng.random()
        pol.rng = random.Random(seed)
        want = pol.pick_scalar(ctx, workers)
        pol.rng = random.Random(seed)
        got = pol.pick_vector(ctx, workers)
        assert got.worker.id == want.worker.id, case
