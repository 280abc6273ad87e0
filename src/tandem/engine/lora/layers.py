"""Batched multi-LoRA in the decoder's linears: every token gets its own adapter's update.

`ModuleSlots` holds one fused linear's adapter stacks for the `max_loras` device slots:
A [S, n_sub * R, in] (the sub-targets' A matrices stacked: q, k, v for `qkv_proj`; gate, up
for `gate_up_proj`) and per sub-target B transposed, Bt [S, R, out_j] (scale folded in), R =
`max_lora_rank`, zero-padded (a smaller rank or a missing target adds exactly 0).
`LoRALinear` wraps the base linear (float, packed or quantized alike): y = base(x), then for
the tokens with an adapter y[:, out_j] += (x A_s^T)[:, j] B_{s,j}^T.

A forward's token -> slot map is a `LoRABatch` (built once per step by the runner,
installed on the shared `LoRAContext` for that forward only: any other forward through the
same modules, a self-draft's say, runs the base model). It picks one of two plans:
- bmm: tokens grouped by slot into [G, L, in] (L = the most tokens of one slot, padding
  rows computed and dropped), two batched matmuls per sub-target over the slot stacks (all
  S slots as they are when most are in use, else the used ones gathered): few ops for
  decode batches mixing many adapters.
- loop: per slot, its rows (a slice when contiguous, a prefill chunk) through plain
  matmuls: no padding for long, few-adapter prefills.
- native (CPU, float32, the C kernels built): one `tandem_lora_f32` call per linear over
  the token -> slot map, for batches of at most `NATIVE_MAX_TOKENS` adapter tokens (per
  token dot products: a BLAS matmul is faster for long prefill chunks).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

NATIVE_MAX_TOKENS = 256


@dataclass
class ModuleSlots:
    """One fused linear's adapter slots. `outs[j]` = (offset, size) of sub-target j's rows
    in the output."""

    a: torch.Tensor  # [S, n_sub * R, in]
    b: list[torch.Tensor]  # n_sub x Bt [S, R, out_j] (B transposed: rows contiguous in out)
    outs: list[tuple[int, int]]
    rank: int
    _c_args: tuple | None = None  # the native kernel's B pointers, sizes and offsets

    @classmethod
    def allocate(cls, num_slots: int, rank: int, in_features: int,
                 outs: list[tuple[int, int]], device: torch.device,
                 dtype: torch.dtype) -> ModuleSlots:
        a = torch.zeros(num_slots, len(outs) * rank, in_features, device=device, dtype=dtype)
        b = [torch.zeros(num_slots, rank, n, device=device, dtype=dtype) for _, n in outs]
        return cls(a, b, outs, rank)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def set(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-target `sub` of `slot` := (A [r, in], B [out_j, r]) with r <= rank."""
        r = a.shape[0]
        rows = self.a[slot, sub * self.rank : (sub + 1) * self.rank]
        rows.zero_()
        rows[:r].copy_(a)
        bt = self.b[sub][slot]
        bt.zero_()
        bt[:r].copy_(b.T)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *self.b))

    def c_args(self) -> tuple:
        """(B pointers, out sizes, out offsets) as ctypes arrays (the stacks never move)."""
        if self._c_args is None:
            k = len(self.b)
            self._c_args = ((ctypes.c_void_p * k)(*[t.data_ptr() for t in self.b]),
                            (ctypes.c_int64 * k)(*[n for _, n in self.outs]),
                            (ctypes.c_int64 * k)(*[o for o, _ in self.outs]))
        return self._c_args


