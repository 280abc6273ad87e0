"""Adaptive speculation (`SpecPolicy`): backs off on rejections and at high load, probes to
recover, learns the per-position acceptance rate; torch-free."""

from __future__ import annotations

import itertools
import random

import pytest

from tandem.engine.spec_decode import SpeculativeConfig
from tandem.engine.spec_decode.base import DraftCost
from tandem.engine.spec_decode.policy import (
    MAX_SATURATION,
    SpecPolicy,
    StepCostFit,
    expected_tokens,
)


def cfg(k: int = 4, adaptive: bool = True) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=adaptive)


def run(policy: SpecPolicy, steps: int, accept, batch: int = 1, rid: str = "r") -> list[int]:
    """k per step for one request; `accept(k)` = drafts kept out of k."""
    ks = []
    for _ in range(steps):
        (k,) = policy.choose([rid], batch)
        if k:
            policy.observe(rid, k, accept(k))
        ks.append(k)
    return ks


def throughput(useful: float, tokens: int, a: float, k: int, sat: float, rounds: int = 0,
               draft_cost: float = 0.0) -> float:
    """The documented rule: the step's useful tokens over its cost with k more drafts, the
    proposer drafting max(rounds, k) lockstep rounds."""
    return (useful + expected_tokens(a, k) - 1) / (
        1 + (tokens + k) / sat + max(rounds, k) * draft_cost)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("period", [1, 3, 8])
def test_rejected_drafts_back_off_to_probes(period):
    policy = SpecPolicy(cfg(), probe_period=period)
    ks = run(policy, 400, lambda k: 0)
    assert ks[0] == 4  # the prior speculates
    tail = ks[200:]
    assert set(tail) <= {0, 1}
    ones = [i for i, k in enumerate(ks) if k == 1 and i >= 200]
    assert ones, "probes"
    assert all(b - a == period for a, b in zip(ones, ones[1:], strict=False))


def test_accepted_drafts_reach_max_and_recover_after_probe():
    policy = SpecPolicy(cfg(5), probe_period=4)
    assert run(policy, 10, lambda k: k)[-5:] == [5] * 5
    run(policy, 200, lambda k: 0)  # text turns unpredictable: down to probes
    assert policy.choose(["r"], 1) in ([0], [1])
    ks = run(policy, 30, lambda k: k)  # predictable again: probes succeed, k climbs back
    assert ks[-1] == 5


def test_k_shrinks_as_batch_grows():
    for a_hits in range(0, 12):
        policy = SpecPolicy(cfg(8), probe_period=10**9)
        for _ in range(3):
            policy.observe("r", 8, a_hits if a_hits < 8 else 8)
        ks = [policy.choose(["r"], t)[0] for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)]
        assert ks == sorted(ks, reverse=True), (policy.acceptance("r"), ks)
    # a decent draft (a ~ 0.8) speculates fully alone and not at all in a large batch
    policy = SpecPolicy(cfg(4), probe_period=10**9, prior=0.8)
    assert policy.choose(["x"], 1) == [4]
    assert policy.choose(["x"], 256) == [0]
    # in order: each request's drafts count in the next one's batch
    many = policy.choose([f"r{i}" for i in range(16)], 16)
    assert many == sorted(many, reverse=True) and many[0] > many[-1]


def test_not_adaptive_is_always_k():
    policy = SpecPolicy(cfg(3, adaptive=False))
    for t in (1, 100, 10_000):
        assert policy.choose(["a", "b"], t) == [3, 3]
        policy.observe("a", 3, 0)
    assert run(policy, 50, lambda k: 0) == [3] * 50


def test_acceptance_estimate_is_per_position():
    # drafts accepted position by position with probability q until the first miss: the
    # estimate converges to q (accepted / proposed would give much less)
    rng = random.Random(3)
    q = 0.7
    policy = SpecPolicy(cfg(4), ema_alpha=0.01, global_alpha=0.01)
    for _ in range(6000):
        acc = 0
        while acc < 4 and rng.random() < q:
            acc += 1
        policy.observe("r", 4, acc)
    assert policy.acceptance("r") == pytest.approx(q, abs=0.05)
    assert policy.global_acceptance == pytest.approx(q, abs=0.05)


def test_new_requests_start_from_global_and_release_forgets():
    policy = SpecPolicy(cfg(), prior=0.6)
    assert policy.acceptance("new") == 0.6
    run(policy, 100, lambda k: 0, rid="bad")
    assert policy.acceptance("bad") < 0.05
    assert policy.acceptance("new") == policy.global_acceptance < 0.6
    policy.release("bad")
    assert policy.acceptance("bad") == policy.global_acceptance


