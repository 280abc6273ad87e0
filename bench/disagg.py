"""Disaggregated vs aggregated serving on the same two cores, in one run, at one or more loads.

    .venv/bin/python bench/disagg.py [--quick] [--loads S:L,...] [--duration SECONDS]
        [--pd-threshold T] [--pd-max-prefill-queue N] [--seed N] [--setups A,B,...]

Both setups get one CPU core per worker (`taskset`, one engine thread each), standing in for
two machines, and a `tandem router` in front:

* aggregated: two `--role both` workers (core 0, core 1), cache-aware routing;
* disaggregated: a `--role prefill` worker on core 0 and a `--role decode` worker on core 1;
  the router sends every prompt whose uncached part reaches `--pd-threshold` tokens (default
  16, the product's) through the prefill worker (KV pages over gRPC), shorter ones straight
  to the decode worker;
* disaggregated-fcfs (only when `--setups` names it): the same, with the prefill worker's
  per-request chunk cap off (`--long-prefill-token-threshold 0`), so prompts queue there
  first come, first served: what the cap buys short prompts behind long ones;
  disaggregated-capN: the same with a cap of N tokens instead of the default;
  disaggregated-qN: the default prefill worker, and the router's conditional
  disaggregation at N (`--pd-max-prefill-queue N`: while the prefill worker holds N
  requests, prompts lacking at most `--pd-max-local-prefill` tokens prefill on the decode
  worker instead of queueing).

Those P/D setups use the threshold rule (`--pd-decision threshold`); two more decide per
request:

* adaptive: the router's default, the cost decision (`--pd-decision cost`) with its stall
  budget: the prefill worker only when its backlog, the prompt's prefill there and the page
  transfer beat prefilling on the decode worker plus the stall that costs its running
  streams, and a local prefill only while the decode worker's steps stalled by them stay
  within the budget;
* adaptive-wN: the same with the stall weighted N times (`--pd-itl-weight N`, default 1);
  adaptive-bS: with the stall budget S (`--pd-stall-budget S`, a share such as 0.005; 0:
  none);
  adaptive-pcapN / adaptive-dcapN: the same with the prefill / decode worker's per-request
  chunk cap at N tokens (`--long-prefill-token-threshold N`; a decode worker's cap bounds
  how long a local prefill stalls each decode step); suffixes combine in that order
  (adaptive-w2-b0.01-pcap64-dcap32);
* dynamo: NVIDIA Dynamo's conditional disaggregation as the baseline: remote only when the
  uncached prompt reaches `DYNAMO_MAX_LOCAL` tokens and the prefill worker holds fewer than
  `DYNAMO_MAX_QUEUE` requests, else local (`--pd-threshold 1000 --pd-max-prefill-queue 2
  --pd-max-local-prefill 0`, Dynamo's defaults).

The workload mixes short chat-like requests (64-token prompts, 64 output tokens) with long
prompts (1,536 tokens, 4 output tokens) arriving while the short ones decode: two
independent Poisson streams over `--duration` seconds, at `S` short and `L` long requests
per second for each load `S:L` of `--loads`; seeded, the same schedule for both setups.
Reports inter-token latency p50/p99 and TTFT p50/p99 for each class, and for each P/D setup
the short requests' ITL p99 and TTFT p50 over aggregated's at each load. Targets: ITL p99 at
most 0.5x at the busiest load, TTFT p50 at most 2x at the lightest.
The short class's tail is reported too: p99.9, max, and the stalls (gaps over `STALL_S`)
with their total seconds, which a p99 over a few thousand gaps can miss.
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
import re
import sys
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from loadgen import percentiles, run_rate  # noqa: E402
from servers import ServerSpec, free_port, launched, worker_auth_key  # noqa: E402
from workload import BenchRequest  # noqa: E402

TARGET_ITL_P99_RATIO = 0.5  # short ITL p99, P/D / aggregated, at the busiest load
TARGET_TTFT_P50_RATIO = 2.0  # short TTFT p50, P/D / aggregated, at the lightest load
DYNAMO_MAX_LOCAL = 1000  # Dynamo's max_local_prefill_length
DYNAMO_MAX_QUEUE = 2  # Dynamo's max_prefill_queue_size
STALL_S = 1.0  # an inter-token gap longer than this is a stall
SHORT = (64, 64)  # prompt tokens, output tokens
LONG = (1536, 4)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def workload(short_rate: float, long_rate: float, duration: float, seed: int
             ) -> tuple[list[tuple[str, BenchRequest]], list[float]]:
    """Short and long requests arriving as two Poisson streams over `duration` seconds:
    (class, request) pairs and their arrival offsets (s), in arrival order."""
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    arrivals: list[tuple[float, str]] = []
    for cls, rate in (("short", short_rate), ("long", long_rate)):
        t = 0.0
        while rate > 0:
            t += float(gen.exponential(1.0 / rate))
            if t >= duration:
                break
            arrivals.append((t, cls))
    arrivals.sort()
    reqs = [(cls, BenchRequest(ids(SHORT[0] if cls == "short" else LONG[0]),
                               SHORT[1] if cls == "short" else LONG[1]))
            for _, cls in arrivals]
    return reqs, [t for t, _ in arrivals]


def cli(command: str, *args: str) -> list[str]:
    """`tandem COMMAND ARGS` with the run's worker-auth key (the router signs, workers
    check: without it the router would keep every request aggregated)."""
    return [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", command,
            "--worker-auth-key-file", worker_auth_key()[0], *args]


def worker(name: str, core: int, role: str, grpc_port: int | None,
           extra: tuple[str, ...] = ()) -> ServerSpec:
    argv = ["taskset", "-c", str(core), *cli(
        "worker", "--port", "{port}", "--role", role, "--num-threads", "1",
        "--num-kv-blocks", "1024", "--max-num-batched-tokens", "2048", *extra)]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]
    return ServerSpec(f"disagg-{name}", argv, {"PYTHONPATH": str(REPO / "src")})


def router(name: str, urls: list[str], extra: list[str]) -> ServerSpec:
    return ServerSpec(f"disagg-router-{name}", cli("router", "--port", "{port}", "--workers",
                                                   ",".join(urls), "--seed", "0", *extra),
                      {"PYTHONPATH": str(REPO / "src")})


def run_setup(name: str, reqs: list[tuple[str, BenchRequest]], offsets: list[float],
              seed: int, pd_threshold: int, pd_max_prefill_queue: int = 0) -> dict:
    from tandem.protocol.bundled import BUNDLED_NAME

    cores = sorted(os.sched_getaffinity(0))
    c0, c1 = cores[0], cores[-1]
    load_before = os.getloadavg()[0]  # other processes on the cores make a run noisy
    with contextlib.ExitStack() as stack:
        if name == "aggregated":
            urls = [stack.enter_context(launched(worker("both0", c0, "both", free_port()))),
                    stack.enter_context(launched(worker("both1", c1, "both", free_port())))]
            extra = ["--pd-threshold", str(pd_threshold)]
        else:
            cap = prefill_flags(name) or ()
            urls = [stack.enter_context(launched(worker("prefill", c0, "prefill",
                                                        free_port(), cap))),
                    stack.enter_context(launched(worker("decode", c1, "decode", free_port(),
                                                        decode_flags(name))))]
            extra = router_flags(name, pd_threshold, pd_max_prefill_queue)
        url = stack.enter_context(launched(router(name, urls, extra)))
        results = asyncio.run(run_rate(url, BUNDLED_NAME, [r for _, r in reqs], 1.0, seed,
                                       offsets=offsets))
        routed = pd_counts(url)
    out: dict = {"setup": name, "routed": routed,
                 "loadavg_1m": [load_before, os.getloadavg()[0]], "by_class": {}}
    log(f"[{name}] routed: {routed}")
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


def pd_counts(url: str) -> dict[str, float]:
    """The router's P/D decisions so far, from its /metrics: "disaggregated" and
    "aggregated:<reason>" -> requests."""
    import httpx

    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for m in re.finditer(r'^tandem_router_(dis)?aggregated_requests_total\{(?:backend|reason)='
                         r'"([^"]*)"\} ([0-9.e+]+)$', text, re.M):
        key = "disaggregated" if m[1] else f"aggregated:{m[2]}"
        out[key] = out.get(key, 0.0) + float(m[3])
    return out


def ratios(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Each P/D setup's short-class ITL p99 and TTFT p50 over aggregated's (no aggregated
    run, or a zero: none)."""
    by = {r["setup"]: r["by_class"]["short"] for r in runs}
    agg = by.get("aggregated")
    if not agg or not agg["itl"]["p99"] or not agg["ttft"]["p50"]:
        return {}
    return {name: {"short_itl_p99": st["itl"]["p99"] / agg["itl"]["p99"],
                   "short_ttft_p50": st["ttft"]["p50"] / agg["ttft"]["p50"]}
            for name, st in by.items() if name != "aggregated"}


