"""The step plan rank 0 broadcasts to the other tensor-parallel ranks, and its wire form.

A `StepPlan` is self-contained: the flat inputs of one forward (tokens, positions, KV slots,
the logits rows), the batch layout (query and sequence lengths, block tables), the number
of one-token rows first in it, and every decision that changes the forward, so that all
ranks take the same path through the same `RankRunner.forward`: each token's LoRA slot
(`lora_slots`, empty when no token has an adapter), whether the step replays the decode
graphs (`graphs`) and whether it returns hidden states (`return_hidden`). Ranks > 0 never
see the scheduler, the KV manager or a `Request`; the logits are gathered to rank 0 only
(rank 0 samples, as vLLM's driver worker does, so sampling state stays with rank 0's
sampler). `kind` also carries the control messages: stop, the KV page moves of P/D
transfers (`block_ids` then names the pages) and an adapter's load into a LoRA slot
(`block_ids` then holds the slot and the adapter's modules, `lora.slots.adapter_ids`; its
weights follow as one float32 broadcast). A FORWARD plan with `save_layers` (the step that
completes a prompt whose pages are sent layer by layer) names in `block_ids` the blocks
whose layers every rank hands rank 0 right after writing each layer (`kv_moves.LayerGather`,
from the forward's layer hook); a FORWARD plan without it has no `block_ids`.

A hybrid model's FORWARD plan also carries each KV group's slots and block tables
(`groups`, `kv_cache/groups.py`).

Wire form (`encode` / `decode`, no pickle): one little-endian int64 array, a fixed header
`[MAGIC, kind, T, L, B, W, num_decode, flags, P, S, G, GW]` (flags: 1 return_hidden,
2 graphs, 4 save_layers; S is 0 or T; G KV groups, their tables GW wide) then tokens [T]
| positions [T] | slots [T] | logits_idx [L] | query_lens [B] | seq_lens [B]
| block_table [B * W] | table_lens [B] | lora_slots [S] | block_ids [P], then per group
slots [T] | block_table [B * GW] | table_lens [B].
`decode` checks every size against the payload's length, and that `save_layers` comes
only in an eager FORWARD plan with blocks to gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

MAGIC = 0x7A4E_0004  # format version 4
HEADER = 12
MAX_GROUPS = 255  # KV groups (kv_cache/hybrid.py caps them)
RETURN_HIDDEN, GRAPHS, SAVE_LAYERS = 1, 2, 4  # flag bits
ALL_FLAGS = RETURN_HIDDEN | GRAPHS | SAVE_LAYERS
MAX_ELEMENTS = 1 << 28  # a plan past this is a bug, not a batch


class PlanKind(IntEnum):
    FORWARD = 0
    STOP = 1
    KV_GATHER = 2  # each rank hands rank 0 its heads of `block_ids` (a P/D send)
    KV_SCATTER = 3  # rank 0 hands each rank its heads of `block_ids` (a P/D receive)
    LORA_LOAD = 4  # an adapter into a LoRA slot on every rank (each keeps its shard)


def _i64(a: object) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class GroupTables:
    """One KV group's share of a FORWARD plan: its KV slot per token [T] int64, block
    tables [B, W] int32 (zero-padded) and their lengths [B] int32, rows as the plan's."""

    slots: np.ndarray
    block_table: np.ndarray
    table_lens: np.ndarray


