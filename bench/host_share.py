"""The host's share of an engine step, serial loop against the overlapped one
(`async_scheduling`), in one process on one engine.

64 concurrent streams on the bundled model (64 prompts of 128 token ids, 64 greedy output
tokens each, `ignore_eos`), stepped by `LLMEngine.step` on this thread; the engine's flag is
switched between runs while it is idle, and the runs alternate serial / overlapped
(A/B/A/B...) after one unrecorded warm-up run, the prefix cache reset before each. Per step:
wall time, and the engine thread's host time split into scheduling (`Scheduler.schedule`),
input building (`runner.execute` less the model's forward and the sampler), output
processing (what the engine thread spends after the forward and `update_after_step`:
committing tokens, stop checks, detokenization and `RequestOutput`s when serial; the commit
and the hand-over to the output thread when overlapped) and their share of the step; the
output thread's time (overlapped runs), and tokens/s. `--http` also runs `gil_share.py`
(the HTTP loop's share of a step at 64 streams, both loops, one round each) and keeps its
verdict.

The overlapped loop is optimistic (sampled ids stay on the device; the next step is
scheduled and launched before they are committed: `engine/core.py`). `--compare-optimistic`
adds a third run per round, the overlapped loop with that path off ("overlapped_host_ids":
each step's ids reach the host before the next schedule), so one run gives the host share
before and after it; the order rotates each round.

    .venv/bin/python bench/host_share.py [--rounds 2] [--http] [--compare-optimistic]
        [--dtype bfloat16] [--threads 2]

JSON: bench/results/host_share-<date>.json (raw per-step rows of every run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gil_share import _rounded, _TimedCall  # noqa: E402 - the bench folder's helpers

HOST_PARTS = ("schedule", "build", "output")


class Recorder:
    """Wraps one engine's methods (instance attributes) and records a row per step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rows: list[dict[str, float]] = []
        self._acc: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._active: set[str] = set()  # parts being timed now (the engine thread's)
        self.output_thread_s = 0.0  # the output thread's `apply` time (wall)
        self.output_thread_cpu_s = 0.0
        sched, runner, outputs = engine.scheduler, engine.runner, engine.outputs
        sched.schedule = self._timed("schedule", sched.schedule)
        sched.update_after_step = self._timed("update", sched.update_after_step)
        runner.execute = self._timed("execute", runner.execute)
        if hasattr(runner, "execute_async"):  # the optimistic loop's launch
            runner.execute_async = self._timed("execute", runner.execute_async)
        runner.model.forward = self._timed("forward", runner.model.forward)
        sampler = runner.sampler
        # the optimistic loop samples through `sample` (ids left on the device); the
        # serial one through `__call__`, which calls it: timed once, the outer call
        sampler.sample = self._timed("sample", sampler.sample)
        runner.sampler = _TimedCall(sampler, self._timed("sample", sampler))
        apply = outputs.apply

        def timed_apply(ops: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return apply(ops)
            finally:
                if threading.current_thread().name == "tandem-outputs":
                    with self._lock:
                        self.output_thread_s += time.perf_counter() - t0
                        self.output_thread_cpu_s += time.thread_time() - c0
        outputs.apply = timed_apply

    def _timed(self, name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name in self._active:  # inside a timed call of the same part
                return fn(*args, **kwargs)
            self._active.add(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._acc[name] += time.perf_counter() - t0
                self._active.discard(name)
        return wrapped

    def step(self) -> list[Any]:
        self._acc.clear()
        t0 = time.perf_counter()
        outs = self.engine.step()
        wall = time.perf_counter() - t0
        a = self._acc
        if a["execute"]:  # a step that ran a forward
            self.rows.append({
                "wall": wall, "schedule": a["schedule"],
                "build": a["execute"] - a["forward"] - a["sample"],
                "forward": a["forward"], "sample": a["sample"], "update": a["update"],
                "output": wall - a["schedule"] - a["execute"] - a["update"]})
        return outs


def run_once(rec: Recorder, prompts: list[list[int]], params: Any, overlapped: bool,
             tag: str, optimistic: bool = True) -> dict[str, Any]:
    eng = rec.engine
    assert not eng.has_unfinished_requests()
    eng.async_scheduling = overlapped  # idle: nothing in flight
    eng.optimistic = optimistic
    steps0 = eng.optimistic_steps
    eng.reset_prefix_cache()
    rec.rows, rec.output_thread_s, rec.output_thread_cpu_s = [], 0.0, 0.0
    c0, t0 = time.thread_time(), time.perf_counter()
    for i, prompt in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", prompt, params)
    tokens = 0
    while eng.has_unfinished_requests():
        for out in rec.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    if tokens != len(prompts) * params.max_tokens:
        raise RuntimeError(f"{tokens} tokens, expected {len(prompts) * params.max_tokens}")
    return {"overlapped": overlapped, "optimistic": overlapped and optimistic,
            "optimistic_steps": eng.optimistic_steps - steps0, "wall_s": wall,
            "engine_thread_cpu_s": time.thread_time() - c0, "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "output_thread_s": rec.output_thread_s,
            "output_thread_cpu_s": rec.output_thread_cpu_s, "steps": rec.rows}


def _mode(overlapped: bool, optimistic: bool) -> str:
    """A run's mode name: serial, overlapped (optimistic) or overlapped_host_ids."""
    if not overlapped:
        return "serial"
    return "overlapped" if optimistic else "overlapped_host_ids"


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    rows = run["steps"]
    n = len(rows)
    wall = sum(r["wall"] for r in rows)
    decode = [r for r in rows if r["forward"] > 0 and r is not rows[0]][-40:]
    out: dict[str, Any] = {"steps": n, "step_ms": 1e3 * wall / n,
                           "tokens_per_s": run["tokens_per_s"],
                           "output_thread_ms_per_step": 1e3 * run["output_thread_s"] / n}
    host = 0.0
    for part in HOST_PARTS:
        s = sum(r[part] for r in rows)
        host += s
        out[f"{part}_ms"] = 1e3 * s / n
        out[f"{part}_share"] = s / wall
    out["host_ms"] = 1e3 * host / n
    out["host_share"] = host / wall
    # the last 40 steps: pure decode at 64 streams (the prefills are done)
    dw = sum(r["wall"] for r in decode)
    out["decode_step_ms"] = 1e3 * dw / max(1, len(decode))
    out["decode_host_share"] = sum(r[p] for r in decode for p in HOST_PARTS) / dw if dw else 0
    return out


def http_share(args: argparse.Namespace) -> dict[str, Any]:
    """`gil_share.py` at `--streams`, serial and overlapped: the HTTP loop's share of a
    step."""
    out: dict[str, Any] = {}
    for overlapped in (False, True):
        path = Path(f"/tmp/host_share-gil-{os.getpid()}-{int(overlapped)}.json")
        cmd = [sys.executable, str(HERE / "gil_share.py"), "--requests", str(args.streams),
               "--max-tokens", str(args.http_max_tokens), "--rounds", "1", "--out", str(path)]
        if overlapped:
            cmd.append("--async-scheduling")
        subprocess.run(cmd, check=True, cwd=HERE.parent)
        report = json.loads(path.read_text())
        path.unlink()
        out["overlapped" if overlapped else "serial"] = {
            "command": " ".join(Path(c).name if c == sys.executable else c for c in cmd),
            "verdict": report["verdict"], "summary": report["summary"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="serial/overlapped pairs (A/B/A/B)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--http", action="store_true", help="also run gil_share.py, both loops")
    ap.add_argument("--http-max-tokens", type=int, default=32,
                    help="output tokens per stream in the gil_share.py runs")
    ap.add_argument("--compare-optimistic", action="store_true",
                    help="also run the overlapped loop with the optimistic path off")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (bfloat16, ...)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.serving.worker import SERVING_MAX_BATCHED_TOKENS

    t_start = time.time()
    config = EngineConfig(model=args.model, num_threads=args.threads or None, dtype=args.dtype,
                          max_num_batched_tokens=SERVING_MAX_BATCHED_TOKENS)
    engine = LLMEngine(config)
    rec = Recorder(engine)
    rng = random.Random(0)
    hi = min(20000, engine.state.vocab_size)
    lo = min(1000, hi // 4)
    prompts = [[rng.randrange(lo, hi) for _ in range(args.prompt_tokens)]
               for _ in range(args.streams)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    run_once(rec, prompts, params, False, "warm")
    runs = []
    # (overlapped, optimistic) per mode; the order rotates each round
    modes = [(False, True), (True, True)] + ([(True, False)] if args.compare_optimistic else [])
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)] if args.compare_optimistic \
            else (modes if r % 2 == 0 else modes[::-1])
        for overlapped, optimistic in order:
            run = run_once(rec, prompts, params, overlapped,
                           f"r{r}-{int(overlapped)}{int(optimistic)}", optimistic)
            run["round"] = r
            run["mode"] = _mode(overlapped, optimistic)
            run["summary"] = summarize(run)
            runs.append(run)
            s = run["summary"]
            print(f"round {r} {run['mode']:>19}: "
                  f"{s['step_ms']:.1f} ms/step, host {s['host_ms']:.1f} ms "
                  f"({s['host_share']:.1%}: schedule {s['schedule_share']:.1%}, build "
                  f"{s['build_share']:.1%}, output {s['output_share']:.1%}), output thread "
                  f"{s['output_thread_ms_per_step']:.1f} ms/step, {s['tokens_per_s']:.0f} tok/s",
                  flush=True)
    keys = ("step_ms", "decode_step_ms", "host_ms", "host_share", "decode_host_share",
            "schedule_ms", "build_ms", "output_ms", "schedule_share", "build_share",
            "output_share", "output_thread_ms_per_step", "tokens_per_s")
    table: dict[str, Any] = {}
    for overlapped, optimistic in modes:
        sums = [r["summary"] for r in runs if r["mode"] == _mode(overlapped, optimistic)]
        table[_mode(overlapped, optimistic)] = {
            k: {"median": statistics.median(s[k] for s in sums),
                "values": [s[k] for s in sums]} for k in keys}

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
        return {k: a[k]["median"] / b[k]["median"]
                for k in ("tokens_per_s", "step_ms", "host_ms", "output_ms")}
    ratios = ratio(table["overlapped"], table["serial"])
    print("\nmode | step ms | host ms/step (share) | schedule | build | output | "
          "output thread ms | tok/s")
    for mode, t in table.items():
        m = {k: v["median"] for k, v in t.items()}
        print(f"{mode} | {m['step_ms']:.1f} | {m['host_ms']:.1f} ({m['host_share']:.1%}) | "
              f"{m['schedule_share']:.1%} | {m['build_share']:.1%} | {m['output_share']:.1%} "
              f"| {m['output_thread_ms_per_step']:.1f} | {m['tokens_per_s']:.0f}")
    print("overlapped / serial: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    if args.compare_optimistic:
        opt = ratio(table["overlapped"], table["overlapped_host_ids"])
        print("overlapped / overlapped_host_ids: "
              + ", ".join(f"{k} {v:.3f}" for k, v in opt.items()))
    report: dict[str, Any] = {
        "bench": "host_share", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                     time.gmtime(t_start)),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_rev": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                  text=True, cwd=HERE).stdout.strip(),
        "workload": {"streams": args.streams, "prompt_tokens": args.prompt_tokens,
                     "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                     "rounds": args.rounds},
        "engine_config": {k: getattr(config, k) for k in (
            "max_num_seqs", "max_num_batched_tokens", "block_size", "dtype", "num_threads",
            "attention_backend")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
                    "note": "shared 2-core machine: other jobs may run concurrently; "
                            "compare within this run only"},
        "table": table, "ratios": ratios,
        "ratios_optimistic": (ratio(table["overlapped"], table["overlapped_host_ids"])
                              if args.compare_optimistic else None),
        "runs": [{k: v for k, v in r.items()} for r in runs],
    }
    if args.http:
        report["http_loop"] = http_share(args)
        for mode, h in report["http_loop"].items():
            v = h["verdict"]["http"]
            print(f"HTTP loop at 64 streams, {mode}: step time lost {v['contention']:+.1%} "
                  f"({'ABOVE' if v['above_5pct']['contention'] else 'below'} 5 %), GIL wait "
                  f"{v['gil_wait']:+.1%}")
    report["duration_s"] = time.time() - t_start
    out = Path(args.out) if args.out else HERE / "results" / (
        f"host_share-{time.strftime('%Y-%m-%d', time.gmtime(t_start))}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_rounded(report), separators=(",", ":")))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