def tail(gaps: list[float]) -> dict:
    """The inter-token gaps' tail, which a p99 over a few thousand gaps can miss: p99.9,
    max, and the stalls (gaps over `STALL_S`): how many and their total seconds."""
    if not gaps:
        return {"gaps": 0}
    a = np.asarray(gaps, dtype=np.float64)
    stalls = a[a > STALL_S]
    return {"gaps": int(a.size), "p99_9": float(np.percentile(a, 99.9)), "max": float(a.max()),
            "stalls": int(stalls.size), "stall_s": float(stalls.sum())}


SETUPS = ("aggregated", "disaggregated", "adaptive", "adaptive[-wN][-bS][-pcapN][-dcapN]", "dynamo",
          "disaggregated-fcfs", "disaggregated-capN", "disaggregated-qN")
ADAPTIVE = re.compile(r"adaptive(?:-w([0-9]{1,3}(?:\.[0-9]{1,3})?))?(?:-b(0|0\.[0-9]{1,4}))?"
                      r"(?:-pcap([1-9][0-9]{0,4}))?(?:-dcap([1-9][0-9]{0,4}))?")


def router_flags(setup: str, pd_threshold: int, pd_max_prefill_queue: int) -> list[str]:
    """The router's P/D flags in P/D setup `setup` (the run's threshold and queue bound
    unless the setup names its own)."""
    m = ADAPTIVE.fullmatch(setup)
    if m:
        return ["--pd-decision", "cost", "--pd-threshold", str(pd_threshold),
                "--pd-max-prefill-queue", str(pd_max_prefill_queue),
                *(["--pd-itl-weight", m[1]] if m[1] else []),
                *(["--pd-stall-budget", m[2]] if m[2] else [])]
    if setup == "dynamo":
        return ["--pd-decision", "threshold", "--pd-threshold", str(DYNAMO_MAX_LOCAL),
                "--pd-max-prefill-queue", str(DYNAMO_MAX_QUEUE), "--pd-max-local-prefill", "0"]
    queue = router_queue(setup)
    return ["--pd-decision", "threshold", "--pd-threshold", str(pd_threshold),
            "--pd-max-prefill-queue", str(pd_max_prefill_queue if queue is None else queue)]


