"""Speculative decoding benchmark: baseline vs n-gram vs self-draft proposers, in one run.

    .venv/bin/python bench/spec_decode.py [--quick] [--engines baseline,ngram,self-l8,self-int4]
        [--workloads grounded,code,chat] [--batch-sizes 1,8] [--prompts 8] [--max-tokens 256]
        [--temperature 0] [--k 8] [--no-adaptive] [--out bench/results/spec_decode-DATE.json]

On the bundled SmolLM2-135M-Instruct, chat-formatted prompts, three workloads (`spec_prompts.py`):
`grounded` (repeat / quote / lightly edit / summarize a given public-domain passage of 250-400
tokens: where prompt lookup shines), `code` (repetitive code: getters and setters, enums, a
listing to continue) and `chat` (short open questions). Each engine lives in its own
subprocess (`--child NAME`), built once and warmed up (the processes start one after
another); then each (workload, batch) runs on every engine back to back, one engine at a
time, in an order that rotates from run to run, so the machine's drift over the run spreads
over the engines. Batch b submits groups of b prompts at once (the prompt list cycled to
fill a group); batch 1 runs each prompt alone, and its per-prompt ratios are printed.

Per (engine, workload, batch): output tokens/s over the wall clock of each group's generate
(submission to last completion, prefill included), decode tokens/s (after every request of
the group has its first token), the ratio of each to the baseline, and from the engine's
counters (`llm.engine.stats()`, deltas around each timed group) the acceptance rate =
accepted / draft tokens, mean accepted length = 1 + accepted / drafts, accepted per draft
position; for the baseline, the n-gram ceiling (`lookup_ceiling`: tokens per step prompt lookup
would reach on the baseline's own outputs with free verification). Greedy (the default)
outputs must equal the baseline's token for token: a mismatch is reported loudly and makes
the exit code 1. `--quick`: one prompt per workload,
16 new tokens (a smoke run). Writes the raw results with machine details to one JSON file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH / "runners"))
sys.path.insert(0, str(BENCH))

from _common import Timer, log  # noqa: E402

from spec_prompts import WARMUP, WORKLOADS, conversations  # noqa: E402

ENGINES: dict[str, dict | None] = {
    "baseline": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 5},
    "self-l8": {"method": "draft", "model": "self", "draft_num_layers": 8,
                "num_speculative_tokens": 4},
    "self-int4": {"method": "draft", "model": "self", "draft_quantization": "int4",
                  "num_speculative_tokens": 4},
}
BASE_ARGS = {"kv_cache_memory": 256 << 20}
SPEC_KEYS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


def spec_config(name: str, k: int, adaptive: bool) -> dict | None:
    cfg = ENGINES[name]
    return None if cfg is None else {**cfg, "num_speculative_tokens": k, "adaptive": adaptive}


def _stats(eng) -> dict:  # noqa: ANN001 - tandem LLMEngine
    st = eng.stats()
    out = {k: int(getattr(st, k, 0)) for k in SPEC_KEYS}
    out["per_pos"] = list(getattr(st, "spec_accepted_per_pos", ()))
    return out


def _delta(a: dict, b: dict, sign: int = -1) -> dict:
    """b - a of spec counters (sign=-1), or b + a (sign=1); per-position lists padded."""
    d = {k: b[k] + sign * a[k] for k in SPEC_KEYS}
    n = max(len(a["per_pos"]), len(b["per_pos"]))
    pad = lambda x: x + [0] * (n - len(x))  # noqa: E731
    d["per_pos"] = [y + sign * x for x, y in zip(pad(a["per_pos"]), pad(b["per_pos"]),
                                                 strict=True)]
    return d


def timed_group(llm, prompts: list[list[int]], sp) -> dict:  # noqa: ANN001
    """Submit `prompts` at once and step to completion: token ids, wall / decode seconds,
    spec counter deltas."""
    eng = llm.engine
    tag = f"g{time.monotonic_ns()}"
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    s0 = _stats(eng)
    counts: dict[str, int] = {}
    done: dict[str, list[int]] = {}
    t_first = None
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        eng.add_request(rid, p, sp)
    while len(done) < len(ids):
        for out in eng.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if t_first is None and len(counts) == len(ids) and all(counts.values()):
            t_first, at_first = time.perf_counter(), sum(counts.values())
    wall = time.perf_counter() - t0
    if t_first is None:  # unreachable unless a request ended without a token
        t_first, at_first = t0 + wall, 0
    toks = [done[r] for r in ids]
    total = sum(map(len, toks))
    return {"token_ids": toks, "tokens": total, "wall_s": wall,
            "decode_s": wall - (t_first - t0), "decode_tokens": total - at_first,
            "spec": _delta(s0, _stats(eng))}


def run_batch(llm, prompts: list[list[int]], batch: int, sp) -> dict:  # noqa: ANN001
    """Every prompt once in groups of `batch` (cycled to fill at least one group)."""
    n = max(len(prompts), batch)
    pool = [prompts[i % len(prompts)] for i in range(-(-n // batch) * batch)]
    groups = [timed_group(llm, pool[i : i + batch], sp) for i in range(0, len(pool), batch)]
    with_t = lambda k: sum(g[k] for g in groups)  # noqa: E731
    spec = {k: 0 for k in SPEC_KEYS} | {"per_pos": []}
    for g in groups:
        spec = _delta(spec, g["spec"], sign=1)
    tokens, wall, dtok, dsec = with_t("tokens"), with_t("wall_s"), with_t("decode_tokens"), \
        with_t("decode_s")
    drafts, dtoks, acc = (spec[k] for k in SPEC_KEYS)
    token_ids = [t for g in groups for t in g["token_ids"]]
    return {"batch": batch, "requests": len(pool), "groups": len(groups), "tokens": tokens,
            "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 2),
            "decode_tokens": dtok, "decode_s": round(dsec, 4),
            "decode_tokens_per_s": round(dtok / dsec, 2) if dsec > 0 else None,
            "group_wall_s": [round(g["wall_s"], 4) for g in groups],
            "spec": spec, "acceptance_rate": round(acc / dtoks, 4) if dtoks else None,
            "mean_accepted_length": round(1 + acc / drafts, 3) if drafts else None,
            "token_ids": token_ids}


def lookup_ceiling(prompts: list[list[int]], outputs: list[list[int]], k: int, min_n: int,
                   max_n: int) -> float:
    """Output tokens per target step that prompt lookup (`find_ngram_match`, this config)
    would reach on these exact greedy outputs with verification free and k fixed: each step
    proposes from prompt + output so far, keeps the drafts that equal the output, and emits
    one more. An upper bound on the n-gram proposer's decode speed-up for the workload."""
    import numpy as np

    from tandem.engine.spec_decode.ngram import find_ngram_match

    tokens = steps = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ctx, pos = list(prompt), 0
        while pos < len(out):
            draft = find_ngram_match(np.array(ctx, dtype=np.int64), min_n, max_n, k).tolist()
            acc = 0
            while (acc < len(draft) and pos + acc < len(out) - 1
                   and draft[acc] == out[pos + acc]):
                acc += 1
            ctx += out[pos : pos + acc + 1]
            pos += acc + 1
            steps += 1
        tokens += len(out)
    return tokens / steps if steps else 0.0


