"""Microbenchmark: weight-only INT8 / INT4 native kernels vs the float32 packed-panel GEMM.

    .venv/bin/python bench/quant_micro.py [--rows 1,16,256,1024] [--forward-rows 1,16]
                                          [--threads 2] [--reps 9] [--out PATH]

Per SmolLM2-135M layer shape (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
lm_head 49152x576) and row count M: best-of-reps ms of one call with cold weights (a 64 MB
buffer is read before every call, as a real forward streams its 135M weights from DRAM)
for float32 panels (`tandem_linear_packed_f32`), int8 per-channel and int4 g32 panels
(`tandem_quant_linear_i8/_i4`, auto path), with f32/int8 and f32/int4 ratios. Then one
whole forward's linears (30 x the four layers + the LM head, every weight distinct) at
`--forward-rows`. Random weights; JSON to bench/results/quant_micro.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.engine.model.cpu_linear import pack_panels
from tandem.engine.native import load_native
from tandem.engine.quant import cpu_kernels
from tandem.engine.quant.base import quantize_grouped

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
FORWARD = [*(["qkv", "o", "gate_up", "down"] * 30), "lm_head"]
FORMATS = ("f32", "int8", "int4")


def make(fmt: str, w: torch.Tensor, lib) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function x [M, K] -> y [M, N] over `w` stored in `fmt`."""
    n, k = w.shape
    if fmt == "f32":
        wp = pack_panels(w)

        def f32(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(x.shape[0], n)
            lib.tandem_linear_packed_f32(x.data_ptr(), wp.data_ptr(), None, y.data_ptr(),
                                         x.shape[0], n, k, torch.get_num_threads())
            return y

        return f32
    bits, g = (8, k) if fmt == "int8" else (4, 32)
    gw = quantize_grouped(w, bits, g, symmetric=bits == 8)
    p = cpu_kernels.panel_count(n)
    codes = torch.zeros(p, k if bits == 8 else k // 2, 16,
                        dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.zeros(p, k // g, 16, dtype=torch.float16)
    mins = None if gw.mins is None else torch.zeros_like(scales)
    cpu_kernels.write_panel_rows(codes, scales, mins, 0, gw)
    fn = cpu_kernels.int8_panel_linear if bits == 8 else cpu_kernels.int4_panel_linear
    return lambda x: fn(x, codes, scales, mins, g, None, n, lib)


def timed(fn: Callable[[], object], reps: int, flush: torch.Tensor | None) -> float:
    """Best of `reps` calls in ms (the machine is shared: the minimum is the least disturbed
    run; medians go to the JSON's `median_ms` entries too)."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.sum()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    timed.median = statistics.median(times) * 1e3
    return min(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,256,1024")
    ap.add_argument("--forward-rows", default="1,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/quant_micro.json"))
    args = ap.parse_args()
    lib = load_native()
    if lib is None or not lib.tandem_quant_linear_simd():
        print("native AVX2 kernels unavailable", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    flush = torch.ones(16 << 20)  # 64 MB, twice the L3
    result = {"machine": platform.processor() or platform.machine(),
              "threads": args.threads, "load_average_at_start": os.getloadavg()[0],
              "layers": [], "forward": []}
    print(f"{'layer':>8} {'M':>5} {'f32 ms':>8} {'int8 ms':>8} {'int4 ms':>8} "
          f"{'f32/int8':>9} {'f32/int4':>9}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        fns = {fmt: make(fmt, w, lib) for fmt in FORMATS}
        for m in (int(r) for r in args.rows.split(",") if r):
            x = torch.randn(m, k)
            reps = args.reps if m * n * k < 1e10 else 3
            ms, med = {}, {}
            for fmt, f in fns.items():
                ms[fmt] = timed(lambda f=f, x=x: f(x), reps, flush)
                med[fmt] = timed.median
            result["layers"].append({"layer": name, "n": n, "k": k, "rows": m,
                                     **{f"{f}_ms": v for f, v in ms.items()},
                                     **{f"{f}_median_ms": v for f, v in med.items()}})
            print(f"{name:>8} {m:>5} {ms['f32']:8.3f} {ms['int8']:8.3f} {ms['int4']:8.3f} "
                  f"{ms['f32'] / ms['int8']:9.2f} {ms['f32'] / ms['int4']:9.2f}")
    weights = {name: torch.randn(n, k) * 0.05 for name, (n, k) in SHAPES.items()}
    # every format's forward resident at once (760 MB), timed in turns so that the
    # machine's other load falls on all three alike
    forwards = {fmt: [(make(fmt, weights[name], lib), SHAPES[name][1]) for name in FORWARD]
                for fmt in FORMATS}
    for m in (int(r) for r in args.forward_rows.split(",") if r):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        for _ in range(8):  # the first round is a warm-up
            for fmt, layers in forwards.items():
                t = time.perf_counter()
                for f, k in layers:
                    f(xs[k])
                times[fmt].append((time.perf_counter() - t) * 1e3)
        for fmt in FORMATS:
            result["forward"].append({"format": fmt, "rows": m, "ms": min(times[fmt][1:]),
                                      "median_ms": statistics.median(times[fmt][1:])})
    print(f"\nforward (121 linears), ms: {'M':>5} " + " ".join(f"{f:>8}" for f in FORMATS))
    for m in (int(r) for r in args.forward_rows.split(",") if r):
        row = {e["format"]: e["ms"] for e in result["forward"] if e["rows"] == m}
        print(f"{'':>27}{m:>5} " + " ".join(f"{row[f]:8.2f}" for f in FORMATS)
              + f"   f32/int8 {row['f32'] / row['int8']:.2f}  f32/int4 "
              f"{row['f32'] / row['int4']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
