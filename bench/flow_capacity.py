"""Flow control's share of a routing decision at fleet scale: `Router.capacity` (asked by
`FlowControl.acquire` for every request) plus `Router.saturated` (asked by every pick with
flow control on) plus the pick itself (`Router.route`, an empty prefix index), at N workers,
with a given share of them saturated. `--mode scan` times the per-request scan of every
worker that capacity and saturation were answered by before (`sim_fleet`, also the test's
oracle), `--mode book` the maintained answer the router keeps now
(`saturation.SaturationBook`).

    python bench/flow_capacity.py --workers 1000 --saturated 0.9 --json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from tandem.router import prompt as prompts
from tandem.router.workers import WorkerLoad

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_fleet import MODEL, fleet, scan_capacity, scan_saturated  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(n: int, saturated: float, mode: str, decisions: int, seed: int) -> dict:
    rng = random.Random(seed)
    router = fleet(n, saturated, rng)
    cap = (lambda now: scan_capacity(router, MODEL, now)) if mode == "scan" else \
        (lambda now: router.capacity(MODEL, now))
    sat = (lambda: scan_saturated(router, MODEL)) if mode == "scan" else \
        (lambda: router.saturated(MODEL))
    workers = list(router.workers.values())
    flow_s, route_s = [], []
    for d in range(decisions):
        now = 1000.0 + d * 0.001
        w = rng.choice(workers)  # a load report lands between decisions
        w.load = WorkerLoad(num_running=8, num_waiting=w.load.num_waiting,
                            kv_cache_usage=0.5)
        parsed = prompts.parse("completions", {"model": MODEL,
                                               "prompt": [rng.randrange(1000)
                                                          for _ in range(64)]}, None)
        t0 = time.perf_counter()
        cap(now)
        full = sat()
        t1 = time.perf_counter()
        decision, _ = router.route(parsed, MODEL, now, exclude=full)
        t2 = time.perf_counter()
        if decision is not None:
            router.retract(decision, now)
        flow_s.append(t1 - t0)
        route_s.append(t2 - t1)
    ms = 1000.0
    return {"mode": mode, "workers": n, "saturated_share": saturated, "decisions": decisions,
            "flow_p50_ms": statistics.median(flow_s) * ms,
            "flow_p99_ms": pct(flow_s, 0.99) * ms,
            "route_p50_ms": statistics.median(route_s) * ms,
            "route_p99_ms": pct(route_s, 0.99) * ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--saturated", type=float, default=0.9, help="share of workers full")
    ap.add_argument("--mode", choices=("scan", "book", "both"), default="both")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    if a.workers < 1 or a.decisions < 1 or not 0.0 <= a.saturated <= 1.0:
        ap.error("--workers and --decisions must be >= 1, --saturated in [0, 1]")
    modes = ("scan", "book") if a.mode == "both" else (a.mode,)
    results = [run(a.workers, a.saturated, m, a.decisions, a.seed) for m in modes]
    doc = {"bench": "flow_capacity", "python": platform.python_version(),
           "machine": platform.machine(), "results": results}
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        for r in results:
            print(f"{r['mode']:5s} {r['workers']} workers, {r['saturated_share']:.0%} full: "
                  f"flow p50 {r['flow_p50_ms']:.4f} ms p99 {r['flow_p99_ms']:.4f} ms; "
                  f"route p50 {r['route_p50_ms']:.3f} ms p99 {r['route_p99_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
