"""Microbenchmark: paged prefill attention per layer, torch path against the native kernel.

    .venv/bin/python bench/attention_micro.py [--reps 20]

Runs the `torch` and `cpu` attention backends over the same paged batches (SmolLM2's
shape: 9 query heads, 3 KV heads, head dim 64, block size 16, float32): single prompts of
64-2,048 tokens, chunks after a cached prefix, and mixed batches of several chunks. Both
backends get identical q/k/v and cache contents; the script checks that their outputs agree
(max abs difference) before timing, prints ms per layer call and torch/native ratios, and
writes `bench/results/attention_micro-<date>.json`.
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
    layout = BatchLayout([n for _, n in shapes], [c + n for c, n in shapes], tables,
                         torch.tensor(slots), 0, BS)
    return layout, num_blocks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    spec = AttentionSpec(H, KVH, D, D ** -0.5)
    cpu = torch.device("cpu")
    native = get_backend("cpu")(spec, BS, torch.float32, cpu)
    if native._prefill_kernel is None:
        print("no native prefill kernel here (needs AVX2 + FMA)", file=sys.stderr)
        return 1
    backends = {"torch": get_backend("torch")(spec, BS, torch.float32, cpu), "native": native}
    rows = []
    for shapes in CASES:
        layout, num_blocks = batch(shapes)
        torch.manual_seed(0)
        t = sum(n for _, n in shapes)
        q, k, v = torch.randn(t, H, D), torch.randn(t, KVH, D), torch.randn(t, KVH, D)
        prefix = [torch.randn(num_blocks, KVH, BS, D) for _ in range(2)]
        res: dict = {"shapes": shapes}
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
        res["max_abs_diff"] = (outs["torch"] - outs["native"]).abs().max().item()
        res["torch_over_native"] = res["torch_ms"] / res["native_ms"]
        rows.append(res)
        print(f"{str(shapes):62.62s} torch {res['torch_ms']:7.2f} ms  native "
              f"{res['native_ms']:7.2f} ms  x{res['torch_over_native']:.2f}  "
              f"max|diff| {res['max_abs_diff']:.1e}", flush=True)
    date = dt.date.today().isoformat()
    out = Path(__file__).parent / "results" / f"attention_micro-{date}.json"
    out.write_text(json.dumps({"benchmark": "attention_micro", "date": date,
                               "threads": torch.get_num_threads(), "heads": H, "kv_heads": KVH,
                               "head_dim": D, "block_size": BS, "reps": args.reps,
                               "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