def router_queue(setup: str) -> int | None:
    """disaggregated-qN: the router's `--pd-max-prefill-queue` N; None: the run's own."""
    m = re.fullmatch(r"disaggregated-q([1-9][0-9]{0,3})", setup)
    return int(m[1]) if m else None


def prefill_flags(setup: str) -> tuple[str, ...] | None:
    """The prefill worker's extra flags in `setup` (None: not a setup): disaggregated-fcfs
    turns its per-request chunk cap off, disaggregated-capN sets it to N tokens."""
    m = ADAPTIVE.fullmatch(setup)
    if m:
        return ("--long-prefill-token-threshold", m[3]) if m[3] else ()
    if setup in ("aggregated", "disaggregated", "dynamo") or router_queue(setup) is not None:
        return ()
    if setup == "disaggregated-fcfs":
        return ("--long-prefill-token-threshold", "0")
    m = re.fullmatch(r"disaggregated-cap([1-9][0-9]{0,5})", setup)
    return ("--long-prefill-token-threshold", m[1]) if m else None


def decode_flags(setup: str) -> tuple[str, ...]:
    """The decode worker's extra flags in `setup`: adaptive-dcapN caps its per-request
    chunk at N tokens."""
    m = ADAPTIVE.fullmatch(setup)
    return ("--long-prefill-token-threshold", m[4]) if m and m[4] else ()


