"""The cost-based pick (`scorers.cost`, `policy.CostPolicy`) on constructed loads: exact costs
and exact winners, the rate fallbacks, LoRA residency and the session boost folded in, and
a worker's reported costs bounded."""

from __future__ import annotations

import math
import random

import pytest

from tandem.router.policy import CacheAwarePolicy, CostPolicy, make_policy
from tandem.router.scorers import SCORERS, RoutingContext
from tandem.router.scorers.cost import (
    CHUNK_TOKENS,
    DEFAULT_DECODE_STEP_S,
    DEFAULT_PREFILL_S_PER_TOKEN,
    costs,
)
from tandem.router.workers import (
    MAX_DECODE_STEP_S,
    MAX_PENDING_PREFILL_TOKENS,
    MAX_PREFILL_S_PER_TOKEN,
    Worker,
    WorkerLoad,
    bounded_costs,
)

RATE = 1e-4  # s per prefill token: 10,000 tokens/s
STEP = 0.02  # s per decode step


def worker(wid: str, running: int = 0, waiting: int = 0, pending: int = 0,
           rate: float = RATE, step: float = STEP, **load: object) -> Worker:
    return Worker(id=wid, model="m", ready=True, block_size=16, load=WorkerLoad(
        num_running=running, num_waiting=waiting, pending_prefill_tokens=pending,
        prefill_s_per_token=rate, decode_step_s=step, **load))


def ctx(prompt: int, matched: dict[str, int] | None = None, **kw: object) -> RoutingContext:
    return RoutingContext(model="m", prompt_tokens=prompt, matched_tokens=matched or {}, **kw)


def pick(c: RoutingContext, workers: list[Worker], **kw: object) -> str:
    return CostPolicy(rng=random.Random(0), **kw).pick(c, workers).worker.id


def cost(uncached: float, queued: float = 0, rate: float = RATE, step: float = STEP) -> float:
    """The cost of `uncached` prompt tokens behind `queued` ones: their prefill, the cached
    tokens the uncached ones displace, and one decode step of the worker's batch per
    CHUNK_TOKENS of work (at least one)."""
    work = uncached + queued
    return rate * (work + uncached) + step * (1 + work / CHUNK_TOKENS)


def test_a_short_shared_prefix_does_not_outweigh_a_long_queue():
    # 1,000-token prompt; "hot" holds 256 of it but queues 4 requests whose prompts still
    # need 3,000 tokens of prefill; "idle" holds nothing and runs nothing
    hot = worker("hot", running=12, waiting=4, pending=3000)
    idle = worker("idle")
    c = ctx(1000, {"hot": 256})
    assert costs(c, [hot, idle]) == pytest.approx([cost(744, 3000), cost(1000)])
    assert pick(c, [hot, idle]) == "idle"  # 0.5419 vs 0.2395
    # below the saturation depth of 8 cache-aware's prefix credit holds, and a half-prompt
    # hit outweighs six queued requests; the cost still says idle (0.4857 vs 0.2395)
    hot.load.num_running, hot.load.num_waiting = 6, 0
    c = ctx(1000, {"hot": 512})
    assert CacheAwarePolicy(rng=random.Random(0)).pick(c, [hot, idle]).worker.id == "hot"
    assert pick(c, [hot, idle]) == "idle"


def test_a_long_cached_prefix_wins_over_a_short_idle_queue():
    # 8,000-token prompt: "warm" holds 7,680 tokens, runs 3 and has 200 tokens queued;
    # "idle" holds none
    warm, idle = worker("warm", running=3, pending=200), worker("idle")
    c = ctx(8000, {"warm": 7680})
    assert costs(c, [warm, idle]) == pytest.approx([cost(320, 200), cost(8000)])
    assert pick(c, [warm, idle]) == "warm"  # 0.114 vs 1.776


def test_a_busier_batch_or_a_slower_prefill_loses_the_same_work():
    fast, slow = worker("fast", rate=5e-5), worker("slow", rate=4e-4)
    c = ctx(2000)
    assert costs(c, [fast, slow]) == pytest.approx([cost(2000, rate=5e-5),
                                                    cost(2000, rate=4e-4)])
    assert pick(c, [slow, fast]) == "fast"
    light, heavy = worker("light", running=2, step=0.02), worker("heavy", running=40, step=0.2)
    assert costs(c, [light, heavy]) == pytest.approx([cost(2000), cost(2000, step=0.2)])
    assert pick(c, [heavy, light]) == "light"


