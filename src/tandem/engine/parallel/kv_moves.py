"""KV pages between tensor-parallel ranks, for P/D transfers (the wire always carries all
of a page's KV heads, in the model's order, whatever either side's TP size).

- `gather_pages` (every rank, on a KV_GATHER plan): rank 0 receives each rank's heads of
  `block_ids`, layer by layer, and assembles `[2, n, KVH, bs, row]` per layer.
- `scatter_pages` (every rank, on a KV_SCATTER plan): rank 0 hands each rank the slice of
  its KV heads of full pages, which the rank writes into `block_ids` of its cache.

A rank's heads are `TPPlan.kv_head_start` + its `num_kv_heads` (replicated heads arrive
from several ranks, identical). Pages travel as raw bytes (any cache dtype) over the gloo
control group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.engine.kv_cache.pages import Caches, block_index, gather_layer, scatter_layer
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.parallel.tp import TPPlan


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def gather_pages(ctrl: dist.Backend, caches: Caches, block_ids: list[int],
                 arch: ModelArchConfig | None = None, world: int = 1) -> list[torch.Tensor]:
    """Rank 0 (`arch` and `world` given): the full pages of every layer; other ranks: []."""
    root = arch is not None
    plans = [TPPlan.build(arch, r, world) for r in range(world)] if root else []
    full = []
    index = block_index(block_ids, caches[0][0].device)
    for layer in range(len(caches)):
        mine = gather_layer(caches, layer, block_ids, index).cpu()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if not root:
            ctrl.gather([], [_bytes(mine)], opts).wait()
            continue
        parts = [torch.empty_like(_bytes(mine)) for _ in range(world)]
        ctrl.gather([parts], [_bytes(mine)], opts).wait()
        out = mine.new_empty((2, len(block_ids), arch.num_kv_heads, *mine.shape[3:]))
        for plan, raw in zip(plans, parts, strict=True):
            heads = raw.view(mine.dtype).view(mine.shape)
            out[:, :, plan.kv_head_start:plan.kv_head_start + plan.num_kv_heads] = heads
        full.append(out)
    return full


def scatter_pages(ctrl: dist.Backend, caches: Caches, block_ids: list[int],
                  full: list[torch.Tensor] | None = None, arch: ModelArchConfig | None = None,
                  world: int = 1) -> None:
    """Rank 0 passes `full` (`[2, n, KVH, bs, row]` per layer), `arch` and `world`."""
    k0 = caches[0][0]
    shape = (2, len(block_ids), *k0.shape[1:])  # this rank's heads
    plans = [TPPlan.build(arch, r, world) for r in range(world)] if full is not None else []
    index = block_index(block_ids, k0.device)
    for layer in range(len(caches)):
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        mine = torch.empty(shape, dtype=k0.dtype)
        if full is None:
            ctrl.scatter([_bytes(mine)], [], opts).wait()
            recv = mine
        else:
            slices = []
            for plan in plans:
                part = full[layer][:, :, plan.kv_head_start:
                                   plan.kv_head_start + plan.num_kv_heads]
                slices.append(_bytes(part.to(k0.dtype).cpu()))
            out = torch.empty_like(slices[0])
            ctrl.scatter([out], [slices], opts).wait()
            recv = out.view(k0.dtype).view(shape)
        scatter_layer(caches, layer, block_ids, recv, index)
