"""Weight-only grouped-integer linear methods: the shared storage, and "int8".

`GroupedIntMethod` keeps a layer's weight as integer codes with one float16 scale (and
optionally one float16 min) per group of `g` input columns, w = code * scale + min, in one of
two layouts (`cpu_kernels.py` / `torch_ref.py` describe them):
- CPU with the native library: 16-column panels, multiplied by `csrc/quant_linear_cpu.c`;
- elsewhere: row-major, multiplied by the Triton kernel on CUDA
  (`kernels/triton_quant.grouped_linear`), else by `torch_ref.grouped_linear`.

`load` converts without a float round trip whenever the target can hold the source exactly:
same bits (or 4-bit codes into int8 with mins, e.g. a GGUF Q4 tensor in an int8 layer) and
a source group size that is a multiple of the layer's (each source scale is repeated); a
missing source min becomes 0. Anything else (8-bit codes into int4, coarser groups, mins
into a layer without them) is dequantized and re-quantized, which rounds again.

"int8": signed codes in [-127, 127], scale = amax / 127 per group (`group_size=None`: per
output channel, g = K); `has_mins=True` adds a min buffer (0 for quantized float rows).

`act_order=True` (act-order GPTQ / compressed-tensors checkpoints): the layer also holds
`perm` [K], the input column of each code column (`GroupedWeight.perm`, the same for every
fused part), and multiplies x[:, perm] (vLLM's exllama / Marlin shuffle), so the kernels
see contiguous groups.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.quant import cpu_kernels, torch_ref
from tandem.engine.quant.base import (
    ColumnSlice,
    Fp8Weight,
    GroupedWeight,
    LinearMethod,
    QuantLinear,
    WeightRows,
    quantize_grouped,
    register_linear_method,
)

logger = logging.getLogger(__name__)


class GroupedIntMethod(LinearMethod):
    """Codes + float16 scales (+ mins) per group; subclasses fix `bits`, `symmetric`."""

    bits: int = 8
    symmetric: bool = True  # how float rows are quantized (quantize_grouped)
    embeds_cheaply = True  # `embed` reads only the looked-up rows (a tied embedding shares it)

    def __init__(self, *, device: torch.device | str, native: ctypes.CDLL | None,
                 group_size: int | None, has_mins: bool, act_order: bool = False) -> None:
        if group_size is not None and (isinstance(group_size, bool)
                                       or not isinstance(group_size, int) or group_size < 1
                                       or group_size % (8 // self.bits)):
            raise ConfigError(f"{self.name} group_size must be a positive "
                              f"{'even ' if self.bits == 4 else ''}integer or None, "
                              f"got {group_size!r}")
        self.device = torch.device(device)
        self.native = native
        self.group_size = group_size
        self.has_mins = has_mins
        self.act_order = act_order
        self.row_scaled = group_size is None  # per-channel: one scale per whole row
        self.panels = native is not None and self.device.type == "cpu"

    def group(self, layer: QuantLinear) -> int:
        return self.group_size or layer.in_features

    def create(self, layer: QuantLinear) -> None:
        n, k, g = layer.out_features, layer.in_features, self.group(layer)
        if k % g:
            raise ConfigError(f"{self.name}: in_features {k} is not a multiple of group_size "
                              f"{g}")
        width = k if self.bits == 8 else k // 2
        code_dtype = torch.int8 if self.bits == 8 else torch.uint8
        if self.panels:
            p = cpu_kernels.panel_count(n)
            codes = torch.empty(p, width, cpu_kernels.PANEL, dtype=code_dtype)
            scales = torch.empty(p, k // g, cpu_kernels.PANEL, dtype=torch.float16)
        else:
            codes = torch.empty(n, width, dtype=code_dtype)
            scales = torch.empty(n, k // g, dtype=torch.float16)
        layer.register_buffer("codes", codes, persistent=False)
        layer.register_buffer("scales", scales, persistent=False)
        layer.register_buffer("mins", torch.empty_like(scales) if self.has_mins else None,
                              persistent=False)
        if self.act_order:
            layer.register_buffer("perm", torch.empty(k, dtype=torch.long), persistent=False)
            layer.perm_loaded = False

    def _convert(self, layer: QuantLinear, rows: WeightRows) -> GroupedWeight:
        """Rows in this layer's format (bits, group size, mins or not). A `ColumnSlice`
        of a per-channel layer is scaled by its whole rows' range (the unsharded layer's
        codes and scales, sliced); of a group-wise one, its groups are converted as they
        are (whole groups: its columns start and end on group boundaries)."""
        k, g = layer.in_features, self.group(layer)
        if isinstance(rows, ColumnSlice):
            if rows.shape[1] != k:
                raise ConfigError(f"{self.name}: a column slice of K={rows.shape[1]}, layer "
                                  f"expects {k}")
            if not (self.row_scaled and self.bits == 8 and self.symmetric):
                return self._convert(layer, rows.part())
            part, amax = rows.float_rows()
            out = quantize_grouped(part, self.bits, g, self.symmetric, row_amax=amax)
            if self.has_mins:
                out.mins = torch.zeros_like(out.scales)
            return out
        if isinstance(rows, GroupedWeight):
            if rows.shape[1] != k:
                raise ConfigError(f"{self.name}: grouped rows have K={rows.shape[1]}, layer "
                                  f"expects {k}")
            exact = ((rows.bits == self.bits or (rows.bits == 4 and self.bits == 8))
                     and rows.group_size % g == 0 and (rows.mins is None or self.has_mins))
            if exact:
                rep = rows.group_size // g
                scales = rows.scales.repeat_interleave(rep, dim=1)
                mins = None
                if self.has_mins:
                    mins = (torch.zeros_like(scales) if rows.mins is None
                            else rows.mins.repeat_interleave(rep, dim=1))
                return GroupedWeight(rows.codes, scales, mins, self.bits, g)
            logger.debug("%s: re-quantizing %d-bit g%d rows to g%d", self.name, rows.bits,
                         rows.group_size, g)
            rows = rows.dequantize(torch.float32)
        if isinstance(rows, Fp8Weight):
            rows = rows.dequantize(torch.float32)
        if rows.dim() != 2 or rows.shape[1] != k or not rows.is_floating_point():
            raise ConfigError(f"{self.name}: expected float rows [r, {k}], got "
                              f"{tuple(rows.shape)} {rows.dtype}")
        out = quantize_grouped(rows.to(torch.float32), self.bits, g, self.symmetric)
        if self.has_mins and out.mins is None:
            out.mins = torch.zeros_like(out.scales)
        return out

    def _load_perm(self, layer: QuantLinear, weight: WeightRows) -> WeightRows:
        """Keep an act-order part's input permutation (the same for every part of the
        layer) and return the part without it (its codes stay in group order)."""
        perm = weight.perm if isinstance(weight, GroupedWeight) else None
        if not self.act_order:
            if perm is not None:
                raise ConfigError(f"{self.name}: an act-order weight needs a layer planned "
                                  "with act_order")
            return weight
        if perm is None:
            perm = torch.arange(layer.in_features)
        perm = perm.to(device=layer.perm.device, dtype=torch.long)
        if not layer.perm_loaded:
            layer.perm.copy_(perm)
            layer.perm_loaded = True
        elif not torch.equal(layer.perm, perm):
            raise ConfigError(f"{self.name}: the fused parts of one layer have different "
                              "act-order permutations (g_idx)")
        if isinstance(weight, GroupedWeight):
            weight = GroupedWeight(weight.codes, weight.scales, weight.mins, weight.bits,
                                   weight.group_size)
        return weight

    def load(self, layer: QuantLinear, start: int, weight: WeightRows) -> None:
        rows = self._convert(layer, self._load_perm(layer, weight))
        n, stop = layer.out_features, start + rows.shape[0]
        if start < 0 or stop > n:
            raise ConfigError(f"{self.name}: rows [{start}, {stop}) outside [0, {n})")
        codes, scales, mins = layer.codes, layer.scales, layer.mins
        if self.panels:
            cpu_kernels.write_panel_rows(codes, scales, mins, start, rows)
            if stop == n:  # exactly one load covers the last row
                cpu_kernels.clear_padding(codes, scales, mins, n)
            return
        data = torch_ref.pack_nibbles(rows.codes) if self.bits == 4 else rows.codes
        codes[start:stop] = data.to(device=codes.device, dtype=codes.dtype)
        scales[start:stop] = rows.scales.to(device=scales.device, dtype=torch.float16)
        if mins is not None:
            mins[start:stop] = rows.mins.to(device=mins.device, dtype=torch.float16)

    def grouped(self, layer: QuantLinear, ids: torch.Tensor | None = None) -> GroupedWeight:
        """Rows `ids` (default all) as a row-major `GroupedWeight` (bit-exact storage; an
        act-order layer's with its `perm`)."""
        g = self.group(layer)
        if self.panels:
            if ids is None:
                ids = torch.arange(layer.out_features)
            out = cpu_kernels.read_panel_rows(layer.codes, layer.scales, layer.mins,
                                              self.bits, g, ids)
        else:
            sel = slice(None) if ids is None else ids.to(layer.codes.device)
            mins = None if layer.mins is None else layer.mins[sel]
            out = torch_ref.grouped_rows(layer.codes[sel], layer.scales[sel], mins, self.bits,
                                         g)
        if self.act_order:
            out.perm = layer.perm
        return out

    def dequantize(self, layer: QuantLinear) -> torch.Tensor:
        return self.grouped(layer).dequantize(torch.float32)

    def embed(self, layer: QuantLinear, ids: torch.Tensor) -> torch.Tensor:
        return self.grouped(layer, ids).dequantize(torch.float32).to(layer.dtype)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        bias, g = layer.bias, self.group(layer)
        if self.act_order:  # the code columns' order
            x = x.index_select(-1, layer.perm)
        if self.panels:
            if (x.dtype == torch.bfloat16 and self.bits == 8
                    and cpu_kernels.bf16_int8_ready(self.native)):
                return cpu_kernels.int8_panel_linear_bf16(
                    x, layer.codes, layer.scales, layer.mins, g, bias, layer.out_features,
                    self.native)
            fn = (cpu_kernels.int8_panel_linear if self.bits == 8
                  else cpu_kernels.int4_panel_linear)
            if x.dtype == torch.float32:
                return fn(x, layer.codes, layer.scales, layer.mins, g, bias,
                          layer.out_features, self.native)
            y = fn(x.float(), layer.codes, layer.scales, layer.mins, g,
                   None if bias is None else bias.float(), layer.out_features, self.native)
            return y.to(layer.dtype)
        if x.device.type == "cuda":
            try:
                from tandem.engine.kernels.triton_quant import grouped_linear
            except ImportError:  # no Triton: the torch reference below
                pass
            else:
                return grouped_linear(x, layer.codes, layer.scales, layer.mins, self.bits, g,
                                      bias)
        return torch_ref.grouped_linear(x, layer.codes, layer.scales, layer.mins, self.bits,
                                        g, bias)


@register_linear_method("int8")
class Int8Method(GroupedIntMethod):
    """Weight-only INT8: signed codes, per-channel (default) or group-wise float16 scales."""

    bits = 8
    symmetric = True

    def __init__(self, *, device: torch.device | str, native: ctypes.CDLL | None = None,
                 group_size: int | None = None, has_mins: bool = False,
                 act_order: bool = False) -> None:
        super().__init__(device=device, native=native, group_size=group_size,
                         has_mins=has_mins, act_order=act_order)
