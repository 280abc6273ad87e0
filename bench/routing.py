"""Routing benchmark: the same shared-prefix workload through the router with each policy.

    .venv/bin/python bench/routing.py [--quick] [--workers 4] [--policies ...] [--rate 2] \\
        [--requests N] [--rounds R] [--router-log-level INFO]

Starts N real Tandem workers (gRPC KV events on, each with a KV budget that holds only a few
groups' prefixes), then for each policy a fresh `tandem router` in front of them, and sends a
seeded shared-prefix workload (G groups x a long system prompt, user turns, Poisson
arrivals) through it with `bench/loadgen.py`. Every policy gets the same prompts at the same
arrival times, each under its own `cache_salt` (part of the workers' block hashes), so no
policy inherits another's warm cache. Reports TTFT p50/p90, output tokens/s and the
cluster prefix-cache hit rate (from the workers' `vllm:prefix_cache_*` counters), the
TTFT p90 ratio of each policy to cache-aware, and writes `bench/results/routing-<date>.json`.
With `--rounds R` every policy runs R times in a rotated order, each round on a new seeded
workload (shared by all policies in that round); the table shows medians over the rounds and
the median of the per-round p90 ratios. A policy may be a variant with its own
router config: `cache-aware@path/router.yaml`.
`vllm-router` (the Rust router of the vLLM project, `cache_aware` policy) runs in front of
the same workers when it is installed (`bash bench/setup_vllm.sh` puts it in
`.venv-vllm-router`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import loadgen  # noqa: E402
import servers  # noqa: E402
from workload import make_workload  # noqa: E402

POLICIES = ("round-robin", "random", "least-loaded", "cache-aware", "cost")


def cluster_counters(urls: list[str]) -> tuple[float, float]:
    """Sum of (prefix_cache_hits, prefix_cache_queries) over the workers, in tokens."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def wait_routable(url: str, workers: int, events: bool, timeout_s: float = 60) -> None:
    """Until the router lists a model and (Tandem's) every worker's KV stream is live."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if httpx.get(url + "/v1/models", timeout=5).json()["data"]:
                if not events:
                    return
                text = httpx.get(url + "/metrics", timeout=5).text
                live = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("tandem_router_worker_kv_events_connected{"))
                if live >= workers:
                    return
        time.sleep(0.2)
    raise TimeoutError(f"{url} never saw all {workers} workers")


def run_policy(name: str, spec: servers.ServerSpec, worker_urls: list[str], reqs: list,
               rate: float, seed: int, salt: str) -> dict:
    with servers.launched(spec) as url:
        wait_routable(url, len(worker_urls), events=name != "vllm-router")
        model = asyncio.run(loadgen.served_model(url))
        h0, q0 = cluster_counters(worker_urls)
        results = asyncio.run(loadgen.run_rate(url, model, reqs, rate, seed=seed,
                                               extra={"cache_salt": salt}))
        h1, q1 = cluster_counters(worker_urls)
    s = loadgen.summarize(rate, results, loadgen.SLO()).to_json()
    s["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    s["policy"] = name
    print(f"[{name}] ttft p50 {s['ttft']['p50']:.3f}s p90 {s['ttft']['p90']:.3f}s, "
          f"{s['output_throughput']:.1f} tok/s, prefix hits {s['prefix_hit_rate']:.1%}",
          file=sys.stderr, flush=True)
    return s


def summarize_rounds(report: dict, rounds: int) -> None:
    """Per policy: the median over rounds of TTFT p50/p90 and prefix hits, and the median of
    the per-round ratios of each policy's TTFT p90 to cache-aware's (same prompts, same
    arrivals, the same round); prints a table."""
    runs = report["runs"]
    names = list(dict.fromkeys(r["policy"] for r in runs))
    summary: dict = {}
    base = {r["round"]: r for r in runs if r["policy"] == "cache-aware"}
    for name in names:
        rs = [r for r in runs if r["policy"] == name]
        summary[name] = {q: statistics.median(r["ttft"][q] for r in rs) for q in ("p50", "p90")}
        summary[name]["prefix_hit_rate"] = statistics.median(r["prefix_hit_rate"] for r in rs)
        summary[name]["output_throughput"] = statistics.median(r["output_throughput"]
                                                               for r in rs)
        ratios = [r["ttft"]["p90"] / base[r["round"]]["ttft"]["p90"] for r in rs
                  if r["round"] in base]
        if ratios:
            summary[name]["ttft_p90_over_cache_aware"] = statistics.median(ratios)
            summary[name]["ttft_p90_over_cache_aware_per_round"] = ratios
    report["rounds"] = rounds
    report["summary"] = summary
    if "cache-aware" in summary:
        report["ttft_p90_over_cache_aware"] = {
            n: v.get("ttft_p90_over_cache_aware") for n, v in summary.items()}
    print(f"{'policy (median of ' + str(rounds) + ' rounds)':34} {'ttft p50':>9} "
          f"{'ttft p90':>9} {'tok/s':>7} {'prefix hits':>12} {'p90 / cache-aware':>18}")
    for name, v in summary.items():
        ratio = v.get("ttft_p90_over_cache_aware", float("nan"))
        print(f"{name:34} {v['p50']:9.3f} {v['p90']:9.3f} {v['output_throughput']:7.1f} "
              f"{v['prefix_hit_rate']:12.1%} {ratio:18.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--rate", type=float, default=None, help="requests/s into the router")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per worker")
    ap.add_argument("--requests", type=int, default=None, help="requests per policy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-log-level", default="WARNING",
                    help="INFO logs every routing decision (bench/.cache/logs)")
    ap.add_argument("--no-vllm-router", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every policy (and vllm-router) this many times, in a "
                         "rotated order, each round under fresh cache salts")
    args = ap.parse_args(argv)
    groups, prefix = (4, 256) if args.quick else (8, 512)
    n_req = args.requests or (24 if args.quick else 64)
    rate = args.rate or (2.0 if args.quick else 1.5)
    kv_blocks = args.kv_blocks or (prefix // 16) * 3 + 48  # ~3 groups' prefixes + headroom
    policies = [p for p in args.policies.split(",") if p]
    # the workers share this host's cores, as `tandem serve --workers N` splits them
    threads = max(1, len(os.sched_getaffinity(0)) // args.workers)

    worker_specs = [servers.ServerSpec(f"routing-worker{i}", [
        *servers.tandem_spec().argv, "--grpc-port", str(servers.free_port()),
        "--num-kv-blocks", str(kv_blocks), "--num-threads", str(threads)],
        env=servers.tandem_spec().env)
        for i in range(args.workers)]
    report: dict = {"benchmark": "routing", "date": dt.date.today().isoformat(),
                    "workers": args.workers, "kv_blocks_per_worker": kv_blocks,
                    "groups": groups, "system_prompt_tokens": prefix, "requests": n_req,
                    "rate": rate, "runs": []}
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(servers.launched(s)) for s in worker_specs]
        # within a round every policy gets the same prompts at the same arrival times, under
        # its own cache_salt (the workers' block hashes include it), so none inherits a warm
        # cache; each round draws a new workload (group sizes, arrivals, lengths)
        run_id = os.urandom(4).hex()
        router_exe = None if args.no_vllm_router else servers.vllm_router_exe()
        if router_exe is None:
            report["vllm_router"] = "not installed (bash bench/setup_vllm.sh); not compared"
        for rnd in range(args.rounds):  # each round: every policy once, a rotated order
            reqs = make_workload(n_req, seed=args.seed + 100 + rnd,
                                 shared_prefix_tokens=prefix, num_prefix_groups=groups,
                                 prompt_len=(16, 64), output_len=(16, 32))
            entries = [*policies, *(["vllm-router"] if router_exe else [])]
            k = rnd % len(entries)
            for policy in entries[k:] + entries[:k]:
                if policy == "vllm-router":
                    spec = servers.ServerSpec("vllm-router", [
                        router_exe, "--port", "{port}", "--worker-urls", *urls,
                        "--policy", "cache_aware", "--prometheus-port",
                        str(servers.free_port())])
                else:
                    name, _, config = policy.partition("@")  # cache-aware@router.yaml
                    tag = f"router-{name}" + (f"-{Path(config).stem}" if config else "")
                    spec = servers.ServerSpec(tag, [
                        sys.executable, "-m", "tandem.cli", "--log-level",
                        args.router_log_level, "router", "--port", "{port}", "--workers",
                        ",".join(urls), "--policy", name, "--seed", str(args.seed),
                        *(["--config", config] if config else [])],
                        env=servers.tandem_spec().env)
                run = run_policy(policy, spec, urls, reqs, rate, args.seed + rnd,
                                 f"{run_id}-{rnd}-{policy}")
                run["round"] = rnd
                report["runs"].append(run)
    summarize_rounds(report, args.rounds)
    suffix = "-quick" if args.quick else ""
    out = (Path(args.out) if args.out
           else BENCH_DIR / "results" / f"routing{suffix}-{report['date']}.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
