"""Scorers, filters and policies, table-driven over plain Worker values."""

from __future__ import annotations

import random

import pytest

from tandem.router.policy import POLICIES, CacheAwarePolicy, make_policy
from tandem.router.scorers import FILTERS, SCORERS, RoutingContext
from tandem.router.workers import BreakerState, CircuitBreaker, Worker, WorkerLoad


def worker(wid: str, running: int = 0, waiting: int = 0, kv: float = 0.0, tokens: int = 0,
           role: str = "both", model: str = "m", ready: bool = True, blocks: int = 0) -> Worker:
    return Worker(id=wid, model=model, role=role, ready=ready, block_size=16,
                  load=WorkerLoad(num_running=running, num_waiting=waiting,
                                  kv_cache_usage=kv, in_flight_tokens=tokens,
                                  num_total_blocks=blocks))


def ctx(matched: dict[str, int] | None = None, prompt_tokens: int = 100,
        churn: dict[str, float] | None = None) -> RoutingContext:
    return RoutingContext(model="m", prompt_tokens=prompt_tokens, matched_tokens=matched or {},
                          churn_tokens=churn or {})


@pytest.mark.parametrize(("name", "workers", "matched", "want"), [
    ("prefix", [worker("a"), worker("b")], {"a": 64}, [0.64, 0.0]),
    ("prefix", [worker("a")], {"a": 500}, [1.0]),  # clamped
    # depth / 8 (the default saturation depth), clamped
    ("queue", [worker("a", 2, 2), worker("b", 0, 0), worker("c", 12, 0)], {}, [0.5, 1.0, 0.0]),
    ("kv_usage", [worker("a", kv=0.25), worker("b", kv=1.0)], {}, [0.75, 0.0]),
    # share of KV capacity (blocks x block size); unknown capacity scores 1
    ("inflight_tokens", [worker("a", tokens=160, blocks=100), worker("b", tokens=2400,
                                                                      blocks=100),
                         worker("c", tokens=500)], {}, [0.9, 0.0, 1.0]),
])
def test_scorers(name, workers, matched, want):
    assert SCORERS[name]().score(ctx(matched), workers) == pytest.approx(want)


# capacity = blocks x 16 tokens: 100 blocks = 1600 tokens
@pytest.mark.parametrize(("workers", "churn", "want"), [
    ([worker("a", blocks=100), worker("b", blocks=100)], {"a": 400, "b": 1600}, [0.75, 0.0]),
    ([worker("a", blocks=100)], {"a": 5000}, [0.0]),  # clamped
    ([worker("a", blocks=100)], {}, [1.0]),  # no churn recorded
    ([worker("a")], {"a": 900}, [1.0]),  # unknown capacity
])
def test_cache_churn_scorer(workers, churn, want):
    assert SCORERS["cache_churn"]().score(ctx(churn=churn), workers) == pytest.approx(want)


def test_local_in_flight_counts_before_the_poll_catches_up():
    w = worker("a", running=1)
    w.local_in_flight = 4
    assert w.queue_depth == 4


@pytest.mark.parametrize(("name", "w", "role", "keep"), [
    ("model", worker("a", model="x"), "decode", False),
    ("model", worker("a"), "decode", True),
    ("role", worker("a", role="prefill"), "decode", False),
    ("role", worker("a", role="decode"), "decode", True),
    ("role", worker("a", role="both"), "decode", True),
    ("role", worker("a", role="prefill"), "prefill", True),
    ("health", worker("a", ready=False), "decode", False),
    ("health", worker("a"), "decode", True),
])
def test_filters(name, w, role, keep):
    c = ctx()
    c.role = role
    assert FILTERS[name]().keep(c, w) is keep


def test_cache_aware_prefers_the_prefix_holder():
    pol = CacheAwarePolicy(rng=random.Random(0))
    ws = [worker("a", running=1), worker("b"), worker("c")]
    d = pol.pick(ctx({"a": 96}), ws)
    assert d.worker.id == "a" and d.reason == "prefix_hit" and d.matched_tokens == 96


def test_a_big_hit_on_a_slightly_busier_replica_still_wins():
    """Load only outvotes a prefix hit when the difference in load is real."""
    pol = CacheAwarePolicy(rng=random.Random(0))
    ws = [worker("a", running=3, kv=0.6, tokens=900, blocks=100), worker("b", running=2),
          worker("c", running=2)]
    assert pol.pick(ctx({"a": 90}), ws).worker.id == "a"


def test_saturation_guard_spills_a_hot_prefix():
    pol = CacheAwarePolicy(saturation_queue=4, rng=random.Random(0))
    ws = [worker("a", running=3, waiting=2), worker("b"), worker("c", running=1)]
    d = pol.pick(ctx({"a": 96}), ws)
    assert d.worker.id == "b" and d.reason == "saturated"
    hot_kv = [worker("a", kv=0.95), worker("b", kv=0.1)]
    assert pol.pick(ctx({"a": 96}), hot_kv).worker.id == "b"