@dataclass
class LoRABatch:
    """A forward's token -> adapter slot plan (see the module docstring); build with
    `LoRABatch.build`."""

    mode: str  # "bmm" | "loop" | "native"
    # bmm: `group_slots` None = all slots in order; gather [G * L] token rows (padding: 0),
    # `valid` positions of real rows in G * L (None: all real), `dst` their tokens
    length: int = 0
    group_slots: torch.Tensor | None = None
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    # loop: (slot, rows: a slice or an index tensor)
    segments: list[tuple[int, slice | torch.Tensor]] | None = None
    # native: the library, each token's slot [T] int64 (-1: none), the scratch [T, 3 R]
    lib: object | None = None
    token_slots: torch.Tensor | None = None
    scratch: torch.Tensor | None = None

    @classmethod
    def build(cls, token_slots: np.ndarray, num_slots: int, device: torch.device,
              native: object | None = None, rank: int = 0) -> LoRABatch | None:
        """`token_slots` [T] int: each token's slot, -1 for the base model. None when no
        token has an adapter. `native`: the C kernel library, used for CPU float32 batches
        of at most NATIVE_MAX_TOKENS adapter tokens (`rank`: the slots' R)."""
        token_slots = np.asarray(token_slots, dtype=np.int64)
        lora = np.flatnonzero(token_slots >= 0)
        if lora.size == 0:
            return None
        if native is not None and lora.size <= NATIVE_MAX_TOKENS:
            t = token_slots.size
            return cls("native", lib=native,
                       token_slots=torch.from_numpy(np.ascontiguousarray(token_slots)),
                       scratch=torch.empty(t, 3 * rank, dtype=torch.float32))
        slots = token_slots[lora]
        order = np.argsort(slots, kind="stable")
        lora, slots = lora[order], slots[order]
        used, starts, counts = np.unique(slots, return_index=True, return_counts=True)
        n, length, groups = lora.size, int(counts.max()), used.size
        whole = groups == num_slots or (2 * groups >= num_slots
                                        and num_slots * length <= 2 * n + 16)
        if groups > 1 and (whole or groups * length <= 2 * n + 16):
            g = num_slots if whole else groups
            at = used if whole else np.arange(groups)
            pos = (at[np.repeat(np.arange(groups), counts)] * length
                   + np.arange(n) - np.repeat(starts, counts))
            gather = np.zeros(g * length, dtype=np.int64)
            gather[pos] = lora
            full = pos.size == g * length
            t = torch.from_numpy(np.concatenate([gather, pos, lora])).to(device)
            gat, valid, dst = t.split([g * length, pos.size, n])
            return cls("bmm", length, None if whole else torch.from_numpy(used).to(device),
                       gat, None if full else valid, dst)
        segments: list[tuple[int, slice | torch.Tensor]] = []
        for s, st, c in zip(used.tolist(), starts.tolist(), counts.tolist(), strict=True):
            rows = lora[st : st + c]
            if rows[-1] - rows[0] + 1 == c:  # contiguous tokens: a view
                segments.append((s, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                segments.append((s, torch.from_numpy(rows.copy()).to(device)))
        return cls("loop", segments=segments)


def _segments(token_slots: torch.Tensor) -> LoRABatch:
    """The per-slot ("loop") plan of a token -> slot map."""
    slots = token_slots.numpy()
    segments: list[tuple[int, slice | torch.Tensor]] = []
    for s in np.unique(slots[slots >= 0]).tolist():
        segments.append((s, torch.from_numpy(np.flatnonzero(slots == s))))
    return LoRABatch("loop", segments=segments)


class LoRAContext:
    """The batch plan of the forward in progress (shared by every `LoRALinear`)."""

    def __init__(self) -> None:
        self.current: LoRABatch | None = None

    @contextmanager
    def use(self, batch: LoRABatch | None) -> Iterator[None]:
        prev, self.current = self.current, batch
        try:
            yield
        finally:
            self.current = prev


class LoRALinear(nn.Module):
    """`base` (any linear module: [T, in] -> [T, out]) plus each token's adapter update."""

    def __init__(self, base: nn.Module, slots: ModuleSlots, ctx: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.slots = slots
        self.ctx = ctx

    @property
    def in_features(self) -> int:
        return self.slots.a.shape[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.ctx.current
        if batch is None:
            return y
        if batch.mode == "native" and x.is_contiguous() and y.stride(-1) == 1:
            return self._native(x, y, batch)
        if batch.mode == "bmm":
            return self._bmm(x, y, batch)
        if batch.mode == "native":  # an odd layout: the per-slot plan does the same sums
            return self._loop(x, y, _segments(batch.token_slots))
        return self._loop(x, y, batch)

    def _native(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        sl = self.slots
        b, n, off = sl.c_args()
        t, n_in = x.shape
        batch.lib.tandem_lora_f32(x.data_ptr(), y.data_ptr(), batch.scratch.data_ptr(),
                                  batch.token_slots.data_ptr(), sl.a.data_ptr(), b, n, off,
                                  t, n_in, n_in, y.stride(0), sl.rank, len(sl.b),
                                  torch.get_num_threads())
        return y

    def _bmm(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        sl, r, length = self.slots, self.slots.rank, batch.length
        a = sl.a if batch.group_slots is None else sl.a.index_select(0, batch.group_slots)
        g = a.shape[0]
        xg = x.index_select(0, batch.gather).view(g, length, -1)
        xa = torch.bmm(xg, a.transpose(1, 2))  # [G, L, n_sub * R]
        for j, (off, n) in enumerate(sl.outs):
            b = sl.b[j] if batch.group_slots is None else sl.b[j].index_select(
                0, batch.group_slots)
            d = torch.bmm(xa[:, :, j * r : (j + 1) * r], b).view(g * length, n)
            if batch.valid is not None:
                d = d.index_select(0, batch.valid)
            y[:, off : off + n].index_add_(0, batch.dst, d)
        return y

    def _loop(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        sl, r = self.slots, self.slots.rank
        for s, rows in batch.segments:
            contiguous = isinstance(rows, slice)
            xs = x[rows] if contiguous else x.index_select(0, rows)
            xa = xs @ sl.a[s].T  # [n, n_sub * R]
            for j, (off, n) in enumerate(sl.outs):
                d = xa[:, j * r : (j + 1) * r] @ sl.b[j][s]
                if contiguous:
                    y[rows, off : off + n] += d
                else:
                    y[:, off : off + n].index_add_(0, rows, d)
        return y