def test_unreported_rates_fall_back_to_the_fleet_median_then_the_default():
    a, b, c_ = worker("a", rate=1e-4), worker("b", rate=3e-4), worker("c", rate=2e-4)
    new = worker("new", rate=0.0, step=0.0, running=1)
    got = costs(ctx(1000), [a, b, c_, new])
    assert got[3] == pytest.approx(cost(1000, rate=2e-4))  # the median rate and step
    alone = costs(ctx(1000), [worker("x", rate=0.0, step=0.0, running=2)])
    assert alone == pytest.approx([cost(1000, rate=DEFAULT_PREFILL_S_PER_TOKEN,
                                        step=DEFAULT_DECODE_STEP_S)])


def test_requests_sent_since_the_last_report_count_as_queued_prompts():
    a, b = worker("a", running=1), worker("b", running=1)
    a.local_in_flight = 4  # 3 more than its last report shows
    c = ctx(500)
    assert costs(c, [a, b]) == pytest.approx([cost(500, 3 * 500), cost(500)])
    assert pick(c, [a, b]) == "b"


def test_lora_residency_is_folded_in():
    # every slot of "busy" holds other adapters: it must swap one in (a miss of
    # saturation_queue decode steps); "holder" already runs the adapter
    holder = worker("holder", running=2, running_loras=frozenset({"sql"}), max_loras=2)
    busy = worker("busy", running_loras=frozenset({"x", "y"}), max_loras=2)
    free = worker("free", running=1, running_loras=frozenset({"x"}), max_loras=2)
    c = ctx(100, lora="sql")
    assert costs(c, [holder, busy, free]) == pytest.approx(
        [cost(100), cost(100) + 8 * STEP, cost(100) + 0.5 * 8 * STEP])
    assert pick(c, [busy, free, holder]) == "holder"
    base = ctx(100)  # a base-model request pays no miss anywhere
    assert costs(base, [busy]) == pytest.approx([cost(100)])


def test_the_session_worker_counts_at_cost_over_one_plus_its_weight():
    a, b = worker("a", pending=600), worker("b")
    c = ctx(100, session_worker="a")  # a: 0.1137, b: 0.0420
    assert costs(c, [a, b]) == pytest.approx([cost(100, 600), cost(100)])
    assert pick(c, [a, b]) == "b"  # the default weight 1: 0.0568
    assert pick(c, [a, b], weights={"session_affinity": 2.0}) == "a"  # 0.0379: cheapest
    assert pick(c, [a, b], weights={"session_affinity": 1.5}) == "a"  # 0.0455: within 20 %
    assert pick(c, [a, b], weights={"session_affinity": 1.2}) == "b"  # 0.0517: beyond
    assert pick(c, [a, b], weights={"session_affinity": 0.0}) == "b"
    gone = ctx(100, session_worker="http://gone")  # names no candidate: ignored
    assert pick(gone, [a, b], weights={"session_affinity": 2.0}) == "b"


def test_near_equal_costs_go_to_the_least_churned_worker():
    # 0.2395, 0.2595 and 0.2775 are within 20 % of the lowest; 0.2995 is not
    ws = [worker("a"), worker("b", rate=1.1e-4), worker("c", rate=1.19e-4),
          worker("d", rate=1.3e-4)]
    for w in ws:
        w.load.num_total_blocks = 100  # 1,600 tokens of KV
    churn = {"a": 1200.0, "b": 800.0, "c": 400.0, "d": 0.0}
    assert pick(ctx(1000, churn_tokens=churn), ws) == "c"
    assert pick(ctx(1000, churn_tokens={**churn, "c": 1600.0}), ws) == "b"
    assert CostPolicy().uses("cache_churn")  # so the router fills the churn in