def test_cold_requests_spread_by_load():
    pol = CacheAwarePolicy(rng=random.Random(1))
    ws = [worker("a", running=5), worker("b", running=0), worker("c", running=2)]
    d = pol.pick(ctx({}), ws)
    assert d.worker.id == "b" and d.reason == "load"
    # equal replicas: ties broken at random, so all of them get traffic
    equal = [worker("a"), worker("b"), worker("c")]
    assert {pol.pick(ctx({}), equal).worker.id for _ in range(60)} == {"a", "b", "c"}


# 128 blocks x 16 = 2048 tokens of KV: ~4 groups' 512-token system prompts
CAP_BLOCKS, CAP = 128, 2048


@pytest.mark.parametrize(("matched", "want"), [
    (512, "a"),  # 2 x 512/600 = 1.71 prefix credit > 1.0 churn gap
    (320, "a"),  # 53% of the prompt: 1.07 > 1.0, still the hit
    (256, "b"),  # 43%: 0.85 < 1.0; a hit under half the prompt loses to a full churn gap
])
def test_a_prefix_hit_outweighs_churn(matched, want):
    """Worker a holds `matched` of a 600-token prompt but its churn is at capacity (score
    0); b is cold with no churn (score 1); equal, idle load otherwise."""
    pol = CacheAwarePolicy(rng=random.Random(0))
    ws = [worker("a", blocks=CAP_BLOCKS), worker("b", blocks=CAP_BLOCKS)]
    d = pol.pick(ctx({"a": matched}, prompt_tokens=600, churn={"a": CAP, "b": 0}), ws)
    assert d.worker.id == want
    assert d.reason == ("prefix_hit" if want == "a" else "load")


def test_cold_requests_go_to_the_lowest_churn_among_equal_load():
    ws = [worker(w, running=1, blocks=CAP_BLOCKS) for w in "abc"]
    churn = {"a": 1000.0, "b": 400.0, "c": 1200.0}
    for seed in range(20):
        d = CacheAwarePolicy(rng=random.Random(seed)).pick(ctx(churn=churn), ws)
        assert d.worker.id == "b" and d.reason == "load"


@pytest.mark.parametrize(("b_queue", "want"), [
    (3, "b"),  # b: queue 1 - 3/8 = 0.625 + churn 1.0 = 1.625 > a: 1.0 + 0.5 = 1.5
    (5, "a"),  # b: 1 - 5/8 = 0.375 + 1.0 = 1.375 < 1.5: a, despite its churn
])
def test_churn_yields_to_a_real_load_gap(b_queue, want):
    """Cold request; a is idle with churn at half its capacity (score 0.5), b has no churn
    (score 1) and `b_queue` queued requests (KV and in-flight equal). A queued request is
    worth 1/8 (saturation_queue 8), so half a capacity of churn is worth 4 requests: below
    that gap the low-churn worker wins, above it the idle one does."""
    pol = CacheAwarePolicy(rng=random.Random(0))
    ws = [worker("a", blocks=CAP_BLOCKS), worker("b", waiting=b_queue, blocks=CAP_BLOCKS)]
    assert pol.pick(ctx(churn={"a": CAP / 2, "b": 0}), ws).worker.id == want


def test_unknown_scorer_weight_is_rejected():
    with pytest.raises(ValueError, match="unknown scorers"):
        CacheAwarePolicy(weights={"prefix": 1.0, "vibes": 2.0})
    with pytest.raises(ValueError, match=r"weights must be >= 0: \['queue'\]"):
        CacheAwarePolicy(weights={"prefix": 1.0, "queue": -1.0})


def test_baseline_policies():
    ws = [worker("b"), worker("a", running=3), worker("c", running=1)]
    rr = make_policy("round-robin")
    assert [rr.pick(ctx(), ws).worker.id for _ in range(4)] == ["a", "b", "c", "a"]
    assert make_policy("least-loaded", rng=random.Random(0)).pick(ctx(), ws).worker.id == "b"
    rnd = make_policy("random", rng=random.Random(0))
    assert {rnd.pick(ctx(), ws).worker.id for _ in range(50)} == {"a", "b", "c"}
    assert set(POLICIES) == {"cache-aware", "cost", "round-robin", "random", "least-loaded"}


def test_circuit_breaker_opens_half_opens_and_closes():
    b = CircuitBreaker(threshold=2, cooldown_s=5.0)
    b.on_failure(now=0.0)
    assert b.allows(0.1)
    b.on_failure(now=1.0)
    assert b.state is BreakerState.OPEN and not b.allows(2.0)
    assert b.allows(6.5) and b.current(6.5) is BreakerState.HALF_OPEN  # one trial
    assert b.state is BreakerState.OPEN and b.allows(6.5)  # asking changes nothing
    b.on_attempt(6.5)
    assert b.state is BreakerState.HALF_OPEN and not b.allows(6.6)  # one trial at a time
    b.on_failure(now=7.0)
    assert b.state is BreakerState.OPEN and not b.allows(8.0)
    assert b.allows(12.5)
    b.on_attempt(12.5)
    b.on_success()
    assert b.state is BreakerState.CLOSED and b.allows(12.6)
