"""Microbenchmark: paged attention per layer, torch path against the native kernels.

    .venv/bin/python bench/attention_micro.py [--reps 20] [--dtype float32|bfloat16]
        [--out PATH]

Runs the `torch` and `cpu` attention backends over the same paged batches (SmolLM2's
shape: 9 query heads, 3 KV heads, head dim 64, block size 16, in `--dtype`): prefill —
single prompts of 64-2,048 tokens, chunks after a cached prefix, and mixed batches of
several chunks — and decode — batches of 1-96 sequences with 256-2,048-token contexts
(each layer call reads every context's K/V once: the decode rows report GB/s of cache
read). Both backends get identical q/k/v and cache contents; the script checks that their
outputs agree (max abs difference) before timing, prints ms per layer call and
torch/native ratios, and writes `bench/results/attention_micro-<date>.json` (or `--out`).
To measure a change, run it from both trees (`PYTHONPATH=../tandem-parent/src`) in turns.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path

import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, get_backend

H, KVH, D, BS = 9, 3, 64, 16
# (cached prefix, new tokens) per sequence
CASES = [[(0, n)] for n in (64, 128, 256, 512, 1024, 2048)] + [
    [(0, 400)] * 5, [(512, 512)], [(1500, 548)],
    [(0, 239), (0, 211), (0, 504), (0, 492), (0, 454), (100, 148)],
]
# decode batches: (context before the new token, 1) per sequence
DECODE_CASES = [[(2047, 1)], [(255, 1)] * 24, [(511, 1)] * 24, [(511, 1)] * 64,
                [(799, 1)] * 96]


def batch(shapes: list[tuple[int, int]]) -> tuple[BatchLayout, int]:
    rng = random.Random(0)
    num_blocks = sum(-(-(c + n) // BS) for c, n in shapes)
    free = list(range(num_blocks))
    rng.shuffle(free)
    slots, tables = [], []
    for cached, new in shapes:
        table = [free.pop() for _ in range(-(-(cached + new) // BS))]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(cached, cached + new)]
    decodes = sum(1 for _, n in shapes if n == 1)  # decode cases are all decodes, sorted
    layout = BatchLayout([n for _, n in shapes], [c + n for c, n in shapes], tables,
                         torch.tensor(slots), decodes, BS)
    return layout, num_blocks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    spec = AttentionSpec(H, KVH, D, D ** -0.5)
    cpu = torch.device("cpu")
    native = get_backend("cpu")(spec, BS, dtype, cpu)
    if native._prefill_kernel is None:
        print("no native prefill kernel here (needs AVX2 + FMA)", file=sys.stderr)
        return 1
    backends = {"torch": get_backend("torch")(spec, BS, dtype, cpu), "native": native}
    rows = []
    for shapes in CASES + DECODE_CASES:
        layout, num_blocks = batch(shapes)
        torch.manual_seed(0)
        t = sum(n for _, n in shapes)
        q, k, v = (torch.randn(t, h, D).to(dtype) for h in (H, KVH, KVH))
        prefix = [torch.randn(num_blocks, KVH, BS, D).to(dtype) for _ in range(2)]
        res: dict = {"shapes": shapes, "kind": "decode" if layout.num_decodes else "prefill"}
        outs = {}
        for name, be in backends.items():
            cache = be.allocate_kv_cache(num_blocks)
            cache[0].copy_(prefix[0])
            cache[1].copy_(prefix[1])
            meta = be.build_metadata(layout)
            outs[name] = be.forward(q, k, v, cache, meta)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                be.forward(q, k, v, cache, meta)
                times.append(time.perf_counter() - t0)
            times.sort()
            res[f"{name}_ms"] = times[len(times) // 2] * 1e3
        res["max_abs_diff"] = (outs["torch"].float() - outs["native"].float()).abs().max().item()
        res["torch_over_native"] = res["torch_ms"] / res["native_ms"]
        label = str(shapes)
        if layout.num_decodes:
            read = sum(c + n for c, n in shapes) * KVH * D * 2 * prefix[0].element_size()
            res["native_read_gbps"] = read / res["native_ms"] / 1e6
            label = f"decode {len(shapes)} x ctx {shapes[0][0] + 1}"
        rows.append(res)
        print(f"{label:62.62s} torch {res['torch_ms']:7.2f} ms  native "
              f"{res['native_ms']:7.2f} ms  x{res['torch_over_native']:.2f}  "
              f"max|diff| {res['max_abs_diff']:.1e}"
              + (f"  {res['native_read_gbps']:.1f} GB/s" if layout.num_decodes else ""),
              flush=True)
    date = dt.date.today().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"attention_micro-{date}.json"
    out.write_text(json.dumps({"benchmark": "attention_micro", "date": date,
                               "threads": torch.get_num_threads(), "heads": H, "kv_heads": KVH,
                               "head_dim": D, "block_size": BS, "reps": args.reps,
                               "dtype": args.dtype, "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