def parse_setups(text: str) -> list[str]:
    """"aggregated,disaggregated" -> the setups to run, in order; argparse's `type`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if prefill_flags(n) is None]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"setups are {', '.join(SETUPS)}; got {text!r}")
    return names


def parse_loads(text: str) -> list[tuple[float, float]]:
    """"S:L,S:L" -> [(short req/s, long req/s), ...]; argparse's `type`."""
    out = []
    for item in text.split(","):
        short, _, long = item.partition(":")
        try:
            rates = (float(short), float(long))
        except ValueError:
            rates = (-1.0, -1.0)
        if min(rates) < 0 or max(rates) <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} is not SHORT:LONG requests per second")
        out.append(rates)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one light load, 20 s")
    ap.add_argument("--loads", type=parse_loads, default="0.64:0.16,2.4:0.1",
                    help="short:long request rates per second, comma-separated (default: "
                         "0.64:0.16, a light mix; 2.4:0.1, busier chat traffic)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--pd-threshold", type=int, default=16)
    ap.add_argument("--pd-max-prefill-queue", type=int, default=0,
                    help="the router's conditional-disaggregation bound (default 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setups", type=parse_setups, default="aggregated,disaggregated",
                    help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    loads = [(0.64, 0.16)] if args.quick else args.loads
    duration = 20.0 if args.quick else args.duration
    report: dict = {"benchmark": "disagg", "date": dt.date.today().isoformat(),
                    "quick": args.quick, "duration_s": duration, "seed": args.seed,
                    "pd_threshold": args.pd_threshold,
                    "pd_max_prefill_queue": args.pd_max_prefill_queue,
                    "short": {"prompt_tokens": SHORT[0], "max_tokens": SHORT[1]},
                    "long": {"prompt_tokens": LONG[0], "max_tokens": LONG[1]},
                    "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                "platform": platform.platform()},
                    "loads": []}
    for short_rate, long_rate in loads:
        reqs, offsets = workload(short_rate, long_rate, duration, args.seed)
        counts = {cls: sum(c == cls for c, _ in reqs) for cls in ("short", "long")}
        log(f"load {short_rate:g} short/s + {long_rate:g} long/s: {counts['short']} short, "
            f"{counts['long']} long over {duration:g} s")
        load: dict = {"short_rate": short_rate, "long_rate": long_rate, "requests": counts,
                      "runs": []}
        for name in args.setups:
            load["runs"].append(run_setup(name, reqs, offsets, args.seed, args.pd_threshold,
                                          args.pd_max_prefill_queue))
        load["ratios"] = ratios(load["runs"])
        dis = load["ratios"].get("disaggregated")
        load["short_itl_p99_ratio"] = dis["short_itl_p99"] if dis else None
        report["loads"].append(load)
    out = Path(args.out) if args.out else BENCH_DIR / "results" / (
        f"disagg{'-quick' if args.quick else ''}-{report['date']}.json")
    out.write_text(json.dumps(report, indent=1))
    for load in report["loads"]:
        print(f"\nload: {load['short_rate']:g} short/s + {load['long_rate']:g} long/s "
              f"({load['requests']['short']} short, {load['requests']['long']} long)")
        print(f"{'setup':14s} {'class':6s} {'ttft p50':>9s} {'ttft p99':>9s} {'itl p50':>8s} "
              f"{'itl p99':>8s}")
        for r in load["runs"]:
            for cls, st in r["by_class"].items():
                print(f"{r['setup']:14s} {cls:6s} {st['ttft']['p50']:9.3f} "
                      f"{st['ttft']['p99']:9.3f} {st['itl']['p50']:8.3f} {st['itl']['p99']:8.3f}")
        for r in load["runs"]:
            t = r["by_class"]["short"]["itl_tail"]
            if t["gaps"]:
                print(f"{r['setup']}: short gaps {t['gaps']}, p99.9 {t['p99_9']:.3f} s, max "
                      f"{t['max']:.3f} s, stalls over {STALL_S:g} s: {t['stalls']} "
                      f"({t['stall_s']:.1f} s)")
    lightest = min(report["loads"], key=lambda x: x["short_rate"] + x["long_rate"])
    busiest = max(report["loads"], key=lambda x: x["short_rate"] + x["long_rate"])
    for load in report["loads"]:
        for setup, r in load["ratios"].items():
            marks = []
            if load is busiest:
                ok = r["short_itl_p99"] <= TARGET_ITL_P99_RATIO
                marks.append(f"ITL target <= {TARGET_ITL_P99_RATIO}: {'met' if ok else 'MISSED'}")
            if load is lightest:
                ok = r["short_ttft_p50"] <= TARGET_TTFT_P50_RATIO
                marks.append(f"TTFT target <= {TARGET_TTFT_P50_RATIO}: "
                             f"{'met' if ok else 'MISSED'}")
            print(f"load {load['short_rate']:g}:{load['long_rate']:g} {setup} / aggregated: "
                  f"short ITL p99 {r['short_itl_p99']:.2f}x, TTFT p50 "
                  f"{r['short_ttft_p50']:.2f}x ({'; '.join(marks) or 'no target here'})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
