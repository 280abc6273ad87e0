"""Mixture-of-experts MLP throughput: the grouped (fused) path against transformers'
per-expert loop and against a dense MLP of the same active parameters, in one run.

    .venv/bin/python bench/moe.py [--experts 64 --top-k 8 --hidden 1024 --inter 384]
        [--batches 1,16] [--reps 7] [--threads 1,2] [--device cpu|cuda]
        [--dtype float32|bfloat16]

One MoE layer (router + experts, random weights; the default shape is Qwen3-30B-A3B's
expert layout at half its width: 64 experts of 384, top-8, hidden 1024) is run on a batch of
B tokens (B = 1, 16: decode steps of 1 and 16 sequences) by:
- `fused`: `FusedMoE.forward` (route; one sort of the B*k assignments; per expert, its
  contiguous rows through gate_up / SiLU-and-mul / down; weighted scatter-add). On CUDA
  also `fused-triton` (the two grouped-GEMM kernels of `kernels/triton_moe`);
- `loop`: the same routing, then transformers' loop (`moe.loop_experts`: per expert hit,
  one-hot mask, index, compute, `index_add_`);
- `dense`: one SwiGLU MLP of intermediate k * inter (what each token multiplies by), no
  router;
- on the CPU in float32, also `fused-packed` and `dense-packed`: the same with every
  weight in the native packed panels the engine serves float32 CPU models with
  (`FusedMoE.convert_experts`, `quant.apply.convert_linears`).
Prints tokens/s of each and the ratios fused/loop and fused/dense; JSON goes to
`bench/results/moe-<date>.json` (with the machine, its load and the shape).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model.cpu_linear import packing_available
from tandem.engine.model.moe import FusedMoE, MoESpec, loop_experts, route
from tandem.engine.model.ops import Ops
from tandem.engine.quant.apply import convert_linears
from tandem.engine.quant.float_methods import PackedMethod

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))


def _time_all(fns: dict[str, Callable[[], object]], reps: int, sync: Callable[[], None]
              ) -> dict[str, float]:
    """Seconds of one call of each fn: the best of `reps` timed runs (each of enough calls to
    last ~50 ms), the fns interleaved run by run so that a busy host's slow spells spread
    over all of them, after a warm-up."""
    calls = {}
    for name, fn in fns.items():
        fn()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        calls[name] = max(1, int(0.05 / max(time.perf_counter() - t, 1e-6)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t) / calls[name])
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", default=None,
                    help="torch thread counts to run, e.g. 1,2 (default: torch's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/moe-<date>)")
    args = ap.parse_args()
    from offline_throughput import machine_info

    machine = machine_info()  # (its load average: at the start)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    torch.manual_seed(0)
    spec = MoESpec(e, k, h, i)
    ops = Ops(device=device, dtype=dtype)
    with torch.no_grad():
        moe = FusedMoE(spec, ops=ops, backend="torch").to(device=device, dtype=dtype)
        for p in moe.parameters():
            p.normal_(0, h ** -0.5)
        tri = None
        if device.type == "cuda":
            tri = FusedMoE(spec, ops=ops, backend="triton").to(device=device, dtype=dtype)
            tri.load_state_dict(moe.state_dict())
        dense_up = torch.randn(2 * k * i, h, device=device, dtype=dtype) * h ** -0.5
        dense_down = torch.randn(h, k * i, device=device, dtype=dtype) * (k * i) ** -0.5
        packed = native = None
        if ops.lib is not None and packing_available(dtype, device, ops.lib):
            def method() -> PackedMethod:
                return PackedMethod(device=device, native=ops.lib)

            packed = FusedMoE(spec, ops=ops, backend="torch")
            packed.load_state_dict(moe.state_dict())
            packed.convert_experts(method())
            native = nn.Sequential(nn.Linear(h, 2 * k * i, bias=False),
                                   nn.Linear(k * i, h, bias=False))
            native[0].weight.copy_(dense_up)
            native[1].weight.copy_(dense_down)
            convert_linears(native, method)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def loop(x: torch.Tensor) -> torch.Tensor:
        w, ids = route(moe.gate(x), k, True)
        return loop_experts(x, moe.w13, moe.w2, w, ids)

    def dense(x: torch.Tensor) -> torch.Tensor:
        return F.linear(ops.silu_mul(F.linear(x, dense_up)), dense_down)

    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fused": moe, "loop": loop,
                                                                "dense": dense}
    if tri is not None:
        paths["fused-triton"] = tri
    if packed is not None:  # the engine's CPU layout: native panels for both
        paths["fused-packed"] = packed
        paths["dense-packed"] = lambda x: native[1](ops.silu_mul(native[0](x)))
    rows = []
    thread_counts = ([int(t) for t in args.threads.split(",")] if args.threads
                     else [torch.get_num_threads()])
    print(f"MoE layer: {e} experts x {i}, top-{k}, hidden {h}, {dtype}, {device}; "
          f"dense: inter {k * i}")
    print(f"{'thr':>3} {'batch':>5} " + " ".join(f"{n + ' tok/s':>17}" for n in paths)
          + f" {'fused/loop':>10} {'fused/dense':>11}")
    for threads, b in ((t, int(s)) for t in thread_counts for s in args.batches.split(",")):
        torch.set_num_threads(threads)
        x = torch.randn(b, h, device=device, dtype=dtype)
        with torch.no_grad():
            want = loop(x)
            for name, fn in paths.items():  # the paths agree before they are timed
                if not name.startswith("dense"):
                    torch.testing.assert_close(fn(x).float(), want.float(), rtol=2e-2,
                                               atol=2e-2)
            secs = _time_all({name: (lambda fn=fn, x=x: fn(x)) for name, fn in paths.items()},
                             args.reps, sync)
        tps = {name: b / s for name, s in secs.items()}
        row = {"threads": threads, "batch": b,
               **{f"{n}_tok_s": round(v, 1) for n, v in tps.items()},
               **{f"{n}_ms": round(s * 1e3, 4) for n, s in secs.items()},
               "fused_over_loop": round(tps["fused"] / tps["loop"], 3),
               "fused_over_dense": round(tps["fused"] / tps["dense"], 3)}
        if tri is not None:
            row["triton_over_loop"] = round(tps["fused-triton"] / tps["loop"], 3)
        if packed is not None:
            row["packed_fused_over_dense"] = round(tps["fused-packed"] / tps["dense-packed"],
                                                   3)
        rows.append(row)
        print(f"{threads:>3} {b:>5} " + " ".join(f"{tps[n]:17.1f}" for n in paths)
              + f" {row['fused_over_loop']:10.2f} {row['fused_over_dense']:11.2f}")
    today = dt.date.today().isoformat()
    out = Path(args.out) if args.out else BENCH_DIR / "results" / f"moe-{today}.json"
    res = {"date": today, "machine": machine, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "loadavg_at_end": [round(v, 2) for v in os.getloadavg()],
           "shape": {"experts": e, "top_k": k, "hidden": h, "moe_inter": i,
                     "dense_inter": k * i, "dtype": str(dtype).removeprefix("torch.")},
           "measured": "one MoE MLP layer (router + experts) on B tokens, best of "
                       f"{args.reps} interleaved timed runs; tokens/s = B / seconds per call",
           "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
