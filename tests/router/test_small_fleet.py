"""A small fleet's per-decision shortcuts are exact, over thousands of seeded random cases:
the candidate scan (`Router._candidates`, the built-in filters' checks in one pass) keeps
exactly the workers the filters keep, in order; `scorers.cost.costs` equals the cost model's
formula bit for bit."""

from __future__ import annotations

import random

from tandem.router.core import Router, RouterSettings
from tandem.router.scorers import RoutingContext
from tandem.router.scorers.base import LoadLimits
from tandem.router.scorers.cost import (
    CHUNK_TOKENS,
    DEFAULT_DECODE_STEP_S,
    DEFAULT_PREFILL_S_PER_TOKEN,
    costs,
    fleet_rate,
)
from tandem.router.scorers.lora import LoRAAffinityScorer
from tandem.router.workers import BreakerState, CircuitBreaker, Worker, WorkerLoad

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


def reference_costs(ctx: RoutingContext, workers: list[Worker], queue: float) -> list[float]:
    """The cost model as written out (`scorers.cost` module doc), one worker at a time."""
    rates = [w.load.prefill_s_per_token for w in workers]
    steps = [w.load.decode_step_s for w in workers]
    rate0 = 0.0 if all(rates) else fleet_rate(rates, DEFAULT_PREFILL_S_PER_TOKEN)
    step0 = 0.0 if all(steps) else fleet_rate(steps, DEFAULT_DECODE_STEP_S)
    lora = (LoRAAffinityScorer.score_one(ctx.lora, workers) if ctx.lora is not None
            else None)
    out = []
    for i, w in enumerate(workers):
        load = w.load
        rate = load.prefill_s_per_token or rate0
        step = load.decode_step_s or step0
        uncached = max(ctx.prompt_tokens - ctx.matched_tokens.get(w.id, 0), 0)
        unseen = max(w.local_in_flight - load.num_running - load.num_waiting, 0)
        work = uncached * (1 + unseen) + load.pending_prefill_tokens
        cost = rate * (work + uncached) + step * (1.0 + work / CHUNK_TOKENS)
        if lora is not None:
            cost += (1.0 - lora[i]) * queue * step
        out.append(cost)
    return out


def test_costs_equal_the_formula_bit_for_bit():
    rng = random.Random(7)
    for trace in range(1000):
        workers = []
        for i in range(rng.randint(1, 64)):
            load = WorkerLoad(
                num_running=rng.randint(0, 40), num_waiting=rng.randint(0, 20),
                pending_prefill_tokens=rng.choice([0, rng.randint(0, 50_000)]),
                prefill_s_per_token=rng.choice([0.0, rng.uniform(1e-6, 1e-3)]),
                decode_step_s=rng.choice([0.0, rng.uniform(1e-3, 0.2)]),
                resident_loras=frozenset(rng.sample(["a", "b"], rng.randint(0, 2))),
                max_loras=rng.randint(0, 4))
            w = Worker(id=f"w{i}", model="m", ready=True, load=load,
                       lora_digests={"a": "d"} if rng.random() < 0.5 else {})
            w.local_in_flight = rng.randint(0, 60)
            workers.append(w)
        matched = {w.id: rng.randint(0, 9000) for w in workers if rng.random() < 0.5}
        ctx = RoutingContext(model="m", prompt_tokens=rng.randint(0, 8000),
                             matched_tokens=matched, lora=rng.choice([None, "a", "b"]))
        limits = LoadLimits(saturation_queue=rng.choice([1, 8, 3]))
        assert costs(ctx, workers, limits) == reference_costs(
            ctx, workers, limits.saturation_queue), trace


def test_hash_groups_equal_each_workers_own_group():
    rng = random.Random(3)
    for trace in range(2000):
        sizes = rng.choice([[16], [0, 16], [16, 32], [0], [8, 16, 32]])
        workers = [Worker(id=f"w{i}", model="m", block_size=rng.choice(sizes),
                          lora_digests={"a": rng.choice(["d1", "d2"])})
                   for i in range(rng.randint(0, 64))]
        for lora in (None, "a", "b"):
            want: dict = {}
            for w in workers:
                want.setdefault(w.hash_group(lora), []).append(w)
            got = Router.hash_groups(iter(workers) if trace % 2 else workers, lora)
            assert list(got.items()) == list(want.items()), (trace, lora)
