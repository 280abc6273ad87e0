"""Weight-only "int4": codes 0..15 two per byte, a float16 scale and min per group of
`group_size` (32, 64 or 128) input columns, w = code * scale + min (GGUF Q4_1 style; Q4_0
rows load exactly too, their min being -8 * scale). Float rows are quantized asymmetrically
(scale = (max - min) / 15). Storage, conversion rules and kernels: `int8.GroupedIntMethod`.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.quant.base import register_linear_method
from tandem.engine.quant.int8 import GroupedIntMethod

GROUP_SIZES = (32, 64, 128)


@register_linear_method("int4")
class Int4Method(GroupedIntMethod):
    """Weight-only INT4 with per-group scales and mins."""

    bits = 4
    symmetric = False

    def __init__(self, *, device: torch.device | str, native: ctypes.CDLL | None = None,
                 group_size: int = 32, act_order: bool = False) -> None:
        if group_size not in GROUP_SIZES or isinstance(group_size, bool):
            raise ConfigError(f"int4 group_size must be one of {GROUP_SIZES}, got "
                              f"{group_size!r}")
        super().__init__(device=device, native=native, group_size=group_size, has_mins=True,
                         act_order=act_order)
