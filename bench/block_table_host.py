"""Host time of one decode step's inputs: `ModelRunner.execute` up to and including the
Triton backend's `build_metadata` (block tables, slots, the staging buffer), without a model.

A batch of `--batch` decodes, each with `--blocks` blocks of context, all allocated through
the real `KVCacheManager`. The forward is cut off right after `build_metadata`, so what is
timed is exactly the per-step host work in front of the kernels. Runs on the CPU (Triton's
interpreter only has to import; no kernel launches). Prints the median over `--repeat`
steps in ms.

Side by side in the same run, the block-table part alone both ways: `lists`, what a step
did before the persistent table (each request's ids rebuilt from its `KVBlock` list, then
copied row by row into the metadata buffer), and `persistent` (`BlockTable.gather` + one
slice assignment). `--out` writes the raw JSON.

    .venv/bin/python bench/block_table_host.py --batch 256 --blocks 512 \
        --out bench/results/block_table_host-<date>.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported

import torch  # noqa: E402

from tandem.engine.attention.base import AttentionSpec, get_backend  # noqa: E402
from tandem.engine.kv_cache.manager import KVCacheManager  # noqa: E402
from tandem.engine.model_runner import ModelRunner  # noqa: E402
from tandem.engine.request import Request  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402


class _Cut(Exception):
    """Raised right after `build_metadata`: the forward is not timed."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the raw JSON here")
    args = ap.parse_args()
    bs, b, nb = args.block_size, args.batch, args.blocks
    kv = KVCacheManager(b * nb + 1, bs, enable_caching=False)
    scheduled = []
    for i in range(b):
        n = nb * bs - 1  # the prompt; its first output token fills the last block
        req = Request(f"r{i}", list(range(n)), SamplingParams(max_tokens=4), 4)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens = n
        req.append_output_token(1)
        assert kv.allocate_slots(req, 1) is not None
        scheduled.append(ScheduledRequest(req, n, 1))
    spec = AttentionSpec(num_heads=8, num_kv_heads=8, head_dim=64, scale=0.125)
    backend = get_backend("triton")(spec, bs, torch.float32, torch.device("cpu"))
    build = backend.build_metadata

    def cut(layout):  # noqa: ANN001, ANN202
        build(layout)
        raise _Cut

    backend.build_metadata = cut  # type: ignore[method-assign]
    runner = ModelRunner(None, backend, [], kv, None, torch.device("cpu"))  # type: ignore[arg-type]
    sched = SchedulerOutput(scheduled, [], b)
    rids = [s.request.request_id for s in scheduled]
    buf = np.zeros((b, nb), dtype=np.int32)

    def lists() -> None:  # the per-step work before the persistent table
        tables = [[blk.block_id for blk in kv._blocks[r]] for r in rids]
        for i, t in enumerate(tables):
            buf[i, : len(t)] = t
            buf[i, len(t):] = 0

    def persistent() -> None:
        table, _ = kv.block_table.gather(rids)
        buf[:, : table.shape[1]] = table

    def execute() -> None:
        with contextlib.suppress(_Cut):
            runner.execute(sched)

    lists()
    expect = buf.copy()
    persistent()
    assert (buf == expect).all(), "the two block-table paths disagree"
    result = {name: _median_ms(fn, args.repeat) for name, fn in
              (("lists", lists), ("persistent", persistent), ("execute", execute))}
    print(f"batch {b} x {nb} blocks, median of {args.repeat} steps: block tables "
          f"{result['lists']:.3f} ms as lists, {result['persistent']:.3f} ms persistent "
          f"({result['lists'] / result['persistent']:.1f}x); layout + triton metadata "
          f"{result['execute']:.3f} ms per step")
    if args.out:
        report = {
            "bench": "block_table_host", "command": "python bench/block_table_host.py "
            f"--batch {b} --blocks {nb} --block-size {bs} --repeat {args.repeat}",
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "torch": torch.__version__},
            "batch": b, "blocks": nb, "block_size": bs, "repeat": args.repeat,
            "median_ms": result, "lists_over_persistent": result["lists"] / result["persistent"],
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


def _median_ms(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat + 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


if __name__ == "__main__":
    main()