def child(name: str, args: argparse.Namespace) -> None:
    """One engine, built once and warmed up, then serving runs: prints a ready line, then
    for each stdin line {"workload", "batch"} one result line (JSON) on stdout."""
    import torch

    from tandem import LLM, SamplingParams

    spec = spec_config(name, args.k, not args.no_adaptive)
    engine_args = dict(BASE_ARGS, enable_prefix_caching=args.prefix_caching,
                       **({"speculative_config": spec} if spec else {}))
    with Timer() as load:
        llm = LLM(**engine_args)
    tok = llm.get_tokenizer()
    enc = lambda conv: tok.apply_chat_template(conv, tokenize=True)  # noqa: E731
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        seed=0 if args.temperature > 0 else None)
    warm = [enc(c) for c in conversations(WARMUP, 8)]
    warm_sp = SamplingParams(max_tokens=16, temperature=args.temperature)
    run_batch(llm, warm[:1], 1, warm_sp)
    run_batch(llm, warm, max(args.batch_sizes), warm_sp)
    print(json.dumps({"engine": name, "engine_args": engine_args,
                      "load_s": round(load.elapsed, 2), "torch_threads": torch.get_num_threads(),
                      "spec_enabled": getattr(llm.engine, "speculator", None) is not None}),
          flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        wl, b = job["workload"], int(job["batch"])
        prompts = [enc(c) for c in conversations(wl, args.prompts)]
        with Timer() as t:
            r = run_batch(llm, prompts, b, sp)
        r.update(t.contention(), prompt_tokens=sum(map(len, prompts)) // len(prompts),
                 sample_text=tok.decode(r["token_ids"][0]))
        if name == "baseline":  # what prompt lookup could do at best on these outputs
            ng = ENGINES["ngram"]
            pool = [prompts[i % len(prompts)] for i in range(len(r["token_ids"]))]
            r["ngram_ceiling"] = {
                f"k{k}": round(lookup_ceiling(pool, r["token_ids"], k, ng["prompt_lookup_min"],
                                              ng["prompt_lookup_max"]), 3)
                for k in sorted({args.k, 4, 8})}
        print(json.dumps(r), flush=True)


class EngineProcess:
    """A `--child NAME` subprocess: `start` waits for its ready line, `run` sends one job
    and waits for its result. A dead or silent child turns into an error, never a hang
    longer than `timeout` seconds per call."""

    def __init__(self, name: str, argv: list[str], timeout: float) -> None:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        self.name, self.timeout, self.error = name, timeout, None
        self.proc = subprocess.Popen([sys.executable, __file__, *argv, "--child", name],
                                     env=env, cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(line)
        self.lines.put(None)

    def _read(self) -> dict | None:
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.error = f"no answer within {self.timeout:.0f}s"
            self.proc.kill()
            return None
        if line is None:
            self.error = f"exit code {self.proc.wait()}"
            return None
        return json.loads(line)

    def start(self) -> dict:
        log(f"starting {self.name} ...")
        head = self._read()
        return head if head is not None else {"engine": self.name, "error": self.error}

    def run(self, workload: str, batch: int) -> dict | None:
        if self.error is not None:
            return None
        self.proc.stdin.write(json.dumps({"workload": workload, "batch": batch}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_engines(engines: list[str], argv: list[str], args: argparse.Namespace) -> dict:
    """Every engine's process started (one at a time, so loads do not overlap), then each
    (workload, batch) run on every engine back to back, the engines' order rotating from
    run to run: slow drift of the machine's speed spreads over all engines instead of
    favouring whichever runs first."""
    procs: dict[str, EngineProcess] = {}
    results: dict[str, dict] = {}
    try:
        for e in engines:
            procs[e] = EngineProcess(e, argv, args.timeout)
            results[e] = procs[e].start()
        jobs = [(wl, b) for wl in args.workloads for b in args.batch_sizes]
        for n, (wl, b) in enumerate(jobs):
            order = engines[n % len(engines):] + engines[: n % len(engines)]
            for e in order:
                r = procs[e].run(wl, b)
                if r is None:
                    results[e].setdefault("error", procs[e].error)
                    continue
                text = r.pop("sample_text")
                if b == args.batch_sizes[0]:
                    results[e].setdefault("sample_text", {})[wl] = text
                results[e].setdefault("runs", {})[f"{wl}/b{b}"] = r
                log(f"  {e} {wl} b{b}: {r['tokens_per_s']:.1f} tok/s, acceptance "
                    f"{r['acceptance_rate']}, mean accepted length {r['mean_accepted_length']}")
    finally:
        for p in procs.values():
            p.close()
    return results  # each engine's runs in the jobs' order: only engines rotate, not jobs


def check_outputs(results: dict[str, dict], greedy: bool) -> list[dict]:
    """Greedy outputs of every engine vs the baseline's, per run and request: mismatches
    (engine, run, request, first differing position); token ids are then dropped for hashes."""
    base = results.get("baseline", {}).get("runs", {})
    bad: list[dict] = []
    for name, r in results.items() if greedy else ():
        for key, run in r.get("runs", {}).items():
            ref = base.get(key, {}).get("token_ids")
            if name == "baseline" or ref is None:
                continue
            for i, (a, b) in enumerate(zip(ref, run["token_ids"], strict=True)):
                if a != b:
                    pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False))
                                if x != y), min(len(a), len(b)))
                    bad.append({"engine": name, "run": key, "request": i, "position": pos,
                                "baseline": a[pos : pos + 8], "engine_ids": b[pos : pos + 8]})
            run["matches_baseline"] = not any(m["engine"] == name and m["run"] == key
                                              for m in bad)
    for r in results.values():
        for run in r.get("runs", {}).values():
            ids = run.pop("token_ids")
            run["output_sha1"] = [hashlib.sha1(json.dumps(t).encode()).hexdigest()[:12]
                                  for t in ids]
            run["output_lens"] = [len(t) for t in ids]
    return bad


