"""The forward every tensor-parallel rank runs (vLLM's worker side of a step).

`RankRunner.forward(plan)` runs one step's forward from its `parallel.plan.StepPlan` alone:
one upload of the inputs (`plan_inputs`), the LoRA slot plan, the decode graphs or the eager
path as the plan says, each KV group's tables for a hybrid model (`kv_cache/groups.py`),
hidden states when asked. Every rank runs the same code on the same plan, so every feature
(LoRA, graphs, hidden states for EAGLE-style proposers, KV groups) composes with tensor
parallelism; the logits are gathered to rank 0 only (None on the others). Rank 0's
`model_runner.ModelRunner` builds the plans and samples.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.engine.attention.base import (
    AttentionBackend,
    BatchLayout,
    GroupedMetadata,
    group_builders,
)
from tandem.engine.kv_cache.groups import KVGroupLayout
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.parallel.plan import StepPlan
from tandem.engine.staging import upload

if TYPE_CHECKING:
    from tandem.engine.cuda_graphs import DecodeGraphRunner
    from tandem.engine.lora.slots import LoRASlots


def plan_inputs(plan: StepPlan, device: torch.device, block_size: int,
                extra: np.ndarray | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BatchLayout]:
    """One upload of tokens | positions | logits rows (| `extra`, rank 0's prompt-logprob
    targets) and the plan's `BatchLayout`: (input_ids, positions, logits_idx, extra,
    layout)."""
    extra = np.empty(0, np.int64) if extra is None else extra
    t, n = len(plan.tokens), len(plan.logits_idx)
    flat = upload(np.concatenate([plan.tokens, plan.positions, plan.logits_idx, extra]),
                  torch.int64, device)
    ids, pos, idx, rest = flat.split([t, t, n, len(extra)])
    layout = BatchLayout(plan.query_lens.tolist(), plan.seq_lens.tolist(), None,
                         torch.from_numpy(plan.slots), plan.num_decode, block_size,
                         block_table=plan.block_table, table_lens=plan.table_lens)
    return ids, pos, idx, rest, layout


@dataclass
class ForwardResult:
    """One forward's outputs: `logits` [L, V] (None on ranks > 0), `hidden` [L, H] when the
    plan asked for them, `extra` the device copy of `forward`'s `extra`."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None
    extra: torch.Tensor


class RankRunner:
    """The forward of one rank (every rank alike) over its share of the model and KV cache.
    `graphs`: its decode graphs (None: every step eager); `adapters`: its LoRA slots (None
    without LoRA)."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 block_size: int) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.graphs: DecodeGraphRunner | None = None
        self.adapters: LoRASlots | None = None
        # a hybrid model's KV groups (`use_groups`): each layer's group and each group's
        # metadata builder; empty: one block table serves every layer
        self.layer_group: tuple[int, ...] = ()
        self.group_builders: list[AttentionBackend] = []
        # (flat rows, device ids) written into the step's input ids after the upload: the
        # decode inputs still on the device (async scheduling); None: none
        self.device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    def use_groups(self, groups: KVGroupLayout) -> None:
        """Run a hybrid model: plans carry each KV group's tables (`StepPlan.groups`)."""
        self.layer_group = groups.layer_group
        self.group_builders = group_builders(self.backend, groups.windows)

    @torch.inference_mode()
    def forward(self, plan: StepPlan, extra: np.ndarray | None = None,
                on_layer: Callable[[int], None] | None = None) -> ForwardResult:
        """Run `plan`'s forward as the plan decides (graphs, LoRA slots, hidden states);
        `extra`: int64 values uploaded with the inputs (`ForwardResult.extra`); `on_layer`:
        called after each layer's K/V are written (eager steps)."""
        ids, pos, idx, extra_t, layout = plan_inputs(plan, self.device, self.block_size,
                                                     extra)
        if self.device_tokens is not None:
            ids.index_copy_(0, *self.device_tokens)
        if plan.graphs and self.graphs is not None:
            return ForwardResult(self.graphs.run(ids, pos, layout), None, extra_t)
        lora = None
        if len(plan.lora_slots) and self.adapters is not None:
            lora = self.adapters.batch(plan.lora_slots)
        if plan.groups:  # a hybrid model: each KV group's tables and slots
            meta = GroupedMetadata(self.layer_group, tuple(
                b.build_metadata(layout.with_tables(torch.from_numpy(g.slots), g.block_table,
                                                    g.table_lens))
                for b, g in zip(self.group_builders, plan.groups, strict=True)))
        else:
            meta = self.backend.build_metadata(layout)
        with self.adapters.ctx.use(lora) if lora is not None else nullcontext():
            out = self.model(ids, pos, self.kv_caches, meta, idx, on_layer=on_layer,
                             **({"return_hidden": True} if plan.return_hidden else {}))
        if plan.return_hidden:
            return ForwardResult(out[0], out[1], extra_t)
        return ForwardResult(out, None, extra_t)
