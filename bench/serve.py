"""Online serving benchmark: Tandem's worker vs `vllm serve`, side by side in one invocation.

    .venv/bin/python bench/serve.py [--quick] [--servers tandem,vllm]
        [--datasets mixed,shared-system] [--rates 0.5,1,2] [--requests N] [--url NAME=URL ...]

Each server runs alone on the machine (one after another; `bench/servers.py` starts and
stops them), or `--url NAME=URL` benchmarks endpoints that are already running. With
`--rounds R` every server is started at once and each point runs R times, the servers taking
turns back to back (order reversed every other round, so a drifting machine hits both alike);
ratios are the median of the per-round ratios. Against each
server and for each dataset and request rate, `bench/loadgen.py` sends a fresh seeded set of
token-id prompts at Poisson arrival times, streamed, greedy, `ignore_eos`, and records TTFT,
inter-token latency, TPOT and end-to-end latency (p50/p90/p99), output tokens/s and goodput
under an SLO. Every server sees the same prompts at the same offsets.

Server overhead: sequential 1-token completions of a cached prompt; per request the client's
wall time minus the engine time the server reports in its `Server-Timing` header (Tandem's
worker sends it; for other servers only the client latency is reported).

Writes raw JSON and a PNG chart (latency and throughput against request rate) to
`bench/results/serve-<date>.json|png` and prints a table with Tandem/vLLM ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import statistics
import sys
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(1, str(BENCH_DIR / "runners"))

from _common import Timer  # noqa: E402

import loadgen  # noqa: E402
import servers  # noqa: E402
from workload import make_workload  # noqa: E402

# name -> (full, --quick) keyword arguments of workload.make_workload
DATASETS: dict[str, tuple[dict, dict]] = {
    "mixed": (dict(num_requests=40, prompt_len=(16, 512), output_len=(16, 128)),
              dict(num_requests=10, prompt_len=(16, 192), output_len=(8, 32))),
    # 4 groups of users, each group sharing its own 512-token system prompt
    "shared-system": (dict(num_requests=40, shared_prefix_tokens=512, num_prefix_groups=4,
                           prompt_len=(16, 128), output_len=(16, 128)),
                      dict(num_requests=10, shared_prefix_tokens=256, num_prefix_groups=2,
                           prompt_len=(16, 64), output_len=(8, 32))),
}
RATES = ([0.5, 1.0, 2.0], [1.0, 4.0])  # requests / s: (full, --quick)
ONE_TOKEN_PROMPT_LEN = 64
ONE_TOKEN_REPEATS = 30


def dataset(name: str, quick: bool, seed: int, num_requests: int | None = None) -> list:
    kw = dict(DATASETS[name][1 if quick else 0])
    if num_requests:
        kw["num_requests"] = num_requests
    return make_workload(seed=seed, **kw)


def one_token_prompt(seed: int) -> list[int]:
    return make_workload(1, seed=seed, prompt_len=(ONE_TOKEN_PROMPT_LEN,) * 2,
                         output_len=(1, 1))[0].prompt_token_ids


def prepare(url: str, args: argparse.Namespace) -> dict:
    """Warm a running server up and time its 1-token completions; the result skeleton."""
    model = asyncio.run(loadgen.served_model(url))
    warm = dataset("mixed", True, seed=10_000)[:2]  # excluded: first-call work (compiles)
    asyncio.run(loadgen.run_rate(url, model, warm, math.inf, seed=0))
    lat = loadgen.one_token_latency(url, model, one_token_prompt(args.seed), ONE_TOKEN_REPEATS)
    return {"model": model, "one_token": asdict(lat), "runs": {}}


def run_one(name: str, url: str, model: str, ds: str, i: int, rate: float,
            args: argparse.Namespace, round_: int = 0) -> dict:
    """One dataset at one rate against one server: the summary with raw per-request rows.
    Every (rate, round) gets its own prompts, so no run finds the last one's in the cache."""
    reqs = dataset(ds, args.quick, seed=args.seed + 1000 * (i + 1) + 100_000 * round_,
                   num_requests=args.requests)
    slo = loadgen.SLO(args.slo_ttft, args.slo_tpot)
    with Timer() as timer:
        results = asyncio.run(loadgen.run_rate(url, model, reqs, rate, seed=args.seed + i))
    summary = loadgen.summarize(rate, results, slo).to_json()
    summary.update(timer.contention())
    # raw per-request rows: [prompt tokens, max tokens, sent at, ttft, e2e, ok]
    summary["requests"] = [[r.prompt_tokens, r.max_tokens, round(r.sent_at, 4),
                            r.ttft and round(r.ttft, 4), r.e2e and round(r.e2e, 4),
                            r.ok] for r in results]
    print(f"[{name}] {ds} rate={rate}: {summary['completed']}/{len(reqs)} ok, "
          f"ttft p50 {summary['ttft']['p50']:.3f}s, "
          f"{summary['output_throughput']:.1f} tok/s", file=sys.stderr, flush=True)
    return summary


