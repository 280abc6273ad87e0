"""CPU fast path for linear layers: oneDNN pre-packed weights, plus a native skinny kernel.

* `torch.nn.functional.linear` on CPU repacks the weight on every call; packing once into
  oneDNN's blocked layout at load time makes decode matmuls 1.3-2.8x faster here.
* With few rows (decode at light load, short prefills) a linear is bound by streaming its
  weight, and oneDNN runs it well below memory bandwidth. For `rows <= skinny_max_rows` the
  native kernel `tandem_linear_skinny_f32` (engine/csrc/linear_cpu.c) reads the plain
  weight once instead: 1.5-1.9x faster than oneDNN at 1..16 rows on this machine
  (`bench/linear_micro.py`). The price is a second copy of each weight (plain + packed).

Results differ from MKL's only in float rounding order. Applied after weight loading,
gpt-fast style: the model file stays plain.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)
PACK_BATCH_HINT = 64  # rows oneDNN tunes the packed layout for (decode batches are near it)
SKINNY_MAX_ROWS = 16  # crossover measured with bench/linear_micro.py (oneDNN wins by ~32)


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """`y = x @ W.T + b`, x: [T, in] -> [T, out], float32 on the CPU.

    W lives in oneDNN's packed layout; with `native` (the loaded kernel library) the plain
    W is kept too and serves calls of at most `skinny_max_rows` rows.
    """

    def __init__(self, linear: nn.Linear, native: ctypes.CDLL | None = None,
                 skinny_max_rows: int = SKINNY_MAX_ROWS) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight, PACK_BATCH_HINT), persistent=False)
        bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self._skinny = native.tandem_linear_skinny_f32 if native is not None else None
        self.skinny_max_rows = skinny_max_rows if native is not None else 0
        self.register_buffer("weight", weight if native is not None else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows = x.shape[0]
        if rows <= self.skinny_max_rows:
            y = torch.empty(rows, self.out_features, dtype=x.dtype)
            self._skinny(x.data_ptr(), self.weight.data_ptr(),
                         None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                         rows, self.out_features, self.in_features, torch.get_num_threads())
            return y
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, native: ctypes.CDLL | None = None) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, native))
                count += 1
    logger.info("packed %d linear layers into oneDNN layout%s", count,
                " (+ plain copies for the skinny kernel)" if native is not None else "")
    return count
