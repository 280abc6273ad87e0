"""Microbenchmark: float32 packed panels vs weight-only int8 vs W8A8 int8 GEMM, per shape
and row count, on SmolLM2-135M's linear shapes.

    .venv/bin/python bench/w8a8_micro.py [--rows 1,16,64,256,1024] [--reps 5]
        [--shapes 960x576,...] [--out bench/results/w8a8_micro.json]

Per (N, K) and M: `tandem_linear_packed_f32` (float32 panels, the default CPU path),
`cpu_kernels.int8_panel_linear` (int8 codes + per-channel fp16 scales, activations float)
and `w8a8.w8a8_panel_linear` (per-token int8 activations, int8 x int8 -> int32) on the
same int8 panels. Each shape gets enough random weight copies that the float32 ones
exceed 64 MiB (twice this machine's L3), cycled so weights stream from DRAM like a real
forward's; a time is the fastest single call over `reps` passes over the copies (the
machine is shared: the min is the least disturbed call, each reading cold weights).
Prints ms and the ratios float/int8, float/w8a8, int8/w8a8 (> 1: the right-hand kernel is
faster), then the forward-weighted totals (30 x each layer shape + the LM head); JSON goes to
`bench/results/w8a8_micro.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

from tandem.engine.model.cpu_linear import pack_panels
from tandem.engine.native import load_native
from tandem.engine.quant.base import quantize_grouped
from tandem.engine.quant.cpu_kernels import int8_panel_linear, write_panel_rows
from tandem.engine.quant.w8a8 import w8a8_panel_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
COUNT = {(49152, 576): 1}  # per forward; the others 30 (SmolLM2-135M's layers)
STREAM_BYTES = 64 << 20


def _int8_panels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    p = (n + 15) // 16
    codes = torch.zeros(p, k, 16, dtype=torch.int8)
    scales = torch.zeros(p, 1, 16, dtype=torch.float16)
    write_panel_rows(codes, scales, None, 0, quantize_grouped(w, 8, k, symmetric=True))
    return codes, scales


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="N x K list")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"
                                         / "w8a8_micro.json"))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    lib = load_native()
    if lib is None or not lib.tandem_linear_simd():
        print("native kernels unavailable", file=sys.stderr)
        return 1
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"w8a8 path {lib.tandem_w8a8_simd()} (3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2), "
          f"{threads} threads")
    print(f"{'N x K':>12} {'M':>5} {'f32 ms':>9} {'int8 ms':>9} {'w8a8 ms':>9} "
          f"{'f32/int8':>9} {'f32/w8a8':>9} {'int8/w8a8':>10}")
    for n, k in shapes:
        copies = max(1, -(-STREAM_BYTES // (4 * n * k)))
        weights = [torch.randn(n, k) for _ in range(copies)]
        floats = [pack_panels(w) for w in weights]
        ints = [_int8_panels(w) for w in weights]
        del weights

        def f32(x: torch.Tensor, i: int, n: int = n, k: int = k, floats: list = floats) -> None:
            y = torch.empty(x.shape[0], n)
            lib.tandem_linear_packed_f32(x.data_ptr(), floats[i].data_ptr(), None,
                                         y.data_ptr(), x.shape[0], n, k, threads)

        def int8(x: torch.Tensor, i: int, n: int = n, k: int = k, ints: list = ints) -> None:
            int8_panel_linear(x, *ints[i], None, k, None, n, lib)

        def w8a8(x: torch.Tensor, i: int, n: int = n, ints: list = ints) -> None:
            w8a8_panel_linear(x, *ints[i], None, n, lib)

        for m in rows:
            x = torch.randn(m, k)
            best = {"f32": float("inf"), "int8": float("inf"), "w8a8": float("inf")}
            fns = {"f32": f32, "int8": int8, "w8a8": w8a8}
            for fn in fns.values():
                fn(x, 0)  # warm-up
            for _ in range(args.reps):  # interleaved: load bursts hit every kernel alike
                for name, fn in fns.items():
                    for i in range(copies):
                        t = time.perf_counter()
                        fn(x, i)
                        best[name] = min(best[name], time.perf_counter() - t)
            res = {"n": n, "k": k, "rows": m, **{f"{a}_ms": b * 1e3 for a, b in best.items()},
                   "f32_over_int8": best["f32"] / best["int8"],
                   "f32_over_w8a8": best["f32"] / best["w8a8"],
                   "int8_over_w8a8": best["int8"] / best["w8a8"]}
            results.append(res)
            print(f"{f'{n}x{k}':>12} {m:>5} {res['f32_ms']:9.3f} {res['int8_ms']:9.3f} "
                  f"{res['w8a8_ms']:9.3f} {res['f32_over_int8']:9.2f} "
                  f"{res['f32_over_w8a8']:9.2f} {res['int8_over_w8a8']:10.2f}")
    totals = []
    print("forward (30 x layers + LM head):")
    for m in rows:
        tot = {name: sum(r[f"{name}_ms"] * COUNT.get((r["n"], r["k"]), 30)
                         for r in results if r["rows"] == m) for name in ("f32", "int8", "w8a8")}
        totals.append({"rows": m, **{f"{a}_ms": b for a, b in tot.items()},
                       "int8_over_w8a8": tot["int8"] / tot["w8a8"]})
        print(f"{m:>5} f32 {tot['f32']:8.1f} ms  int8 {tot['int8']:8.1f} ms  "
              f"w8a8 {tot['w8a8']:8.1f} ms  f32/int8 {tot['f32'] / tot['int8']:.2f}  "
              f"f32/w8a8 {tot['f32'] / tot['w8a8']:.2f}  int8/w8a8 "
              f"{tot['int8'] / tot['w8a8']:.2f}")
    out = Path(args.out)
    out.write_text(json.dumps({
        "date": dt.date.today().isoformat(), "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "w8a8_simd": int(lib.tandem_w8a8_simd()), "reps": args.reps, "timing": "min",
        "results": results, "forward": totals}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
