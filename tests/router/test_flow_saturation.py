"""The router's flow-control capacity is maintained as workers change (`saturation`), not
scanned per request: over thousands of seeded random load reports, readiness flips, open
requests, renames, adapter reports, breaker trips and joins/leaves it answers exactly what
the straightforward scan of every worker answers."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from tandem.router.core import Router, RouterSettings
from tandem.router.flowcontrol.base import ModelCapacity
from tandem.router.workers import LoRAReport, Worker, WorkerLoad

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from sim_fleet import scan_capacity, scan_saturated  # noqa: E402  (the oracle)

NAMES = ("m", "n", "alias", "lora-a", "cold", "absent")


def step(router: Router, rng: random.Random, now: float) -> None:
    """One random event on the fleet."""
    ids = [f"http://w{i}" for i in range(10)]
    wid = rng.choice(ids)
    w = router.workers.get(wid)
    op = rng.randrange(10)
    if w is None or op == 0:
        if w is not None and rng.random() < 0.5:
            router.remove_worker(wid)
        else:
            router.add_worker(Worker(wid, model=rng.choice(("m", "n", "")),
                                     role=rng.choice(("both", "decode", "prefill")),
                                     ready=rng.random() < 0.5))
    elif op == 1:
        w.ready = not w.ready
    elif op in (2, 3):
        w.load = WorkerLoad(num_running=rng.randrange(4), num_waiting=rng.randrange(4),
                            kv_cache_usage=rng.choice((0.0, 0.5, 0.85, 0.9, 1.0)))
    elif op == 4:
        w.local_in_flight = max(0, w.local_in_flight + rng.choice((-1, 1, 2)))
    elif op == 5:
        w.model = rng.choice(("m", "n", ""))
        w.aliases = frozenset(rng.sample(("alias", "m", "n"), rng.randrange(2)))
    elif op == 6:
        w.apply_lora_report(LoRAReport.reported(
            {a: "d" for a in rng.sample(("lora-a", "lora-b"), rng.randrange(3))}))
    elif op == 7:
        w.role = rng.choice(("both", "decode", "prefill"))
    elif op == 8:
        w.breaker.on_failure(now)
    else:
        w.breaker.on_attempt(now)
        if rng.random() < 0.5:
            w.breaker.on_success()


@pytest.mark.parametrize("seed", range(6))
def test_maintained_capacity_equals_the_scan_over_random_events(seed: int) -> None:
    rng = random.Random(seed)
    router = Router(RouterSettings(flow_saturation_waiting=2, flow_saturation_kv=0.9,
                                   served_models={"cold": 30.0}), lambda m: None)
    now, seen = 100.0, set()
    for _ in range(1500):
        step(router, rng, now)
        now += rng.choice((0.0, 0.5, 3.0))  # breakers reopen past their cooldown
        for name in NAMES:
            cap = router.capacity(name, now)
            assert cap is scan_capacity(router, name, now), name
            assert router.saturated(name) == scan_saturated(router, name), name
            seen.add(cap)
    assert seen == set(ModelCapacity)  # every answer was exercised


def test_a_worker_that_left_is_no_longer_watched() -> None:
    router = Router(RouterSettings(flow_saturation_waiting=1), lambda m: None)
    w = Worker("http://a", model="m", ready=True)
    router.add_worker(w)
    router.remove_worker(w.id)
    w.load = WorkerLoad(num_waiting=3)  # a late report of the worker that left
    assert router.capacity("m", 1.0) is ModelCapacity.NONE and router.saturated("m") == set()
    assert w.watcher is None