def test_random_traces_bounds_and_greedy_optimum():
    rng = random.Random(11)
    for _ in range(40):
        k_max = rng.randint(1, 8)
        sat, margin = rng.choice([8.0, 24.0, 256.0]), rng.choice([0.0, 0.02, 0.1])
        cost = 0.0  # free drafting: the sequential rule (rounds cost nothing)
        policy = SpecPolicy(cfg(k_max), saturation_tokens=sat, margin=margin,
                            probe_period=rng.randint(1, 10), prior=rng.random())
        quality = {f"r{i}": rng.random() for i in range(6)}
        for _ in range(60):
            ids = rng.sample(sorted(quality), rng.randint(1, 6))
            batch = rng.randint(len(ids), 300)
            accs = [policy.acceptance(r) for r in ids]
            probes = policy.num_probes
            ks = policy.choose(ids, batch)
            assert all(isinstance(k, int) and 0 <= k <= k_max for k in ks), ks
            if policy.num_probes == probes:  # no probe: every k is the documented optimum
                useful, tokens, rounds = float(batch), batch, 0
                for a, k in zip(accs, ks, strict=True):
                    ratios = [throughput(useful, tokens, a, j, sat, rounds, cost)
                              for j in range(k_max + 1)]
                    if k:
                        assert ratios[k] == pytest.approx(max(ratios))
                        assert ratios[k] > ratios[0] * (1 + margin)
                    else:
                        assert max(ratios) <= ratios[0] * (1 + margin) * (1 + 1e-12)
                    useful += expected_tokens(a, k) - 1
                    tokens += k
                    rounds = max(rounds, k)
            for r, k in zip(ids, ks, strict=True):
                if k:
                    acc = 0
                    while acc < k and rng.random() < quality[r]:
                        acc += 1
                    policy.observe(r, k, acc)
            if rng.random() < 0.1:
                policy.release(rng.choice(sorted(quality)))


def test_measured_draft_cost_and_lockstep_rounds():
    policy = SpecPolicy(cfg(4), saturation_tokens=24.0, probe_period=10**9, prior=0.96)
    assert policy.draft_cost == 0.0
    policy.observe_timing(0.0, 5)  # nothing measured: ignored
    policy.observe_timing(0.040 * (1 + 1 / 24), 1)  # one-token step: 40 ms
    assert policy.draft_cost == 0.0  # a proposer without rounds stays free
    policy.observe_timing(0.040 * (1 + 9 / 24), 9, round_cost=DraftCost(0.012, 0.002))
    assert policy.draft_cost == pytest.approx(0.3)
    assert policy.draft_cost_per_row == pytest.approx(0.05)
    # the unit time is an EMA: a noisy step moves it a tenth of the way
    policy.observe_timing(0.080 * (1 + 1 / 24), 1, round_cost=DraftCost(0.012, 0.0))
    assert policy.draft_cost == pytest.approx(0.012 / 0.044)
    assert policy.draft_cost_per_row == 0.0
    # a round whose cost grows with its rows: 8 requests share fewer rounds than 1 takes
    rowwise = SpecPolicy(cfg(4), probe_period=10**9, prior=0.96)
    rowwise.draft_cost_per_row = 0.25  # a round of 8 rows costs two target steps
    assert rowwise.choose(["a"], 1) == [4]
    assert sum(rowwise.choose([f"r{i}" for i in range(8)], 8)) < 4 * 8
    # a draft costing a third of a step still pays alone; at batch 8 the rounds are shared,
    # so every request speculates at the same k
    costly = SpecPolicy(cfg(4), probe_period=10**9, prior=0.96, draft_cost=0.33)
    assert costly.choose(["a"], 1) == [4]
    ks = costly.choose([f"r{i}" for i in range(8)], 8)
    assert ks == [ks[0]] * 8 and ks[0] >= 1
    # one request among 7 tokens of others' prefill: a free draft still speculates, the
    # costly one cannot share its rounds with anybody and backs off
    free = SpecPolicy(cfg(4), probe_period=10**9, prior=0.96)
    assert free.choose(["x"], 8) == [4]
    assert costly.choose(["x"], 8) == [0]


