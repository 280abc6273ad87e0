"""The device side of multi-LoRA on one rank: the slot stacks wrapped around the decoder's
linears, an adapter's load into a slot, and a step's token -> slot plan.

Every tensor-parallel rank holds a `LoRASlots` over its own shard of the model and the
same slots: rank 0's `LoRAManager` decides which adapter sits in which slot and sends each
load to the other ranks (a `PlanKind.LORA_LOAD` plan, then the adapter's weights as one
float32 broadcast: `adapter_ids` / `adapter_data`, read back by `adapter_from_wire`; no
pickle, and no rank needs the adapter's files). Each rank keeps its shard of the adapter
(`shard_adapter`, the spans of `parallel.tp.TPPlan`): for column-parallel layers
(q/k/v_proj, gate/up_proj) B's output rows as the base layer's rows, A whole; for
row-parallel layers (o_proj, down_proj) A's input columns as the base layer's columns, B
whole, wrapped inside the layer's all-reduce (`RowParallel.inner`) so the ranks' partial
updates are summed with the base layer's. With one rank nothing is sliced.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.engine.lora.layers import LoRABatch, LoRAContext, LoRALinear, ModuleSlots
from tandem.engine.lora.peft import TARGETS, target_shapes
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.parallel.tp import RowParallel, TPPlan

# fused module -> its sub-targets, in output order
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}
TARGET_NAMES: tuple[str, ...] = tuple(TARGETS)  # a target's index on the wire
Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _spans(arch: ModelArchConfig, plan: TPPlan) -> dict[str, tuple[int, int]]:
    """Target -> (start, size) of the rank's output rows (column-parallel) or input
    columns (row-parallel), as `parallel.tp.shard_weights` slices the base weights."""
    d = arch.head_dim
    q = (plan.q_head_start * d, plan.num_heads * d)
    kv = (plan.kv_head_start * d, plan.num_kv_heads * d)
    inter = (plan.inter_start, plan.inter_size)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter,
            "o_proj": q, "down_proj": inter}


def shard_adapter(weights: Weights, arch: ModelArchConfig, plan: TPPlan) -> Weights:
    """A whole adapter's (A [r, in], B [out, r]) -> this rank's share (views): B's rows of
    column-parallel targets, A's columns of row-parallel ones."""
    spans = _spans(arch, plan)
    out: Weights = {}
    for (layer, target), (a, b) in weights.items():
        start, n = spans[target]
        if target in ("o_proj", "down_proj"):
            a = a[:, start : start + n]
        else:
            b = b[start : start + n]
        out[(layer, target)] = (a, b)
    return out


def adapter_ids(slot: int, weights: Weights) -> list[int]:
    """A LORA_LOAD plan's `block_ids`: [slot, then (layer, target index, rank) per module,
    in key order] (the order of `adapter_data`)."""
    ids = [slot]
    for layer, target in sorted(weights):
        ids += [layer, TARGET_NAMES.index(target), weights[(layer, target)][0].shape[0]]
    return ids


def adapter_data(weights: Weights) -> torch.Tensor:
    """Every module's A then B, flattened float32, in `adapter_ids`' order."""
    parts = []
    for key in sorted(weights):
        a, b = weights[key]
        parts += [a.reshape(-1), b.reshape(-1)]
    if not parts:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat(parts).to(torch.float32).contiguous()


