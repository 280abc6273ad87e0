"""Disaggregated vs aggregated serving on the same two cores, in one run.

    .venv/bin/python bench/disagg.py [--quick] [--rate R] [--pd-threshold T]
        [--pd-max-prefill-queue N]

Both setups get one CPU core per worker (`taskset`, one engine thread each), standing in for
two machines, and a `tandem router` in front:

* aggregated: two `--role both` workers (core 0, core 1), cache-aware routing;
* disaggregated: a `--role prefill` worker on core 0 and a `--role decode` worker on core 1;
  the router sends every prompt whose uncached part reaches `--pd-threshold` tokens through
  the prefill worker (KV pages over gRPC), shorter ones straight to the decode worker.

The workload mixes short chat-like requests (64-token prompts, 64 output tokens) with long
prompts (1,536 tokens, 4 output tokens) arriving while the short ones decode; Poisson
arrivals, seeded, the same schedule for both setups. Reports inter-token latency p50/p99 and
TTFT p50/p99 for each class, and the ratio of the short requests' ITL p99 (disaggregated /
aggregated). Target: at most 0.5. With a few long prompts among thousands of short-request
gaps the stalls they cause may stay under the 99th percentile, so the short class's tail is
reported too: p99.9, max, and the stalls (gaps over `STALL_S`) with their total seconds.
Writes `bench/results/disagg[-quick]-<date>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import sys
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from loadgen import percentiles, run_rate  # noqa: E402
from servers import ServerSpec, free_port, launched  # noqa: E402
from workload import BenchRequest  # noqa: E402

TARGET_ITL_P99_RATIO = 0.5
STALL_S = 1.0  # an inter-token gap longer than this is a stall
SHORT = (64, 64)  # prompt tokens, output tokens
LONG = (1536, 4)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def workload(n_short: int, n_long: int, seed: int) -> list[tuple[str, BenchRequest]]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    reqs = ([("short", BenchRequest(ids(SHORT[0]), SHORT[1])) for _ in range(n_short)]
            + [("long", BenchRequest(ids(LONG[0]), LONG[1])) for _ in range(n_long)])
    rng.shuffle(reqs)
    return reqs


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", *args]


def worker(name: str, core: int, role: str, grpc_port: int | None) -> ServerSpec:
    argv = ["taskset", "-c", str(core), *cli(
        "worker", "--port", "{port}", "--role", role, "--num-threads", "1",
        "--num-kv-blocks", "1024", "--max-num-batched-tokens", "2048")]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]
    return ServerSpec(f"disagg-{name}", argv, {"PYTHONPATH": str(REPO / "src")})


def router(name: str, urls: list[str], extra: list[str]) -> ServerSpec:
    return ServerSpec(f"disagg-router-{name}", cli("router", "--port", "{port}", "--workers",
                                                   ",".join(urls), "--seed", "0", *extra),
                      {"PYTHONPATH": str(REPO / "src")})


def run_setup(name: str, reqs: list[tuple[str, BenchRequest]], rate: float, seed: int,
              pd_threshold: int, pd_max_prefill_queue: int = 0) -> dict:
    from tandem.protocol.bundled import BUNDLED_NAME

    cores = sorted(os.sched_getaffinity(0))
    c0, c1 = cores[0], cores[-1]
    with contextlib.ExitStack() as stack:
        if name == "aggregated":
            urls = [stack.enter_context(launched(worker("both0", c0, "both", free_port()))),
                    stack.enter_context(launched(worker("both1", c1, "both", free_port())))]
            extra = ["--pd-threshold", str(pd_threshold)]
        else:
            urls = [stack.enter_context(launched(worker("prefill", c0, "prefill",
                                                        free_port()))),
                    stack.enter_context(launched(worker("decode", c1, "decode", free_port())))]
            extra = ["--pd-threshold", str(pd_threshold),
                     "--pd-max-prefill-queue", str(pd_max_prefill_queue)]
        url = stack.enter_context(launched(router(name, urls, extra)))
        results = asyncio.run(run_rate(url, BUNDLED_NAME, [r for _, r in reqs], rate, seed))
    out: dict = {"setup": name, "by_class": {}}
    for cls in ("short", "long"):
        rs = [res for (c, _), res in zip(reqs, results, strict=True) if c == cls]
        ok = [r for r in rs if r.ok]
        out["by_class"][cls] = {
            "requests": len(rs), "ok": len(ok),
            "errors": sorted({r.error for r in rs if r.error})[:5],
            "ttft": percentiles([r.ttft for r in ok]),
            "itl": percentiles([g for r in ok for g in r.itl]),
            "itl_tail": tail([g for r in ok for g in r.itl]),
            "e2e": percentiles([r.e2e for r in ok])}
        s = out["by_class"][cls]
        log(f"[{name}] {cls}: {len(ok)}/{len(rs)} ok, ttft p50 {s['ttft']['p50']:.3f}s "
            f"p99 {s['ttft']['p99']:.3f}s, itl p50 {s['itl']['p50'] * 1e3:.0f} ms "
            f"p99 {s['itl']['p99'] * 1e3:.0f} ms")
    return out


def tail(gaps: list[float]) -> dict:
    """The inter-token gaps' tail, which a p99 over a few thousand gaps can miss: p99.9,
    max, and the stalls (gaps over `STALL_S`): how many and their total seconds."""
    if not gaps:
        return {"gaps": 0}
    a = np.asarray(gaps, dtype=np.float64)
    stalls = a[a > STALL_S]
    return {"gaps": int(a.size), "p99_9": float(np.percentile(a, 99.9)), "max": float(a.max()),
            "stalls": int(stalls.size), "stall_s": float(stalls.sum())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default 0.8)")
    ap.add_argument("--pd-threshold", type=int, default=256)
    ap.add_argument("--pd-max-prefill-queue", type=int, default=0,
                    help="the router's conditional-disaggregation bound (default 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n_short, n_long = (12, 3) if args.quick else (40, 10)
    rate = args.rate or 0.8
    reqs = workload(n_short, n_long, args.seed)
    report: dict = {"benchmark": "disagg", "date": dt.date.today().isoformat(),
                    "quick": args.quick, "rate": rate, "pd_threshold": args.pd_threshold,
                    "pd_max_prefill_queue": args.pd_max_prefill_queue,
                    "short": {"prompt_tokens": SHORT[0], "max_tokens": SHORT[1],
                              "requests": n_short},
                    "long": {"prompt_tokens": LONG[0], "max_tokens": LONG[1],
                             "requests": n_long},
                    "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                "platform": platform.platform()},
                    "runs": []}
    for name in ("aggregated", "disaggregated"):
        report["runs"].append(run_setup(name, reqs, rate, args.seed, args.pd_threshold,
                                        args.pd_max_prefill_queue))
    agg, dis = (r["by_class"]["short"]["itl"]["p99"] for r in report["runs"])
    report["short_itl_p99_ratio"] = dis / agg if agg else None
    out = Path(args.out) if args.out else BENCH_DIR / "results" / (
        f"disagg{'-quick' if args.quick else ''}-{report['date']}.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"\n{'setup':14s} {'class':6s} {'ttft p50':>9s} {'ttft p99':>9s} {'itl p50':>8s} "
          f"{'itl p99':>8s}")
    for r in report["runs"]:
        for cls, s in r["by_class"].items():
            print(f"{r['setup']:14s} {cls:6s} {s['ttft']['p50']:9.3f} {s['ttft']['p99']:9.3f} "
                  f"{s['itl']['p50']:8.3f} {s['itl']['p99']:8.3f}")
    for r in report["runs"]:
        t = r["by_class"]["short"]["itl_tail"]
        if t["gaps"]:
            print(f"{r['setup']}: short gaps {t['gaps']}, p99.9 {t['p99_9']:.3f} s, max "
                  f"{t['max']:.3f} s, stalls over {STALL_S:g} s: {t['stalls']} "
                  f"({t['stall_s']:.1f} s)")
    ratio = report["short_itl_p99_ratio"]
    if ratio is not None:
        verdict = "met" if ratio <= TARGET_ITL_P99_RATIO else "MISSED"
        print(f"short ITL p99 disaggregated / aggregated: {ratio:.2f} (target <= "
              f"{TARGET_ITL_P99_RATIO}): {verdict}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