@dataclass
class StepPlan:
    """One step for every rank. Arrays are int64 but for `block_table` ([B, W]
    zero-padded) and `table_lens` [B], int32 as the attention backends read them."""

    kind: PlanKind = PlanKind.FORWARD
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    positions: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    logits_idx: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    query_lens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    seq_lens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    block_table: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int32))
    table_lens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    num_decode: int = 0  # the first rows, one token each
    return_hidden: bool = False
    block_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # each token's LoRA slot (-1: the base model); empty when no token has an adapter
    lora_slots: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    graphs: bool = False  # a decode step over the static buffers / CUDA graphs
    # FORWARD: after each layer, every rank hands rank 0 its heads of `block_ids`
    save_layers: bool = False
    # a hybrid model's KV groups (`kv_cache/groups.py`), group 0 first (the plan's own
    # `slots` / `block_table` / `table_lens` are group 0's)
    groups: tuple[GroupTables, ...] = ()

    @classmethod
    def control(cls, kind: PlanKind, block_ids: list[int] | None = None) -> StepPlan:
        return cls(kind=kind, block_ids=_i64(block_ids or []))

    def encode(self) -> np.ndarray:
        """The plan as one int64 array (header + payload)."""
        t, b = len(self.tokens), len(self.query_lens)
        w = self.block_table.shape[1] if self.block_table.ndim == 2 and b else 0
        if len(self.lora_slots) not in (0, t):
            raise ValueError(f"{len(self.lora_slots)} LoRA slots for {t} tokens")
        flags = (RETURN_HIDDEN * bool(self.return_hidden) + GRAPHS * bool(self.graphs)
                 + SAVE_LAYERS * bool(self.save_layers))
        _check_blocks(int(self.kind), flags, len(self.block_ids))
        g = len(self.groups)
        gw = max((x.block_table.shape[1] for x in self.groups if x.block_table.ndim == 2),
                 default=0) if b else 0
        head = np.array([MAGIC, int(self.kind), t, len(self.logits_idx), b, w,
                         self.num_decode, flags, len(self.block_ids), len(self.lora_slots),
                         g, gw], dtype=np.int64)
        parts = [head, self.tokens, self.positions, self.slots, self.logits_idx,
                 self.query_lens, self.seq_lens, self.block_table, self.table_lens,
                 self.lora_slots, self.block_ids]
        for x in self.groups:  # each group's table zero-padded to the widest
            table = np.zeros((b, gw), dtype=np.int64)
            if b:
                table[:, :x.block_table.shape[1]] = x.block_table
            parts += [x.slots, table, x.table_lens]
        return np.concatenate([_i64(p) for p in parts])

    @staticmethod
    def payload_size(header: np.ndarray) -> int:
        """Elements after the header that `header` announces; ValueError when malformed."""
        if len(header) != HEADER or int(header[0]) != MAGIC:
            raise ValueError("not a step plan (bad magic)")
        _, kind, t, n_logits, b, w, nd, flags, p, s, g, gw = (int(x) for x in header)
        PlanKind(kind)  # ValueError for an unknown kind
        if (min(t, n_logits, b, w, nd, p, g, gw) < 0 or not 0 <= flags <= ALL_FLAGS
                or nd > t or s not in (0, t) or g > MAX_GROUPS
                or (g and kind != PlanKind.FORWARD)):
            raise ValueError("step plan header out of range")
        _check_blocks(kind, flags, p)
        size = 3 * t + n_logits + 3 * b + b * w + s + p + g * (t + b * gw + b)
        if size > MAX_ELEMENTS:
            raise ValueError(f"step plan of {size} elements is too large")
        return size

    @classmethod
    def decode(cls, data: np.ndarray) -> StepPlan:
        """The inverse of `encode`; ValueError for anything malformed."""
        data = _i64(data)
        if len(data) < HEADER:
            raise ValueError("step plan shorter than its header")
        size = cls.payload_size(data[:HEADER])
        if len(data) != HEADER + size:
            raise ValueError(f"step plan payload of {len(data) - HEADER} elements, its "
                             f"header says {size}")
        _, kind, t, n_logits, b, w, nd, flags, p, s, g, gw = (
            int(x) for x in data[:HEADER])
        out, at = [], HEADER
        for n in (t, t, t, n_logits, b, b, b * w, b, s, p, *(t, b * gw, b) * g):
            out.append(data[at : at + n].copy())
            at += n
        tokens, positions, slots, logits_idx, qlens, slens, table, tlens, lora, ids = out[:10]
        table = np.ascontiguousarray(table.reshape(b, w), dtype=np.int32)
        groups = tuple(GroupTables(out[i], np.ascontiguousarray(
            out[i + 1].reshape(b, gw), dtype=np.int32), out[i + 2].astype(np.int32))
            for i in range(10, 10 + 3 * g, 3))
        return cls(PlanKind(kind), tokens, positions, slots, logits_idx, qlens, slens,
                   table, tlens.astype(np.int32), nd, bool(flags & RETURN_HIDDEN), ids,
                   lora, bool(flags & GRAPHS), bool(flags & SAVE_LAYERS), groups)


def _check_blocks(kind: int, flags: int, num_blocks: int) -> None:
    """ValueError unless `save_layers` is on an eager FORWARD plan with blocks to gather and
    a FORWARD plan without it names no blocks."""
    if flags & SAVE_LAYERS:
        if kind != PlanKind.FORWARD or flags & GRAPHS or not num_blocks:
            raise ValueError("save_layers needs an eager FORWARD plan with blocks to gather")
    elif kind == PlanKind.FORWARD and num_blocks:
        raise ValueError("a FORWARD plan names blocks only with save_layers")
