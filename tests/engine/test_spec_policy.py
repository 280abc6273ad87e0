"""Adaptive speculation (`SpecPolicy`): backs off on rejections and at high load, probes to
recover, learns the per-position acceptance rate; torch-free."""

from __future__ import annotations

import random

import pytest

from tandem.engine.spec_decode import SpeculativeConfig
from tandem.engine.spec_decode.policy import SpecPolicy, expected_tokens


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


def throughput(useful: float, tokens: int, a: float, k: int, sat: float) -> float:
    """The documented rule: the step's useful tokens over its cost with k more drafts."""
    return (useful + expected_tokens(a, k) - 1) / (1 + (tokens + k) / sat)


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
                useful, tokens = float(batch), batch
                for a, k in zip(accs, ks, strict=True):
                    ratios = [throughput(useful, tokens, a, j, sat) for j in range(k_max + 1)]
                    if k:
                        assert ratios[k] == pytest.approx(max(ratios))
                        assert ratios[k] > ratios[0] * (1 + margin)
                    else:
                        assert max(ratios) <= ratios[0] * (1 + margin) * (1 + 1e-12)
                    useful += expected_tokens(a, k) - 1
                    tokens += k
            for r, k in zip(ids, ks, strict=True):
                if k:
                    acc = 0
                    while acc < k and rng.random() < quality[r]:
                        acc += 1
                    policy.observe(r, k, acc)
            if rng.random() < 0.1:
                policy.release(rng.choice(sorted(quality)))