def bench_server(name: str, url: str, args: argparse.Namespace) -> dict:
    """Every dataset x rate against one running server."""
    out = prepare(url, args)
    for ds in args.datasets:
        out["runs"][ds] = [run_one(name, url, out["model"], ds, i, rate, args)
                           for i, rate in enumerate(args.rates)]
    return out


def bench_interleaved(urls: dict[str, str], args: argparse.Namespace) -> dict:
    """Every server running at once, idle but for the one under load: per dataset and rate,
    `args.rounds` rounds, each running the same (fresh) requests against every server back to back
    (order reversed every other round), so slow drift of a shared machine hits both sides
    of each pair alike. Each entry is the round with the median TTFT p50 (odd rounds),
    plus `rounds`: every round's headline numbers."""
    out = {name: prepare(url, args) for name, url in urls.items()}
    names = list(urls)
    for ds in args.datasets:
        for name in names:
            out[name]["runs"][ds] = []
        for i, rate in enumerate(args.rates):
            per: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    per[name].append(run_one(name, urls[name], out[name]["model"], ds, i,
                                             rate, args, round_=r))
            for name in names:
                rounds = per[name]
                median = sorted(rounds, key=lambda x: x["ttft"]["p50"])[len(rounds) // 2]
                median["rounds"] = [{"ttft_p50": x["ttft"]["p50"], "tpot_p50": x["tpot"]["p50"],
                                     "output_throughput": x["output_throughput"],
                                     "completed": x["completed"]} for x in rounds]
                out[name]["runs"][ds].append(median)
    return out


def ratios(res: dict) -> dict:
    """Per dataset and rate: vLLM TTFT p50 / Tandem's (>1: Tandem faster) and Tandem output
    tokens/s / vLLM's (>1: Tandem more)."""
    t, v = res.get("tandem"), res.get("vllm")
    if not t or not v:
        return {}
    out: dict = {}
    for ds, truns in t["runs"].items():
        out[ds] = []
        for a, b in zip(truns, v["runs"][ds], strict=True):
            ra, rb = a.get("rounds"), b.get("rounds")
            if ra and rb:  # interleaved: the median of each round's own ratio
                ttft = [y["ttft_p50"] / x["ttft_p50"] for x, y in zip(ra, rb, strict=True)]
                tput = [x["output_throughput"] / y["output_throughput"]
                        for x, y in zip(ra, rb, strict=True)]
                out[ds].append({"rate": a["rate"], "rounds": len(ra),
                                "ttft_p50_vllm_over_tandem": statistics.median(ttft),
                                "throughput_tandem_over_vllm": statistics.median(tput),
                                "ttft_p50_vllm_over_tandem_per_round": ttft,
                                "throughput_tandem_over_vllm_per_round": tput})
            else:
                out[ds].append({"rate": a["rate"],
                                "ttft_p50_vllm_over_tandem": b["ttft"]["p50"] / a["ttft"]["p50"],
                                "throughput_tandem_over_vllm":
                                    a["output_throughput"] / b["output_throughput"]})
    return out


def print_table(res: dict, rat: dict) -> None:
    hdr = (f"{'dataset':14} {'rate':>5} {'server':7} {'ok':>5} {'ttft p50':>9} {'p90':>7} "
           f"{'p99':>7} {'itl p50':>8} {'tpot p50':>8} {'e2e p50':>8} {'tok/s':>7} "
           f"{'goodput':>7}")
    print(hdr)
    for ds in next(iter(res.values()))["runs"]:
        for i, rate in enumerate(r["rate"] for r in next(iter(res.values()))["runs"][ds]):
            for name, sr in res.items():
                s = sr["runs"][ds][i]
                print(f"{ds:14} {rate!s:>5} {name:7} {s['completed']:>2}/{s['num_requests']:<2} "
                      f"{s['ttft']['p50']:9.3f} {s['ttft']['p90']:7.3f} {s['ttft']['p99']:7.3f} "
                      f"{s['itl']['p50']:8.3f} {s['tpot']['p50']:8.3f} {s['e2e']['p50']:8.2f} "
                      f"{s['output_throughput']:7.1f} {s['goodput']:7.2f}")
            if ds in rat:
                r = rat[ds][i]
                print(f"{'':14} {'':5} ratio   TTFT p50 vLLM/Tandem "
                      f"{r['ttft_p50_vllm_over_tandem']:.2f}x, throughput Tandem/vLLM "
                      f"{r['throughput_tandem_over_vllm']:.2f}x")
    for name, sr in res.items():
        one = sr["one_token"]
        line = (f"1-token completion of a cached prompt, {name}: client p50 "
                f"{one['client']['p50'] * 1e3:.1f} ms")
        if one["overhead"]:
            line += (f", engine p50 {one['engine']['p50'] * 1e3:.1f} ms, server overhead p50 "
                     f"{one['overhead']['p50'] * 1e3:.2f} ms")
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--servers", default="tandem,vllm")
    ap.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                    help="benchmark a running endpoint instead of starting servers")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated; inf = burst")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per rate (default: the dataset's, 40; 10 with --quick); "
                         "more requests dilute the cold start and the step-alignment luck")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: start every server at once and run each point this many "
                         "times, alternating servers (ABBA...); ratios are per-round medians")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO, seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.25, help="goodput SLO, seconds")
    ap.add_argument("--tandem-args", default="", help="extra `tandem worker` arguments")
    ap.add_argument("--out", default=None, help="JSON path (the PNG goes next to it)")
    args = ap.parse_args(argv)
    args.datasets = [d for d in args.datasets.split(",") if d]
    unknown = set(args.datasets) - set(DATASETS)
    if unknown:
        ap.error(f"unknown datasets {sorted(unknown)}; choose from {list(DATASETS)}")
    args.rates = ([float(r) for r in args.rates.split(",")] if args.rates
                  else RATES[1 if args.quick else 0])

    from offline_throughput import machine_info

    results: dict = {}
    specs = {}
    for name in [] if args.url else args.servers.split(","):
        if name == "vllm" and not servers.vllm_available():
            print("[vllm] skipped: run bench/setup_vllm.sh first", file=sys.stderr)
            continue
        specs[name] = (servers.tandem_spec(args.tandem_args.split()) if name == "tandem"
                       else servers.vllm_spec())
    if args.url:
        urls = {name: url.rstrip("/") for name, _, url in
                (item.partition("=") for item in args.url)}
        if args.rounds > 1:
            results = bench_interleaved(urls, args)
        else:
            results = {name: bench_server(name, url, args) for name, url in urls.items()}
    elif args.rounds > 1:
        with ExitStack() as stack:
            urls = {name: stack.enter_context(servers.launched(spec))
                    for name, spec in specs.items()}
            results = bench_interleaved(urls, args)
    else:
        for name, spec in specs.items():
            with servers.launched(spec) as url:
                results[name] = bench_server(name, url, args)
    report: dict = {"benchmark": "serve", "date": dt.date.today().isoformat(),
                    "machine": machine_info(), "quick": args.quick, "seed": args.seed,
                    "rates": args.rates, "rounds": args.rounds, "slo": {"ttft_s": args.slo_ttft,
                                                 "tpot_s": args.slo_tpot},
                    "datasets": {d: {**DATASETS[d][1 if args.quick else 0],
                                     **({"num_requests": args.requests} if args.requests
                                        else {})} for d in args.datasets},
                    "servers": results, "ratios": ratios(results)}
    print_table(results, report["ratios"])
    suffix = "-quick" if args.quick else ""
    out = Path(args.out or BENCH_DIR / "results" / f"serve{suffix}-{report['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    from serve_chart import plot

    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(s["completed"] == s["num_requests"] for r in results.values()
                    for runs in r["runs"].values() for s in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
