"""Which share of engine steps (and of step time) runs eagerly rather than from the decode
graphs, and why, under the serving benchmark's arrivals.

    .venv/bin/python bench/graph_share.py [--rates 0.5,1,2] [--requests 16] [--quick]

One `tandem worker` on the bundled model receives `bench/serve.py`'s `mixed` dataset (its
seeded prompts, via `bench/loadgen.py`'s seeded Poisson arrivals, streamed, greedy,
`ignore_eos`) at each rate in turn, after two unrecorded warm-up requests. Before and after
each rate the bench reads the worker's `tandem_engine_steps_total` and
`tandem_engine_step_seconds_total{path, reason}` from /metrics; the differences are the
rate's steps and runner seconds by path (graph / eager) and reason.

Decode graphs exist only on CUDA (or, with TANDEM_STATIC_DECODE=1, with the triton backend,
which runs on the CPU only under Triton's interpreter). So that a CPU worker decides every
step as a GPU worker would, the worker this bench starts gets decode graphs of the default
sizes whose replay is the eager forward (`EagerGraphs`): the step counts by reason are
exactly the GPU's for the same schedule; the seconds are this CPU's (a graph step's time is
its eager time here), so the time shares say how much of the compute mixed and other eager
steps take, not what graphs would save.

JSON: bench/results/graph_share-<date>.json (per rate: the load summary, steps and seconds
by path and reason, eager shares).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime as dt
import json
import math
import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(1, str(BENCH_DIR / "runners"))

AS_WORKER = "--as-worker"


class EagerGraphs:
    """Stands in for `DecodeGraphRunner` on a backend without graphs: the same sizes and
    `padded_size` (so the model runner makes the same per-step decision), and `run` is the
    eager forward of the decode batch."""

    def __init__(self, model, backend, kv_caches, sizes: tuple[int, ...]) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = tuple(sorted(set(sizes)))
        self.graphs: dict = {}

    def padded_size(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids, positions, layout):
        import torch

        meta = self.backend.build_metadata(layout)
        rows = torch.arange(len(layout.seq_lens), device=input_ids.device)
        return self.model(input_ids, positions, self.kv_caches, meta, rows)


def serve_worker(argv: list[str]) -> int:
    """`tandem.cli` with `EagerGraphs` of the default sizes in place of decode graphs."""
    from tandem.cli import main
    from tandem.engine import llm_engine
    from tandem.engine.cuda_graphs import default_graph_sizes

    def build(config, model, backend, kv_caches, max_model_len, device):
        if config.enforce_eager:
            return None
        sizes = config.cuda_graph_sizes or default_graph_sizes(config.max_num_seqs)
        return EagerGraphs(model, backend, kv_caches, sizes)

    llm_engine.build_decode_graphs = build
    return main(argv) or 0


def read_paths(url: str) -> dict[tuple[str, str], dict[str, float]]:
    """(path, reason) -> {"steps", "seconds"} from the worker's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], dict[str, float]] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        key = {"tandem_engine_steps": "steps", "tandem_engine_step_seconds": "seconds"}.get(
            fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                cell = out.setdefault((s.labels["path"], s.labels["reason"]), {})
                cell[key] = s.value
    return out


def shares(before: dict, after: dict) -> dict:
    """One rate's steps and seconds by path and reason, and the eager shares."""
    by = {}
    for (path, reason), cell in after.items():
        old = before.get((path, reason), {})
        steps = int(cell["steps"] - old.get("steps", 0))
        secs = cell["seconds"] - old.get("seconds", 0.0)
        if steps:
            by[f"{path}/{reason}"] = {"steps": steps, "seconds": round(secs, 4),
                                      "mean_step_s": round(secs / steps, 4)}
    steps = sum(c["steps"] for c in by.values())
    secs = sum(c["seconds"] for c in by.values())
    eager = {k: c for k, c in by.items() if k.startswith("eager/")}
    return {
        "steps": steps, "seconds": round(secs, 3), "by_path_reason": by,
        "eager_step_share": round(sum(c["steps"] for c in eager.values()) / steps, 4)
        if steps else None,
        "eager_time_share": round(sum(c["seconds"] for c in eager.values()) / secs, 4)
        if secs else None,
        "eager_step_share_by_reason": {k.removeprefix("eager/"): round(c["steps"] / steps, 4)
                                       for k, c in eager.items()} if steps else {},
        "eager_time_share_by_reason": {k.removeprefix("eager/"): round(c["seconds"] / secs, 4)
                                       for k, c in eager.items()} if secs else {},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [AS_WORKER]:
        return serve_worker(argv[1:])
    from _common import Timer

    import loadgen
    import servers
    from serve import dataset

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0.5,1,2",
                   help="requests/s, comma-separated (default: 0.5,1,2)")
    p.add_argument("--quick", action="store_true",
                   help="serve.py's --quick mixed dataset (shorter prompts and outputs)")
    p.add_argument("--requests", type=int, default=16, help="requests per rate (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/"
                                               "graph_share-<date>.json)")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    spec = servers.ServerSpec("graph-share", [sys.executable, str(Path(__file__).resolve()),
                                              AS_WORKER, "--log-level", "WARNING", "worker",
                                              "--port", "{port}"],
                              env={"PYTHONPATH": str(servers.REPO / "src")})
    runs = []
    with servers.launched(spec) as url:
        model = asyncio.run(loadgen.served_model(url))
        warm = dataset("mixed", True, seed=10_000)[:2]
        asyncio.run(loadgen.run_rate(url, model, warm, math.inf, seed=0))
        for i, rate in enumerate(rates):
            reqs = dataset("mixed", args.quick, seed=args.seed + 1000 * (i + 1),
                           num_requests=args.requests)
            before = read_paths(url)
            with Timer() as timer:
                results = asyncio.run(loadgen.run_rate(url, model, reqs, rate,
                                                       seed=args.seed + i))
            after = read_paths(url)
            summary = loadgen.summarize(rate, results, loadgen.SLO()).to_json()
            run = {"rate": rate, "requests": len(reqs), "completed": summary["completed"],
                   "duration_s": round(summary["duration_s"], 2),
                   "output_throughput": round(summary["output_throughput"], 1),
                   "ttft_p50": summary["ttft"]["p50"], "tpot_p50": summary["tpot"]["p50"],
                   **shares(before, after), **timer.contention()}
            runs.append(run)
            print(f"rate {rate}: {run['completed']}/{len(reqs)} ok, {run['steps']} steps, "
                  f"eager {run['eager_step_share']:.1%} of steps, "
                  f"{run['eager_time_share']:.1%} of step time {run['by_path_reason']}",
                  file=sys.stderr, flush=True)
    today = dt.date.today().isoformat()
    out = Path(args.out or BENCH_DIR / "results" / f"graph_share-{today}.json")
    from offline_throughput import cpu_model

    res = {"date": today, "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
           "command": "bench/graph_share.py " + " ".join(argv),
           "dataset": "mixed" + (" (quick)" if args.quick else ""),
           "graphs": "EagerGraphs: default decode sizes, eager replay (CPU)", "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print("| rate (req/s) | steps | eager steps | eager step time | eager steps by reason |",
          file=sys.stderr)
    for r in runs:
        reasons = ", ".join(f"{k} {v:.0%}" for k, v in r["eager_step_share_by_reason"].items())
        print(f"| {r['rate']:g} | {r['steps']} | {r['eager_step_share']:.0%} | "
              f"{r['eager_time_share']:.0%} | {reasons} |", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