def test_costly_drafts_plan_near_the_brute_force_optimum():
    """With a drafting cost (fixed, per drafting request, and amortised catch-ups), the
    batch's plan is within 1 % of the best of every k vector
    (exhaustive over up to 4 requests and k <= 4), and never below drafting nothing."""
    rng = random.Random(5)
    worst = 1.0
    for _ in range(1500):
        k_max, n = rng.randint(1, 4), rng.randint(1, 4)
        sat, cost = rng.choice([8.0, 24.0, 256.0]), rng.choice([0.02, 0.1, 0.3, 1.0])
        policy = SpecPolicy(cfg(k_max), saturation_tokens=sat, draft_cost=cost, margin=0.0,
                            probe_period=10**9)
        policy.draft_cost_per_row = per_row = rng.choice([0.0, 0.05, 0.2])
        policy.catchup_cost = per_token = rng.choice([0.0, 0.002, 0.01])
        catchup = [rng.choice([0, 0, rng.randint(9, 400)]) for _ in range(n)]
        remaining = [rng.randint(1, 300) for _ in range(n)]
        ids = [f"r{i}" for i in range(n)]
        for rid in ids:  # a random acceptance history per request
            for _ in range(rng.randint(0, 6)):
                k = rng.randint(1, k_max)
                policy.observe(rid, k, rng.randint(0, k))
        accs = [policy.acceptance(r) for r in ids]
        batch = rng.randint(n, 200)
        ks = policy.choose(ids, batch, catchup, remaining)

        def step(vec, accs=accs, batch=batch, sat=sat, cost=cost, per_row=per_row,
                 catchup=catchup, remaining=remaining, per_token=per_token):
            rows = sum(k > 0 for k in vec)
            gains = [expected_tokens(a, k) for a, k in zip(accs, vec, strict=True)]
            extra = sum(c * per_token * g / max(left, g) for c, left, g, k in zip(
                catchup, remaining, gains, vec, strict=True) if k)
            return throughput(batch, batch, 1.0, 0, sat) if not any(vec) else (
                batch + sum(g - 1 for g in gains)
            ) / (1 + (batch + sum(vec)) / sat + extra + max(vec) * (cost + per_row * rows))

        best = max(step(v) for v in itertools.product(range(k_max + 1), repeat=n))
        got = step(ks)
        assert got >= step([0] * n) * (1 - 1e-12)
        worst = min(worst, got / best)
    assert worst >= 0.99, worst


def test_a_catch_up_is_paid_only_when_the_rest_of_the_request_repays_it():
    """A draft that must first run a 300-token prompt (a token costing 2 % of a target step,
    so 6 steps in all) drafts for a request with 500 tokens to go, not for one with 8."""
    policy = SpecPolicy(cfg(4), probe_period=10**9, prior=0.9, draft_cost=0.1)
    policy.catchup_cost = 0.02
    assert policy.choose(["long"], 1, [300], [500]) == [4]
    assert policy.choose(["short"], 1, [300], [8]) == [0]
    assert policy.choose(["short"], 1, [0], [8]) == [4]  # caught up: rounds only
    # a probe needing a long catch-up is not handed out when a few tokens remain
    probe = SpecPolicy(cfg(4), probe_period=1, prior=0.05, draft_cost=0.1)
    probe.catchup_cost = 0.02
    assert probe.choose(["p"], 1, [300], [8]) == [0]
    assert probe.choose(["q"], 1, [0], [8]) == [1]
    assert probe.num_probes == 1


def test_step_cost_fit_learns_the_machines_saturation():
    rng = random.Random(8)
    fit = StepCostFit()
    fit.add(4, 0.045)
    fit.add(12, 0.10)
    assert fit.line() is None  # too little weight
    for _ in range(40):
        fit.add(8, 0.05)
    assert fit.w > fit.min_weight and fit.line() is None  # the sizes no longer spread
    w = fit.w
    fit.add(4096, 9.0)  # a long prefill chunk is outside the fitted range
    assert fit.w == w
    c0, c1 = 0.040, 0.005  # a CPU that saturates at 8 tokens
    for _ in range(300):
        t = rng.randint(1, 40)
        fit.add(t, (c0 + c1 * t) * rng.uniform(0.97, 1.03))
    got0, got1 = fit.line()
    assert got0 == pytest.approx(c0, rel=0.05) and got1 == pytest.approx(c1, rel=0.05)
    # the policy adopts it: at 8 decodes, acceptance 0.6, it drafts less than with the prior
    learned = SpecPolicy(cfg(4), probe_period=10**9, prior=0.6)
    for _ in range(300):
        t = rng.randint(1, 40)
        learned.observe_timing(c0 + c1 * t, t)
    assert learned.saturation == pytest.approx(8.0, rel=0.02)
    prior = SpecPolicy(cfg(4), probe_period=10**9, prior=0.6)
    ids = [f"r{i}" for i in range(8)]
    assert sum(learned.choose(ids, 8)) < sum(prior.choose(ids, 8))
    # a flat machine (extra tokens free): the largest saturation, full speculation
    # a prior (calibration) keeps the slope once the live sizes stop spreading
    anchored = StepCostFit()
    anchored.add_prior(1, 0.011, 8)
    anchored.add_prior(8, 0.032, 8)
    assert anchored.line() == pytest.approx((0.008, 0.003))
    for _ in range(1000):
        anchored.add(1, 0.012)
    got0, got1 = anchored.line()
    assert got1 == pytest.approx(0.003, rel=0.05) and got0 == pytest.approx(0.009, rel=0.05)
    flat = SpecPolicy(cfg(4), probe_period=10**9, prior=0.6)
    for _ in range(100):
        flat.observe_timing(0.05, rng.randint(1, 40))
    assert flat.saturation == MAX_SATURATION
    assert flat.choose(ids, 8) == [4] * 8
