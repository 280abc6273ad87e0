"""Microbenchmark: paged decode attention per layer over a float32, fp8 or int8 KV cache.

    .venv/bin/python bench/kv_quant_attention.py [--reps 30] [--batch 16] [--threads N]

The `cpu` attention backend (native kernels) on SmolLM2's shape (9 query heads, 3 KV heads,
head dim 64, block size 16, float32 model) for decode batches of `--batch` sequences at
contexts 512 and 2,048, with the KV cache as float32 rows (256 bytes per token and KV head)
or quantized (66 bytes: 64 codes + a float16 scale, in pages of a block's codes then its
scales). Times, as medians (and minima, the steadier figure on a shared machine; and the
median thread CPU time, the steadiest with `--threads 1`) over `--reps`:
`attend_ms`, the decode kernel alone (it reads the context), and `forward_ms`, the whole
layer call (quantizing and writing the new K/V, then attending). The quantized outputs are
checked against the float cache's (max abs difference) and the torch backend's on the same
quantized cache. Writes `bench/results/kv_quant_attention.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import time
from pathlib import Path

import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, get_backend
from tandem.engine.kv_cache.quant import quantize_pages

H, KVH, D, BS = 9, 3, 64, 16
CONTEXTS = (512, 2048)
FORMATS = ("auto", "fp8", "int8")


def decode_layout(batch: int, context: int) -> tuple[BatchLayout, int]:
    """`batch` decodes of `context` tokens each (the new one included), shuffled blocks."""
    per_seq = -(-context // BS)
    free = list(range(batch * per_seq))
    random.Random(0).shuffle(free)
    tables = [free[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    slots = [t[(context - 1) // BS] * BS + (context - 1) % BS for t in tables]
    return BatchLayout([1] * batch, [context] * batch, tables, torch.tensor(slots), batch,
                       BS), batch * per_seq


def timed_ms(fn, reps: int) -> tuple[float, float, float]:
    """(median wall, minimum wall, median thread CPU) milliseconds of `fn()` over `reps`
    calls after one warm-up. With one thread the kernels run on the calling thread, so its
    CPU time excludes the time other processes hold the core."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    wall.sort()
    cpu.sort()
    return wall[reps // 2] * 1e3, wall[0] * 1e3, cpu[reps // 2] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = AttentionSpec(H, KVH, D, D ** -0.5)
    cpu = torch.device("cpu")
    rows = []
    for context in CONTEXTS:
        layout, num_blocks = decode_layout(args.batch, context)
        torch.manual_seed(0)
        q = torch.randn(args.batch, H, D)
        k, v = torch.randn(args.batch, KVH, D), torch.randn(args.batch, KVH, D)
        kv = [torch.randn(num_blocks, KVH, BS, D) * 2 for _ in range(2)]
        outs = {}
        for name in FORMATS:
            be = get_backend("cpu")(spec, BS, torch.float32, cpu, name)
            cache = be.allocate_kv_cache(num_blocks)
            for c, x in zip(cache, kv, strict=True):
                c.copy_(x if name == "auto" else quantize_pages(x, name))
            meta = be.build_metadata(layout)
            outs[name] = be.forward(q, k, v, cache, meta)
            out = torch.empty_like(q)
            res = {"context": context, "batch": args.batch, "kv_cache_dtype": name,
                   "kv_bytes_per_layer": 2 * cache[0].numel() * cache[0].element_size()}
            res["attend_ms"], res["attend_min_ms"], res["attend_cpu_ms"] = timed_ms(
                lambda be=be, c=cache, m=meta, o=out, q=q: be.decode(q, c, m, o), args.reps)
            res["forward_ms"], res["forward_min_ms"], res["forward_cpu_ms"] = timed_ms(
                lambda be=be, c=cache, m=meta, q=q, k=k, v=v: be.forward(q, k, v, c, m),
                args.reps)
            if name != "auto":
                ref = get_backend("torch")(spec, BS, torch.float32, cpu, name)
                torch_out = ref.forward(q, k, v, cache, ref.build_metadata(layout))
                res["max_abs_diff_vs_torch"] = (torch_out - outs[name]).abs().max().item()
                res["max_abs_diff_vs_float"] = (outs["auto"] - outs[name]).abs().max().item()
            rows.append(res)
            print(f"context {context:5d} batch {args.batch} {name:5s} attend "
                  f"{res['attend_ms']:7.3f} ms (min {res['attend_min_ms']:7.3f}, cpu "
                  f"{res['attend_cpu_ms']:7.3f})  forward {res['forward_ms']:7.3f} ms (min "
                  f"{res['forward_min_ms']:7.3f}, cpu {res['forward_cpu_ms']:7.3f})  "
                  f"KV {res['kv_bytes_per_layer'] / 2**20:6.1f} MiB", flush=True)
    base = {r["context"]: r for r in rows if r["kv_cache_dtype"] == "auto"}
    for r in rows:
        r["attend_speedup_vs_float"] = base[r["context"]]["attend_ms"] / r["attend_ms"]
        r["attend_min_speedup_vs_float"] = (base[r["context"]]["attend_min_ms"]
                                            / r["attend_min_ms"])
        r["attend_cpu_speedup_vs_float"] = (base[r["context"]]["attend_cpu_ms"]
                                            / r["attend_cpu_ms"])
    out = Path(__file__).parent / "results" / "kv_quant_attention.json"
    out.write_text(json.dumps({"benchmark": "kv_quant_attention",
                               "date": dt.date.today().isoformat(),
                               "threads": torch.get_num_threads(),
                               "load_average": list(os.getloadavg()), "heads": H,
                               "kv_heads": KVH, "head_dim": D, "block_size": BS,
                               "reps": args.reps, "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
