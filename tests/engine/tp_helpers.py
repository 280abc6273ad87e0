"""Tensor-parallel helpers only tests use: `apply_tp` shards an already built model (engines
shard while loading instead, `model_build.build_shard`), and `reshard` plans how KV heads
move between two TP sizes (a prefill pool at one size, a decode pool at another)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.parallel.tp import TPGroup, TPPlan, kv_heads, local_arch, shard_weights, wrap_tp


def apply_tp(model: nn.Module, plan: TPPlan, comm: TPGroup, backend: object) -> nn.Module:
    """This rank's sharded copy of a built, loaded float `LlamaForCausalLM` (`backend`: the
    attention backend for the local heads)."""
    if plan.world == 1:
        return model
    arch = model.config
    weight = next(model.parameters())
    with torch.device(weight.device):
        local = LlamaForCausalLM(local_arch(arch, plan), backend,
                                 max_positions=model.rope.max_positions, ops=model.ops)
    local.to(weight.dtype)
    if arch.tie_word_embeddings:
        local.lm_head.weight = local.embed_tokens.weight
    local.load_weights(shard_weights(
        ((n, t.detach()) for n, t in model._weight_targets().items()), arch, plan))
    local.rope.compute(weight.device)
    wrap_tp(local, plan, comm, logits_to_all=True)  # every rank checks its logits
    return local.eval()


@dataclass(frozen=True)
class HeadCopy:
    """KV heads [src_head, src_head + count) local to `src_rank` go to local heads
    [dst_head, dst_head + count) of the receiving rank."""

    src_rank: int
    src_head: int
    count: int
    dst_head: int


def reshard(num_kv_heads: int, src_world: int, dst_world: int) -> list[list[HeadCopy]]:
    """Per receiving rank (of `dst_world`), the copies that fill its KV heads from senders
    of `src_world`, runs of consecutive heads merged. Each receiver gets each of its heads
    exactly once, from the holder nearest its own position (`d * src / dst`): replicated
    heads are sent once, the senders' load spreads, and equal sizes copy rank to rank."""
    holders: dict[int, list[tuple[int, int]]] = {}  # global head -> [(source rank, local)]
    for r in range(src_world):
        for i, h in enumerate(kv_heads(num_kv_heads, src_world, r)):
            holders.setdefault(h, []).append((r, i))
    plans = []
    for d in range(dst_world):
        near = d * src_world // dst_world
        copies: list[HeadCopy] = []
        for j, h in enumerate(kv_heads(num_kv_heads, dst_world, d)):
            r, i = min(holders[h], key=lambda ri: (abs(ri[0] - near), ri[0]))
            last = copies[-1] if copies else None
            if (last is not None and last.src_rank == r and last.src_head + last.count == i
                    and last.dst_head + last.count == j):
                copies[-1] = HeadCopy(r, last.src_head, last.count + 1, last.dst_head)
            else:
                copies.append(HeadCopy(r, i, 1, j))
        plans.append(copies)
    return plans
