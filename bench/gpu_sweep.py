"""Decode-attention launch sweep for `bench/gpu_check.py`: which `DecodeConfig` to ship.

Every combination of `num_stages`, `num_warps`, keys per tile (`block_n`) and split-KV count
runs `paged_decode_attention` at batch 64 over one context bucket at a time, each checked
against the float32 reference (`gpu_kernels.ref_attention`) before it is timed with the
same rotating input sets and timer as the kernel section. Per bucket: the fastest correct
launch and `choose_num_splits`' choice; overall: the launch config (stages, warps, block_n)
with the lowest geometric-mean time relative to each bucket's best, at its best split
count per bucket, and how to make it the default (`DECODE_CONFIG` in
`engine/kernels/triton_attention.py`). `pipelining` compiles the decode kernel for the
device's target (sm_90 where there is none) and reports how many shared-memory buffers the
K/V tiles get for each `num_stages`, to check the single-buffering claim on the installed
Triton. Import after `gpu_check` has settled `TRITON_INTERPRET`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import gpu_kernels as gk

_KEYS = ("num_stages", "num_warps", "block_n")


@dataclass(frozen=True)
class SweepSizes:
    """The sweep's grid, geometry (`kernel`: heads, KV heads, head dim, block size) and caps."""

    kernel: gk.KernelSizes
    batch: int
    contexts: tuple[int, ...]  # buckets: lengths drawn from (3/4 ctx, ctx]
    stages: tuple[int, ...]
    warps: tuple[int, ...]
    block_ns: tuple[int, ...]
    splits: tuple[int, ...]
    iters: int
    cap_s: float  # the whole sweep; launches past it are recorded as skipped


SWEEP_REAL = SweepSizes(gk.REAL, 64, (1024, 2048, 4096, 8192), (3, 5), (4, 8), (64, 128),
                        (1, 2, 4), 20, 90.0)
# two launch configs (today's default and its opposite corner), one bucket, interpreted
SWEEP_DRY = SweepSizes(gk.DRY, 2, (40,), (3, 5), (4, 8), (64,), (1, 2), 1, 30.0)


def _grid(sz: SweepSizes) -> list[dict[str, int]]:
    """The launch configs to run: the full product on a GPU; a dry run keeps the default and
    the product's last corner (the same code paths at a fraction of the launches)."""
    full = [dict(zip(_KEYS, c, strict=True))
            for c in itertools.product(sz.stages, sz.warps, sz.block_ns)]
    return full if sz.iters > 1 else [full[0], full[-1]]


