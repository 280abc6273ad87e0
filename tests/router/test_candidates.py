"""A small fleet's candidate scan (`Router._candidates`, the built-in filters' checks in one
pass) keeps exactly the workers the filters themselves keep, in order, over thousands of
seeded random fleets, requests and breaker states."""

from __future__ import annotations

import random

from tandem.router.core import Router, RouterSettings
from tandem.router.scorers import RoutingContext
from tandem.router.workers import BreakerState, CircuitBreaker, Worker

NAMES = ["", "m", "n", "alias", "ad1", "ad2", "other"]
ROLES = ["both", "decode", "prefill", "encode"]


def random_worker(rng: random.Random, i: int) -> Worker:
    state = rng.choice(list(BreakerState))
    breaker = CircuitBreaker(state=state, reopen_at=rng.uniform(0, 20),
                             trial_in_flight=rng.random() < 0.5)
    return Worker(id=f"http://w{i}:8000", model=rng.choice(["", "m", "n"]),
                  role=rng.choice(ROLES[:3]), ready=rng.random() < 0.8,
                  aliases=frozenset(rng.sample(["alias", "other"], rng.randint(0, 2))),
                  lora_digests={a: "d" for a in rng.sample(["ad1", "ad2"], rng.randint(0, 2))},
                  breaker=breaker)


def test_the_one_pass_scan_keeps_what_the_filters_keep():
    rng = random.Random(41)
    router = Router(RouterSettings(seed=0), lambda m: None)
    assert router._builtin_filters
    kept_any = 0
    for trace in range(3000):
        if trace % 30 == 0:  # a new fleet of 0 to 64 workers
            for wid in list(router.workers):
                router.remove_worker(wid)
            for i in range(rng.randint(0, 64)):
                router.add_worker(random_worker(rng, i))
        ids = list(router.workers)
        probe = RoutingContext(model=rng.choice(NAMES), prompt_tokens=0,
                               role=rng.choice(ROLES), now=rng.uniform(0, 20))
        skip = set(rng.sample(ids, rng.randint(0, len(ids)))) if ids and rng.random() < 0.3 \
            else set()
        want = [w for w in router.workers.values() if w.id not in skip
                and all(f.keep(probe, w) for f in router.filters)]
        assert router._candidates(probe, skip) == want, trace
        kept_any += bool(want)
    assert 300 < kept_any < 2900  # both outcomes are exercised


def test_custom_filters_still_run_through_their_keep():
    router = Router(RouterSettings(seed=0, filters=("health", "model")), lambda m: None)
    assert not router._builtin_filters
    router.add_worker(Worker(id="http://a:1", model="m", ready=True, role="prefill"))
    router.add_worker(Worker(id="http://b:1", model="m", ready=False))
    probe = RoutingContext(model="m", prompt_tokens=0, role="decode", now=0.0)
    # no role filter configured: the prefill worker is a candidate
    assert [w.id for w in router._candidates(probe, set())] == ["http://a:1"]