def _modules(ids: np.ndarray, arch: ModelArchConfig, num_slots: int, max_rank: int
             ) -> tuple[int, list[tuple[int, str, int, int, int]]]:
    """(slot, [(layer, target, rank, in, out)]) of a LORA_LOAD plan's `block_ids`;
    ValueError when malformed."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) < 1 or (len(ids) - 1) % 3 or not 0 <= int(ids[0]) < num_slots:
        raise ValueError("malformed LoRA load plan")
    shapes = target_shapes(arch)
    mods = []
    for layer, t, r in ids[1:].reshape(-1, 3).tolist():
        if not (0 <= layer < arch.num_layers and 0 <= t < len(TARGET_NAMES)
                and 1 <= r <= max_rank):
            raise ValueError("malformed LoRA load plan")
        target = TARGET_NAMES[t]
        n_out, n_in = shapes[target]
        mods.append((layer, target, r, n_in, n_out))
    return int(ids[0]), mods


def wire_size(ids: np.ndarray, arch: ModelArchConfig, num_slots: int, max_rank: int) -> int:
    """Float32 elements of the weights broadcast after a LORA_LOAD plan."""
    _, mods = _modules(ids, arch, num_slots, max_rank)
    return sum(r * (n_in + n_out) for _, _, r, n_in, n_out in mods)


def adapter_from_wire(ids: np.ndarray, data: torch.Tensor, arch: ModelArchConfig,
                      num_slots: int, max_rank: int) -> tuple[int, Weights]:
    """The inverse of `adapter_ids` / `adapter_data`: (slot, whole weights)."""
    slot, mods = _modules(ids, arch, num_slots, max_rank)
    weights: Weights = {}
    at = 0
    for layer, target, r, n_in, n_out in mods:
        a = data[at : at + r * n_in].view(r, n_in)
        at += r * n_in
        b = data[at : at + n_out * r].view(n_out, r)
        at += n_out * r
        weights[(layer, target)] = (a, b)
    if at != len(data):
        raise ValueError(f"LoRA weights of {len(data)} elements, the plan says {at}")
    return slot, weights


class LoRASlots:
    """`num_slots` adapter slots of rank `max_rank` in every decoder linear of `model`
    (this rank's shard when `tp` is set; `arch` is the whole model's)."""

    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, num_slots: int,
                 max_rank: int, device: torch.device, dtype: torch.dtype,
                 native: object | None = None, tp: TPPlan | None = None) -> None:
        self.arch, self.tp, self.device = arch, tp, device
        self.num_slots, self.max_rank = num_slots, max_rank
        # the C kernel library for CPU float32 steps (`layers` module doc); None: torch plans
        self.native = native if device.type == "cpu" and dtype == torch.float32 else None
        self.ctx = LoRAContext()
        self.modules: dict[tuple[int, str], ModuleSlots] = {}
        self._wrap(model, dtype)

    def _wrap(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        a, tp = self.arch, self.tp
        heads = tp.num_heads if tp else a.num_heads
        kv_heads = tp.num_kv_heads if tp else a.num_kv_heads
        q, kv = heads * a.head_dim, kv_heads * a.head_dim
        inter = tp.inter_size if tp else a.intermediate_size
        layout = {"qkv_proj": ("self_attn", a.hidden_size, [(0, q), (q, kv), (q + kv, kv)]),
                  "o_proj": ("self_attn", q, [(0, a.hidden_size)]),
                  "gate_up_proj": ("mlp", a.hidden_size, [(0, inter), (inter, inter)]),
                  "down_proj": ("mlp", inter, [(0, a.hidden_size)])}
        for i, layer in enumerate(model.layers):
            for name, (group, n_in, outs) in layout.items():
                parent = getattr(layer, group)
                if not hasattr(parent, name):  # a mixture of experts: attention-only LoRA
                    continue
                slots = ModuleSlots.allocate(self.num_slots, self.max_rank, n_in, outs,
                                             self.device, dtype)
                self.modules[(i, name)] = slots
                if isinstance(getattr(parent, name), RowParallel):  # its partial sums
                    parent = getattr(parent, name)
                    name = "inner"
                setattr(parent, name, LoRALinear(getattr(parent, name), slots, self.ctx))

    @property
    def nbytes(self) -> int:
        """Device bytes of every slot stack (allocated up front)."""
        return sum(m.nbytes for m in self.modules.values())

    def clear(self, slot: int) -> None:
        for m in self.modules.values():
            m.clear(slot)

    def load(self, slot: int, weights: Weights) -> None:
        """`slot` := the whole adapter `weights` (this rank's share of it)."""
        if self.tp is not None and self.tp.world > 1:
            weights = shard_adapter(weights, self.arch, self.tp)
        for (layer, fused), m in self.modules.items():
            m.clear(slot)
            for sub, target in enumerate(FUSED[fused]):
                w = weights.get((layer, target))
                if w is not None:
                    m.set(slot, sub, w[0].to(m.a.device, m.a.dtype),
                          w[1].to(m.a.device, m.a.dtype))

    def batch(self, token_slots: np.ndarray) -> LoRABatch | None:
        """A forward's plan from each token's slot (-1: none); None when no token has one."""
        return LoRABatch.build(token_slots, self.num_slots, self.device, self.native,
                               self.max_rank)