def decode_sweep(sz: SweepSizes, dtype: torch.dtype, device: torch.device, timer: gk.Timer,
                 copy_gbps: float, num_sms: int, l2_bytes: int,
                 progress: Callable[[dict], None] | None = None) -> dict:
    """Each bucket x launch config x split count: error, median ms and KV bandwidth; the best
    per bucket and the recommended default (see the module docstring). `progress` gets the
    result so far after each bucket (a run cut short keeps the buckets it finished)."""
    from tandem.engine.kernels import triton_attention as ta

    rng = random.Random(3)
    k = sz.kernel
    scale = k.head_dim ** -0.5
    tol = gk.TOLERANCE[dtype]
    deadline = time.perf_counter() + sz.cap_s
    configs = _grid(sz)
    buckets: dict[str, dict] = {}
    for ctx in sz.contexts:
        lo = max(2, ctx * 3 // 4 + 1)

        set_bytes = sz.batch * ctx * k.kv_heads * k.head_dim * dtype.itemsize * 2
        shapes = [[(rng.randint(lo, ctx) - 1, 1) for _ in range(sz.batch)]
                  for _ in range(gk.num_sets(set_bytes, l2_bytes))]
        sets = gk._paged_sets(shapes, k, dtype, device, rng)
        ref = gk.ref_attention(sets[0], scale)
        kv = statistics.mean(gk._kv_bytes(s, k, dtype) for s in sets)
        ws = ta.DecodeWorkspace.allocate(sz.batch, k.heads, k.head_dim, max(sz.splits), device)
        runs: list[dict] = []
        for cfg, splits in itertools.product(configs, sz.splits):
            entry: dict = {**cfg, "num_splits": splits}
            runs.append(entry)
            if time.perf_counter() > deadline:
                entry["status"] = "skipped (time cap)"
                continue
            config = ta.DecodeConfig(**cfg)

            def run(s: gk.PagedSet, config=config, splits=splits, ws=ws) -> None:
                ta.paged_decode_attention(s.q, s.k_cache, s.v_cache, s.out, s.block_tables,
                                          s.seq_lens, scale=scale, num_splits=splits,
                                          workspace=ws if splits > 1 else None, config=config)

            try:
                sets[0].out.fill_(math.nan)
                run(sets[0])
                err = gk.rel_err(sets[0].out, ref)
                entry.update(rel_err=err, ok=err <= tol)
                if err <= tol:  # only a correct launch is timed
                    entry.update(timer([lambda s=s: run(s) for s in sets], sz.iters,
                                       max(0.5, min(5.0, deadline - time.perf_counter()))))
                    entry["kv_gb_per_s"] = kv / (entry["median_ms"] * 1e-3) / 1e9
                    entry["copy_fraction"] = entry["kv_gb_per_s"] / copy_gbps
                entry["status"] = "ok" if err <= tol else "wrong"
            except Exception as exc:  # say, out of shared memory for this tile size
                entry.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
        timed = [r for r in runs if "median_ms" in r]
        default = _find(runs, dataclasses.asdict(ta.DECODE_CONFIG),
                        ta.choose_num_splits(sz.batch, k.kv_heads, ctx, num_sms))
        buckets[str(ctx)] = {
            "context": [lo, ctx], "batch": sz.batch, "tol": tol, "kv_bytes": int(kv),
            "heuristic_splits": ta.choose_num_splits(sz.batch, k.kv_heads, ctx, num_sms),
            "default": default,
            "best": min(timed, key=lambda r: r["median_ms"]) if timed else None,
            "runs": runs}
        del sets, ref, ws
        if progress is not None:
            progress(_result(sz, dtype, buckets))
    return _result(sz, dtype, buckets)


def _result(sz: SweepSizes, dtype: torch.dtype, buckets: dict[str, dict]) -> dict:
    from tandem.engine.kernels import triton_attention as ta

    return {"sizes": dataclasses.asdict(sz), "dtype": str(dtype).removeprefix("torch."),
            "default_config": dataclasses.asdict(ta.DECODE_CONFIG), "buckets": buckets,
            "all_ok": all(r.get("status") in ("ok", "skipped (time cap)")
                          for b in buckets.values() for r in b["runs"]),
            "recommended": recommend(buckets, dataclasses.asdict(ta.DECODE_CONFIG))}


def _find(runs: list[dict], cfg: dict, splits: int) -> dict | None:
    return next((r for r in runs if r["num_splits"] == splits
                 and all(r[key] == cfg[key] for key in _KEYS)), None)


def recommend(buckets: dict[str, dict], default: dict[str, int]) -> dict:
    """The launch config with the lowest geometric mean, over the buckets, of (its time at its
    best split count / the bucket's best time); among configs timed in every bucket."""
    scores: dict[tuple[int, ...], list[float]] = {}
    for b in buckets.values():
        if b["best"] is None:
            continue
        best = b["best"]["median_ms"]
        per: dict[tuple[int, ...], float] = {}
        for r in b["runs"]:
            if "median_ms" in r:
                key = tuple(r[k] for k in _KEYS)
                per[key] = min(per.get(key, math.inf), r["median_ms"] / best)
        for key, ratio in per.items():
            scores.setdefault(key, []).append(ratio)
    full = {key: v for key, v in scores.items()
            if len(v) == sum(b["best"] is not None for b in buckets.values())}
    if not full:
        return {"decode_config": None, "reason": "no launch config was timed in every bucket"}
    geo = {key: math.exp(statistics.mean(map(math.log, v))) for key, v in full.items()}
    key = min(geo, key=geo.__getitem__)
    cfg = dict(zip(_KEYS, key, strict=True))
    base = geo.get(tuple(default[k] for k in _KEYS))
    args = ", ".join(f"{k}={cfg[k]}" for k in ("block_n", "num_warps", "num_stages"))
    return {"decode_config": cfg, "geomean_over_best": geo[key],
            "default_geomean_over_best": base,
            "speedup_over_default": None if base is None else base / geo[key],
            "best_splits": {ctx: min((r for r in b["runs"] if "median_ms" in r
                                      and all(r[k] == cfg[k] for k in _KEYS)),
                                     key=lambda r: r["median_ms"])["num_splits"]
                            for ctx, b in buckets.items() if b["best"] is not None},
            "heuristic_splits": {ctx: b["heuristic_splits"] for ctx, b in buckets.items()},
            "how": ("DECODE_CONFIG = DecodeConfig(" + args + ") in "
                    "src/tandem/engine/kernels/triton_attention.py")}


# ----------------------------------------------------------------------------- pipelining


def pipelining(stages: tuple[int, ...], device: torch.device, block_n: int = 64,
               timeout_s: float = 120.0) -> dict:
    """`compile_report` in a subprocess with `TRITON_INTERPRET` unset (an interpreted kernel
    cannot be compiled), so a dry run on the CPU checks the same thing a GPU run does."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's own default, without its warning
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--pipelining",
             ",".join(map(str, stages)), "--block-n", str(block_n), "--device", device.type],
            capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"compiling the decode kernel took over {timeout_s:g} s"}
    if proc.returncode:  # recorded, not raised: the sweep itself still runs
        return {"error": f"compiling the decode kernel failed: {proc.stderr[-1500:]}"}
    return json.loads(proc.stdout)


def compile_report(stages: tuple[int, ...], device: torch.device, block_n: int = 64) -> dict:
    """Compile the bf16 decode kernel (GQA 4, head dim 128, block 16, one split) for `device`'s
    target (sm_90 off a GPU) at each `num_stages`, with the integer/pointer alignment a real
    launch specializes on, and read its TTGIR: the K/V tiles' shared-memory buffers (1 = the
    loop waits for each tile's copy before computing it, 2+ = the next tile loads during the
    compute) and the `async_wait` counts (0 = wait for every outstanding copy)."""
    import inspect

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tandem.engine.kernels import triton_attention as ta

    if device.type == "cuda":
        target = triton.runtime.driver.active.get_current_target()
    else:
        target = GPUTarget("cuda", 90, 32)
    fn = ta._decode_kernel
    params = list(inspect.signature(fn.fn).parameters)
    consts = {"GROUP": 4, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "D_PAD": 128, "BLOCK_M": 16,
              "BLOCK_N": block_n, "NUM_SPLITS": 1, "DOT": tl.bfloat16, "PRECISION": "tf32",
              "KV_FMT": 0}
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
             "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32",
             "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "scale_log2": "fp32"}
    signature = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    # what a launch specializes: 16-aligned pointers and strides (head dim 128); not the
    # parameters the kernel excludes (`do_not_specialize*`) or the per-call scalars
    unaligned = {"seq_lens_ptr", "stride_bt", "scale_log2", "window"}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
             if p not in consts and p not in unaligned}
    out: dict = {"target": f"{target.backend} {target.arch}", "triton": triton.__version__,
                 "block_n": block_n, "stages": {}}
    for ns in stages:
        try:
            src = ASTSource(fn, signature, constexprs={(params.index(k),): v
                                                       for k, v in consts.items()},
                            attrs=attrs)
            ttgir = triton.compile(src, target=target,
                                   options={"num_warps": 4, "num_stages": ns}).asm["ttgir"]
        except Exception as exc:  # a Triton whose compile API differs: say so, go on
            out["stages"][str(ns)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        tile = rf"(\d+)x{block_n}x128xbf16"
        buffers = [int(m) for m in re.findall(r"local_alloc[^\n]*memdesc<" + tile, ttgir)]
        waits = [int(m) for m in re.findall(r"async_wait[^\n]*num = (\d+)", ttgir)]
        out["stages"][str(ns)] = {
            "kv_tile_buffers": buffers, "async_copies": ttgir.count("async_copy_global_to_local"),
            "async_wait_nums": waits,
            "double_buffered": bool(buffers) and min(buffers) >= 2}
    done = {ns: r for ns, r in out["stages"].items() if "error" not in r}
    groups = {"not pipelined (loads straight to registers)":
              [ns for ns, r in done.items() if not r["kv_tile_buffers"]],
              "one buffer per K/V tile (copy, wait for it, compute)":
              [ns for ns, r in done.items() if r["kv_tile_buffers"]
               and not r["double_buffered"]],
              "double-buffered (the next tile loads during the compute)":
              [ns for ns, r in done.items() if r["double_buffered"]]}
    out["finding"] = "; ".join(f"num_stages {', '.join(v)}: {k}" for k, v in groups.items()
                               if v) or "nothing compiled"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="compile the decode kernel; print its pipelining")
    ap.add_argument("--pipelining", required=True, help="comma-separated num_stages values")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    args = ap.parse_args(argv)
    stages = tuple(int(x) for x in args.pipelining.split(","))
    print(json.dumps(compile_report(stages, torch.device(args.device), args.block_n)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    raise SystemExit(main())
