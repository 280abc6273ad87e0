"""KV pages between tensor-parallel ranks, for P/D transfers (the wire always carries all
of a page's KV heads, in the model's order, whatever either side's TP size).

- `gather_pages` (every rank, on a KV_GATHER plan): rank 0 receives each rank's heads of
  `block_ids`, layer by layer, and assembles `[2, n, KVH, bs, row]` per layer.
- `LayerGather` (every rank, in a FORWARD plan with `save_layers`): the same for one layer,
  called from the forward's layer hook right after the layer's K/V are written, so rank 0
  hands a saved prompt's full pages on while later layers compute.
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


def _head_plans(arch: ModelArchConfig, world: int) -> list[TPPlan]:
    return [TPPlan.build(arch, r, world) for r in range(world)]


def _gather_layer(ctrl: dist.Backend, caches: Caches, layer: int, block_ids: list[int],
                  index: torch.Tensor, plans: list[TPPlan] | None,
                  num_kv_heads: int) -> torch.Tensor | None:
    """One gloo gather of this rank's heads of `block_ids` in `layer`: rank 0 (`plans`
    given) gets `[2, n, KVH, bs, row]` on the host, the others None."""
    mine = gather_layer(caches, layer, block_ids, index).cpu()
    opts = dist.GatherOptions()
    opts.rootRank = 0
    if plans is None:
        ctrl.gather([], [_bytes(mine)], opts).wait()
        return None
    parts = [torch.empty_like(_bytes(mine)) for _ in plans]
    ctrl.gather([parts], [_bytes(mine)], opts).wait()
    out = mine.new_empty((2, len(block_ids), num_kv_heads, *mine.shape[3:]))
    for plan, raw in zip(plans, parts, strict=True):
        heads = raw.view(mine.dtype).view(mine.shape)
        out[:, :, plan.kv_head_start:plan.kv_head_start + plan.num_kv_heads] = heads
    return out


def gather_pages(ctrl: dist.Backend, caches: Caches, block_ids: list[int],
                 arch: ModelArchConfig | None = None, world: int = 1) -> list[torch.Tensor]:
    """Rank 0 (`arch` and `world` given): the full pages of every layer; other ranks: []."""
    plans = _head_plans(arch, world) if arch is not None else None
    kvh = arch.num_kv_heads if arch is not None else 0
    index = block_index(block_ids, caches[0][0].device)
    full = [_gather_layer(ctrl, caches, layer, block_ids, index, plans, kvh)
            for layer in range(len(caches))]
    return [f for f in full if f is not None]


class LayerGather:
    """One layer's pages of `block_ids` from every rank to rank 0, per call: `gather(layer)`
    on every rank in the same order (the forward's layer hook); rank 0 (`arch` and `world`
    given) gets `[2, n, KVH, bs, row]` on the host, the others None."""

    def __init__(self, ctrl: dist.Backend, caches: Caches, block_ids: list[int],
                 arch: ModelArchConfig | None = None, world: int = 1) -> None:
        self.ctrl, self.caches, self.block_ids = ctrl, caches, block_ids
        self.index = block_index(block_ids, caches[0][0].device)
        self.plans = _head_plans(arch, world) if arch is not None else None
        self.num_kv_heads = arch.num_kv_heads if arch is not None else 0

    def gather(self, layer: int) -> torch.Tensor | None:
        return _gather_layer(self.ctrl, self.caches, layer, self.block_ids, self.index,
                             self.plans, self.num_kv_heads)


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
