"""Quantization benchmark: decode and prefill speed, weight memory and KV capacity per mode.

    .venv/bin/python bench/quant.py [--modes float32,bf16,int8,w8a8,int4,gguf]
        [--kv auto,fp8,int8] [--out bench/results/quant.json]

One invocation, every mode in its own subprocess back to back (`--child MODE`, which prints
one JSON line, as `bench/runners/` do), so memory, threads and allocator state never carry
over. Per weight mode, on the bundled SmolLM2-135M (float32 activations; "bf16" is float
weights and activations in bfloat16, flagged as emulated when the CPU lacks AVX512_BF16/AMX):

* decode tokens/s at batch 1 and batch 16: greedy, `ignore_eos`, 32-token corpus prompts,
  64 new tokens each; the clock runs over the decode steps only (after every request's
  prefill step), after a warm-up generate;
* prefill tokens/s: four 1,024-token corpus prompts, `max_num_batched_tokens=1024`, so each
  step is one 1,024-token chunk; prefix caching off;
* resident weight bytes (`llm.model_memory_bytes()`).

Each timing runs `--reps` times in the same engine (emulated bf16: once) and the fastest is
reported (all are kept in the JSON with the share of the CPUs other processes took).

Per KV dtype (float32 weights): the KV blocks the engine computes for the same 64 MiB
`kv_cache_memory`, as concurrent 1,024-token sequences, and decode tokens/s at batch 16.
Prints ratios against float32 and writes the raw results with machine details to one JSON
file. Other processes' CPU use during each timed block is recorded (`other_cpu_share`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH / "runners"))
sys.path.insert(0, str(BENCH))

from _common import Timer, log  # noqa: E402

CORPUS = REPO / "tests" / "data" / "corpus_pd.txt"
MODES = ("float32", "bf16", "int8", "w8a8", "int4", "gguf")
KV_DTYPES = ("auto", "fp8", "int8")
KV_BUDGET = 64 << 20
SEQ_LEN = 1024
NEW_TOKENS = 64
PROMPT_LEN = 32
CHUNK = 1024


def engine_args(mode: str) -> dict:
    """Engine arguments of a child: a weight mode, or "kv-<dtype>" (float32 weights)."""
    if mode.startswith("kv-"):
        return {"dtype": "float32", "kv_cache_dtype": mode[3:], "kv_cache_memory": KV_BUDGET}
    if mode == "bf16":
        return {"dtype": "bfloat16"}
    if mode == "float32":
        return {"dtype": "float32"}
    return {"dtype": "float32", "quantization": mode}


def bf16_native() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _decode(llm, prompts: list[list[int]]) -> dict:  # noqa: ANN001 - tandem.LLM
    """Tokens/s over the decode steps of `prompts` (all added at once, prefilled in the
    first step(s), which are not timed)."""
    from tandem import SamplingParams

    eng = llm.engine
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tag = f"d{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, sp)
    done: dict[str, list[int]] = {}
    first = set()
    while len(first) < len(prompts):  # prefill steps: until every request has a token
        for out in eng.step():
            if out.outputs[0].token_ids:
                first.add(out.request_id)
    steps = 0
    with Timer() as t:
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
    tokens = len(prompts) * (NEW_TOKENS - 1)
    return {"batch": len(prompts), "steps": steps, "tokens": tokens,
            "seconds": round(t.elapsed, 4), "tokens_per_s": round(tokens / t.elapsed, 2),
            **t.contention(), "check_token_ids": [done[f"{tag}-0"][:16]]}


def _prefill(llm, prompts: list[list[int]]) -> dict:  # noqa: ANN001
    from tandem import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with Timer() as t:
        llm.generate(prompts, sp)
    tokens = sum(map(len, prompts))
    return {"tokens": tokens, "seconds": round(t.elapsed, 4),
            "tokens_per_s": round(tokens / t.elapsed, 2), **t.contention()}


def _best(runs: list[dict]) -> dict:
    """The fastest of repeated runs (the least disturbed by other jobs), with every rate."""
    best = max(runs, key=lambda r: r["tokens_per_s"])
    return {**best, "all_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def child(mode: str, reps: int) -> dict:
    import torch

    from tandem import LLM, SamplingParams

    args = {"kv_cache_memory": 256 << 20, "max_num_batched_tokens": CHUNK,
            "enable_prefix_caching": False, **engine_args(mode)}
    with Timer() as load:
        llm = LLM(**args)
    ids = llm.get_tokenizer().encode(CORPUS.read_text(), add_special_tokens=False)
    short = [ids[i * 97 : i * 97 + PROMPT_LEN] for i in range(16)]
    long = [ids[o : o + CHUNK] for o in (0, 700, 1400, 2200)]
    # warm-up: a decode batch and one full chunk (kernel selection, allocator, caches)
    llm.generate(short[:4] + long[:1], SamplingParams(max_tokens=4, temperature=0.0,
                                                     ignore_eos=True))
    state = llm.engine.state
    out = {"mode": mode, "engine_args": args, "load_s": round(load.elapsed, 2),
           "model_memory_bytes": llm.model_memory_bytes(), "kv_blocks": state.num_kv_blocks,
           "kv_bytes_per_block": state.kv_bytes_per_block,
           "torch_threads": torch.get_num_threads()}
    if mode.startswith("kv-"):
        out["sequences_of_1024"] = state.num_kv_blocks * state.block_size // SEQ_LEN
        out["decode_b16"] = _best([_decode(llm, short) for _ in range(reps)])
        return out
    out["decode_b1"] = _best([_decode(llm, short[:1]) for _ in range(reps)])
    out["decode_b16"] = _best([_decode(llm, short) for _ in range(reps)])
    out["prefill"] = _best([_prefill(llm, long) for _ in range(reps)])
    if mode == "bf16":
        out["bf16_native"] = bf16_native()
    return out


def run_child(mode: str, timeout: float, reps: int) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    log(f"running {mode} ...")
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", mode, "--reps", str(reps)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"  {mode} timed out after {timeout:.0f}s")
        return {"mode": mode, "error": f"timed out after {timeout:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            res["process_s"] = round(time.perf_counter() - t0, 1)
            return res
    tail = proc.stderr.splitlines()[-12:]
    log(f"  {mode} FAILED (exit {proc.returncode}):\n    " + "\n    ".join(tail))
    return {"mode": mode, "error": f"exit code {proc.returncode}", "log_tail": tail}


def _r(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def report(results: dict[str, dict]) -> None:
    base = results.get("float32", {})
    b_mem = base.get("model_memory_bytes")
    g = lambda r, k: (r.get(k) or {}).get("tokens_per_s")  # noqa: E731
    head = (f"{'mode':<9}{'weights MiB':>12}{'f32/this':>9}{'dec b1 tok/s':>13}{'x f32':>7}"
            f"{'dec b16 tok/s':>14}{'x f32':>7}{'prefill tok/s':>14}{'x f32':>7}")
    print(head + "\n" + "-" * len(head))
    for mode, r in results.items():
        if mode.startswith("kv-"):
            continue
        if "error" in r:
            print(f"{mode:<9}FAILED: {r['error']}")
            continue
        mem = r["model_memory_bytes"]
        name = mode + ("*" if mode == "bf16" and not r.get("bf16_native") else "")
        print(f"{name:<9}{mem / 2**20:>12.1f}{_r(b_mem, mem):>9}"
              f"{g(r, 'decode_b1'):>13.1f}{_r(g(r, 'decode_b1'), g(base, 'decode_b1')):>7}"
              f"{g(r, 'decode_b16'):>14.1f}{_r(g(r, 'decode_b16'), g(base, 'decode_b16')):>7}"
              f"{g(r, 'prefill'):>14.1f}{_r(g(r, 'prefill'), g(base, 'prefill')):>7}")
    if "bf16" in results and not results["bf16"].get("bf16_native", True):
        print("* bf16 emulated: this CPU has no AVX512_BF16 / AMX")
    kv = {m: r for m, r in results.items() if m.startswith("kv-") and "error" not in r}
    if kv:
        ref = kv.get("kv-auto", {}).get("sequences_of_1024")
        print(f"\nKV cache, {KV_BUDGET >> 20} MiB, sequences of {SEQ_LEN} tokens:")
        for m, r in kv.items():
            print(f"  {m[3:]:<5} {r['kv_blocks']:>5} blocks  {r['sequences_of_1024']:>4} seqs "
                  f"({_r(r['sequences_of_1024'], ref)})  decode b16 "
                  f"{g(r, 'decode_b16'):.1f} tok/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--kv", default=",".join(KV_DTYPES))
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-child seconds")
    ap.add_argument("--reps", type=int, default=3,
                    help="timed repetitions of each measurement; the fastest is reported")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "quant.json")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.reps)), flush=True)
        return 0
    import torch

    from offline_throughput import machine_info

    modes = [m for m in args.modes.split(",") if m]
    kvs = [f"kv-{k}" for k in args.kv.split(",") if k]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    for k in kvs:
        if k[3:] not in KV_DTYPES:
            ap.error(f"unknown KV dtype {k[3:]!r} (choose from {', '.join(KV_DTYPES)})")
    now = dt.datetime.now().astimezone()
    machine = {**machine_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "bf16_native": bf16_native()}
    log(f"machine: {machine}")
    # emulated bf16 runs ~5-10x slower than float32: timed once
    results = {m: run_child(m, args.timeout, 1 if m == "bf16" and not machine["bf16_native"]
                            else args.reps) for m in modes + kvs}
    report(results)
    out = {"benchmark": "quant", "date": now.isoformat(timespec="seconds"), "reps": args.reps,
           "machine": machine, "new_tokens": NEW_TOKENS, "prompt_len": PROMPT_LEN,
           "prefill_chunk": CHUNK, "kv_budget_bytes": KV_BUDGET, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
