"""The routing decision's fast paths against their plain forms: the built-in filters checked
inline vs. through their `keep` methods, and the lazy churn view vs. the tracker's values,
over seeded random worker states."""

from __future__ import annotations

import random

from tandem.router.churn import ChurnTracker, ChurnView
from tandem.router.core import Router, RouterSettings
from tandem.router.scorers import RoutingContext
from tandem.router.workers import BreakerState, CircuitBreaker, Worker, WorkerLoad


def test_inline_builtin_filters_keep_exactly_what_the_filters_keep():
    rng = random.Random(5)
    router = Router(RouterSettings(), lambda model: None)
    assert router._builtin_filters
    kept = set()
    for _ in range(4000):
        w = Worker(id="w", model=rng.choice(("m", "other", "")),
                   aliases=frozenset(rng.sample(("m", "alias"), rng.randint(0, 1))),
                   role=rng.choice(("both", "prefill", "decode", "x")),
                   ready=rng.random() < 0.8, load=WorkerLoad(),
                   breaker=CircuitBreaker(state=rng.choice(list(BreakerState)),
                                          reopen_at=rng.choice((0.0, 5.0, 20.0)),
                                          trial_in_flight=rng.random() < 0.5),
                   lora_digests=rng.choice(({}, {"ad": "d1"})))
        probe = RoutingContext(model=rng.choice(("m", "alias", "ad", "nope", "")),
                               prompt_tokens=0, role=rng.choice(("decode", "prefill", "both",
                                                                 "x")),
                               now=rng.choice((0.0, 10.0)))
        want = all(f.keep(probe, w) for f in router.filters)
        assert router._keep(probe, w) is want
        kept.add(want)
    assert kept == {True, False}


def test_a_custom_filter_list_goes_through_the_filters():
    router = Router(RouterSettings(filters=("role", "model", "health")), lambda model: None)
    assert not router._builtin_filters


def test_the_churn_view_reads_the_trackers_values_for_its_workers_only():
    rng = random.Random(9)
    tracker = ChurnTracker(half_life_s=3.0)
    ids = [f"w{i}" for i in range(20)]
    for _ in range(200):
        tracker.add(rng.choice(ids), rng.random() * 1000, rng.random() * 10)
    now = 12.5
    some = set(rng.sample(ids, 8)) | {"unknown"}
    view = ChurnView(tracker, now, some)
    assert view == {w: tracker.value(w, now) for w in some}
    assert view.get(next(w for w in ids if w not in some), -1.0) == -1.0
    assert len(view) == len(some) and set(view) == some


def test_hash_groups_for_a_base_model_request_are_the_workers_own_groups():
    rng = random.Random(3)
    for _ in range(300):
        ws = [Worker(id=f"w{i}", model="m", block_size=rng.choice((None, 16, 32)),
                     lora_digests=rng.choice(({}, {"ad": "d1"})))
              for i in range(rng.randint(0, 12))]
        want: dict = {}
        for w in ws:
            want.setdefault(w.hash_group(None), []).append(w)
        assert Router.hash_groups(ws, None) == want
        assert Router.hash_groups(ws, "ad") == {
            g: [w for w in ws if w.hash_group("ad") == g] for g in
            dict.fromkeys(w.hash_group("ad") for w in ws)}