def _x(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def report(results: dict[str, dict], greedy: bool) -> None:
    base = results.get("baseline", {}).get("runs", {})
    head = (f"{'engine':<11}{'run':<14}{'tok/s':>8}{'x base':>8}{'decode tok/s':>13}"
            f"{'x base':>8}{'accept':>8}{'mean len':>9}{'drafts':>8}{'same':>6}{'other cpu':>10}")
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<11}FAILED: {r['error']}")
            continue
        if name != "baseline" and not r.get("spec_enabled"):
            print(f"{name:<11}WARNING: the engine has no speculator (config ignored?)")
        for key, run in r.get("runs", {}).items():
            b = base.get(key, {})
            acc, ml = run["acceptance_rate"], run["mean_accepted_length"]
            same = "-" if not greedy or name == "baseline" else (
                "yes" if run.get("matches_baseline") else "NO")
            share = run.get("other_cpu_share")
            print(f"{name:<11}{key:<14}{run['tokens_per_s']:>8.1f}"
                  f"{_x(run['tokens_per_s'], b.get('tokens_per_s')):>8}"
                  f"{run['decode_tokens_per_s'] or 0:>13.1f}"
                  f"{_x(run['decode_tokens_per_s'], b.get('decode_tokens_per_s')):>8}"
                  f"{'-' if acc is None else f'{acc:.0%}':>8}"
                  f"{'-' if ml is None else f'{ml:.2f}':>9}{run['spec']['spec_num_drafts']:>8}"
                  f"{same:>6}{'-' if share is None else f'{share:.0%}':>10}")
    print("(tok/s: output tokens / wall clock of each group's generate, prefill included; "
          "decode: after every request's first token; accept = accepted / draft tokens; "
          "mean len = 1 + accepted / drafts; same: greedy tokens equal the baseline's)")
    for name, r in results.items():  # b1: each prompt alone, so its own ratio
        for key, run in r.get("runs", {}).items() if name != "baseline" else ():
            ref = base.get(key, {}).get("group_wall_s")
            if key.endswith("/b1") and ref and len(ref) == len(run["group_wall_s"]):
                print(f"per prompt {name} {key}: " + " ".join(
                    f"{b / a:.2f}x" for a, b in zip(run["group_wall_s"], ref, strict=True)))
    for key, run in base.items():
        if "ngram_ceiling" in run and key.endswith("/b1"):
            print(f"ngram ceiling {key} (tokens per step, free verification): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in run["ngram_ceiling"].items()))
    # the targets: >= 2x with ngram on grounded at batch 1, >= 0.9x on chat
    tps = lambda e, k: results.get(e, {}).get("runs", {}).get(k, {}).get("tokens_per_s")  # noqa: E731
    if r := _x(tps("ngram", "grounded/b1"), tps("baseline", "grounded/b1")):
        print(f"target ngram grounded/b1 >= 2x: {r}")
    for e in results:
        for k in (k for k in results[e].get("runs", {}) if k.startswith("chat/")):
            if e != "baseline" and (r := _x(tps(e, k), tps("baseline", k))) != "-":
                print(f"target {e} {k} >= 0.9x: {r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="per request; 256 lets a copy or edit of a 250-400 token "
                    "passage run to its end")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=8,
                    help="num_speculative_tokens (a cap: adaptive speculation trims it)")
    ap.add_argument("--no-adaptive", action="store_true", help="speculative adaptive=False")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="enable prefix caching (off: every group pays its prefill)")
    ap.add_argument("--quick", action="store_true", help="1 prompt per workload, 16 tokens")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds an engine may take to load or to do one run")
    ap.add_argument("--out", type=Path, default=None)
    raw = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(raw)
    if args.quick:
        args.prompts, args.max_tokens = 1, 16
    args.engines = [e for e in args.engines.split(",") if e]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    for e in args.engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r} (choose from {', '.join(ENGINES)})")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    if args.child:
        child(args.child, args)
        return 0
    import torch

    from offline_throughput import _revision, machine_info

    now = dt.datetime.now().astimezone()
    machine = {**machine_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    log(f"machine: {machine}")
    results = run_engines(args.engines, raw, args)
    greedy = args.temperature == 0
    bad = check_outputs(results, greedy)
    report(results, greedy)
    for m in bad:
        print(f"MISMATCH (a bug: greedy speculation must not change outputs): {m}")
    if bad:
        print(f"!!! {len(bad)} greedy output(s) differ from the baseline's !!!")
    out = {"benchmark": "spec_decode", "date": now.isoformat(timespec="seconds"),
           "revision": _revision(REPO), "machine": machine,
           "settings": {k: getattr(args, k) for k in ("engines", "workloads", "batch_sizes",
                                                      "prompts", "max_tokens", "temperature",
                                                      "k", "no_adaptive", "prefix_caching",
                                                      "quick")},
           "spec_configs": {e: spec_config(e, args.k, not args.no_adaptive)
                            for e in args.engines},
           "mismatches": bad, "results": results}
    path = args.out or BENCH / "results" / f"spec_decode-{now.date().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