def test_ties_break_at_random_with_the_seed():
    ws = [worker(f"w{i}") for i in range(4)]
    first = [CostPolicy(rng=random.Random(7)).pick(ctx(10), ws).worker.id for _ in range(3)]
    assert len(set(first)) == 1  # the same seed, the same pick
    seen = {pick_ for pick_ in (CostPolicy(rng=random.Random(s)).pick(ctx(10), ws).worker.id
                                for s in range(40))}
    assert seen == {"w0", "w1", "w2", "w3"}


def test_the_policy_and_scorer_are_registered():
    policy = make_policy("cost", weights={"session_affinity": 2.0}, saturation_queue=4)
    assert isinstance(policy, CostPolicy) and policy.session_boost == 2.0
    assert policy.limits.saturation_queue == 4
    with pytest.raises(ValueError, match="session_affinity"):
        CostPolicy(weights={"session_affinity": -1.0})
    # the scorer (for cache-aware weights): min cost / cost
    got = SCORERS["cost"]().score(ctx(1000), [worker("a"), worker("b", pending=500)])
    assert got == pytest.approx([1.0, cost(1000) / cost(1000, 500)])
    d = CostPolicy(rng=random.Random(0)).pick(ctx(1000, {"a": 512}), [worker("a")])
    assert (d.reason, d.matched_tokens, d.scores) == ("prefix_hit", 512,
                                                      {"cost": pytest.approx(cost(488))})


@pytest.mark.parametrize(("reported", "want"), [
    ((1e-4, 0.02, 300), (1e-4, 0.02, 300)),
    ((math.nan, math.inf, 0), (0.0, 0.0, 0)),
    ((-1.0, -0.5, 0), (0.0, 0.0, 0)),
    ((5.0, 1e9, 1 << 60), (MAX_PREFILL_S_PER_TOKEN, MAX_DECODE_STEP_S,
                           MAX_PENDING_PREFILL_TOKENS)),
])
def test_reported_costs_are_bounded(reported, want):
    assert bounded_costs(*reported) == want


def test_bounded_costs_keep_every_cost_finite():
    rng = random.Random(41)
    specials = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-30, 1e30]
    for _ in range(2000):
        vals = [rng.choice(specials + [rng.uniform(0, 1)]) for _ in range(2)]
        rate, step, pending = bounded_costs(vals[0], vals[1], rng.choice([0, 1 << 63, 77]))
        w = worker("w", rate=rate, step=step, pending=pending, running=rng.randrange(1000))
        (c,) = costs(ctx(rng.randrange(1, 100_000)), [w])
        assert math.isfinite(c) and c >= 0.0


def test_tandem_router_offers_every_policy(tmp_path):
    from tandem.router import main
    from tandem.router.policy import POLICIES
    from tests.router.test_discovery import _args

    assert set(main.POLICIES) == set(POLICIES)
    cfg = tmp_path / "router.yaml"
    cfg.write_text("policy: cost\nweights: {session_affinity: 3.0}\nsaturation_queue: 5\n")
    _, router, _ = main.build(_args("--config", str(cfg), "--workers", "http://a:1"))
    assert isinstance(router.policy, CostPolicy) and router.policy.session_boost == 3.0
    assert router.policy.limits.saturation_queue == 5
    _, router, _ = main.build(_args("--workers", "http://a:1"))  # the default policy
    assert isinstance(router.policy, CostPolicy) and router.policy.session_boost == 1.0
    assert router.settings.policy == main.DEFAULT_POLICY == "cost"


def test_cache_aware_adds_the_session_weight_to_the_tokens_worker():
    from tandem.router.policy import DEFAULT_WEIGHTS

    a, b = worker("a", running=2), worker("b")  # queue scores 0.75 and 1.0, the rest equal
    c = ctx(100, session_worker="a")
    assert CacheAwarePolicy(rng=random.Random(0)).pick(c, [a, b]).worker.id == "a"  # +1.0
    weak = CacheAwarePolicy({**DEFAULT_WEIGHTS, "session_affinity": 0.2}, rng=random.Random(0))
    assert weak.pick(c, [a, b]).worker.id == "b"  # 0.95 < 1.0
    assert CacheAwarePolicy(rng=random.Random(0)).pick(ctx(100), [a, b]).worker.id == "b"
    assert not CacheAwarePolicy().uses("session_affinity")  # no scorer column of its own
