"""Microbenchmark: one forward's worth of SmolLM2-135M linear layers, by row count.

    .venv/bin/python bench/linear_micro.py [--rows 1,4,16,24,48,96,192,384,1024] [--reps 5]
                                           [--bf16] [--out PATH]

Times, per row count M, all 121 linears of one forward (30 x qkv/o/gate_up/down + the LM
head; random float32 weights, 540 MB, so they stream from DRAM like the real model's) with:
oneDNN pre-packed weights (the fallback path), `F.linear` on plain weights (MKL), and the
native packed-panel kernel (`tandem_linear_packed_f32`, the default). `--bf16` adds the
same linears in bfloat16 (where oneDNN has bfloat16 kernels): oneDNN's packed weights (what
the engine uses on AMX CPUs), `F.linear`, and the native pair panels
(`tandem_linear_bf16`, what it uses with AVX512-BF16 and no AMX; where built). Prints ms
per forward, the native kernels' GFLOPS, and oneDNN/native ratios; JSON goes to
`bench/results/linear_micro-<date>.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.engine.model.cpu_linear import pack_bf16_panels, pack_panels
from tandem.engine.native import load_native

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _onednn_and_plain(weights: list[torch.Tensor]) -> tuple[Callable[[dict], None],
                                                               Callable[[dict], None]]:
    """One forward's linears over `weights` (their dtype): oneDNN's pre-packed layout, and
    `F.linear` on the plain weights; each takes {in_features: x}."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]

    def onednn(xs: dict) -> None:
        for p, w in zip(packed, weights, strict=True):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def plain(xs: dict) -> None:
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    return onednn, plain


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,24,48,96,192,384,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bf16", action="store_true", help="also time the bfloat16 linears")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lib = load_native()
    if lib is None or not lib.tandem_linear_simd():
        print("native kernels unavailable", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    panels = [pack_panels(w) for w in weights]
    flops_per_row = sum(2 * w.numel() for w in weights)
    threads = torch.get_num_threads()

    def native(xs: dict) -> None:
        for w, wp in zip(weights, panels, strict=True):
            n, k = w.shape
            x = xs[k]
            y = torch.empty(x.shape[0], n)
            lib.tandem_linear_packed_f32(x.data_ptr(), wp.data_ptr(), None, y.data_ptr(),
                                         x.shape[0], n, k, threads)

    onednn, plain = _onednn_and_plain(weights)
    modes = [("onednn", onednn, torch.float32), ("plain", plain, torch.float32),
             ("native", native, torch.float32)]
    if args.bf16:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print("oneDNN has no bfloat16 kernels on this CPU", file=sys.stderr)
            return 1
        onednn16, plain16 = _onednn_and_plain([w.to(torch.bfloat16) for w in weights])
        modes += [("bf16_onednn", onednn16, torch.bfloat16),
                  ("bf16_plain", plain16, torch.bfloat16)]
        if lib.tandem_linear_bf16_simd() >= 2:
            pairs = [pack_bf16_panels(w.to(torch.bfloat16)) for w in weights]

            def native16(xs: dict) -> None:
                for w, wp in zip(weights, pairs, strict=True):
                    n, k = w.shape
                    x = xs[k]
                    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
                    lib.tandem_linear_bf16(x.data_ptr(), wp.data_ptr(), None, y.data_ptr(),
                                           x.shape[0], n, k, k, threads)

            modes.append(("bf16_native", native16, torch.bfloat16))
    has16 = any(name == "bf16_native" for name, *_ in modes)
    rows = []
    print(f"{'M':>5} {'onednn ms':>10} {'F.linear ms':>12} {'native ms':>10} {'GFLOPS':>7} "
          f"{'onednn/native':>14}" + (f" {'bf16 onednn':>12} {'bf16 F.linear':>14}"
                                      if args.bf16 else "")
          + (f" {'bf16 native':>12} {'GFLOPS':>7} {'onednn/native':>14}" if has16 else ""))
    for m in (int(r) for r in args.rows.split(",")):
        res = {}
        for name, fn, dtype in modes:
            xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
            fn(xs)  # warm-up
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                fn(xs)
                times.append(time.perf_counter() - t)
            res[name] = statistics.median(times)
        gflops = flops_per_row * m / res["native"] / 1e9
        rows.append({"rows": m, **{f"{k}_ms": v * 1e3 for k, v in res.items()},
                     "native_gflops": gflops})
        print(f"{m:>5} {res['onednn'] * 1e3:10.1f} {res['plain'] * 1e3:12.1f} "
              f"{res['native'] * 1e3:10.1f} {gflops:7.1f} {res['onednn'] / res['native']:14.2f}"
              + (f" {res['bf16_onednn'] * 1e3:12.1f} {res['bf16_plain'] * 1e3:14.1f}"
                 if args.bf16 else "")
              + (f" {res['bf16_native'] * 1e3:12.1f} "
                 f"{flops_per_row * m / res['bf16_native'] / 1e9:7.1f} "
                 f"{res['bf16_onednn'] / res['bf16_native']:14.2f}" if has16 else ""))
    out = args.out or Path(__file__).resolve().parent / "results" / \
        f"linear_micro-{dt.date.today().isoformat()}.json"
    out.write_text(json.dumps({"date": dt.date.today().isoformat(), "threads": threads,
                               "flops_per_row": flops_per_row, "bf16": args.bf16,
                               "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
