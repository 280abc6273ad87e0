"""A simulated fleet for flow control's capacity questions, shared by `flow_capacity.py` and
tests/router/test_flow_saturation.py: the straightforward per-request scan of every worker
(`scan_capacity`, `scan_saturated`: the rule as first written, the benchmark's baseline and
the test's oracle for the maintained `saturation.SaturationBook`) and `fleet`, N ready
workers of one model with a given share saturated."""

from __future__ import annotations

import random

from tandem.router.core import Router, RouterSettings
from tandem.router.flowcontrol.base import ModelCapacity
from tandem.router.workers import Worker, WorkerLoad

MODEL = "m"


def scan_capacity(router: Router, model: str, now: float) -> ModelCapacity:
    """Every worker looked at: AVAILABLE at the first routable unsaturated one of `model`
    (prefill workers aside), else SATURATED if some routable one is full, else STARTING for
    a model that has workers or is a served model, else NONE."""
    known = saturated = False
    for w in router.workers.values():
        if not w.serves(model) or w.role == "prefill":
            continue
        known = True
        if not w.routable(now):
            continue
        if not router.is_saturated(w):
            return ModelCapacity.AVAILABLE
        saturated = True
    if saturated:
        return ModelCapacity.SATURATED
    if known or model in router.settings.served_models:
        return ModelCapacity.STARTING
    return ModelCapacity.NONE


def scan_saturated(router: Router, model: str) -> set[str]:
    """The ids of `model`'s saturated workers (prefill workers aside), every worker looked at."""
    return {w.id for w in router.workers.values()
            if w.serves(model) and w.role != "prefill" and router.is_saturated(w)}


def fleet(n: int, saturated: float, rng: random.Random) -> Router:
    """A router over `n` ready workers of MODEL, each saturated (6 waiting against a bound
    of 4) with probability `saturated`."""
    router = Router(RouterSettings(seed=0, flow_saturation_waiting=4), lambda m: None)
    for i in range(n):
        full = rng.random() < saturated
        router.add_worker(Worker(f"http://10.0.{i // 256}.{i % 256}:8000", model=MODEL,
                                 ready=True, load=WorkerLoad(
                                     num_running=8, num_waiting=6 if full else 1,
                                     kv_cache_usage=0.5)))
    return router
