"""The "fp8" linear method: float8_e4m3fn weights with one float32 scale per output row
(or, block-wise, per row and group of `block_k` input columns).

Storage: `weight` [N, K] float8_e4m3fn, `weight_scale` [N] float32; row n's scale is
amax(|w[n]|) / 448 (e4m3's largest finite value), so codes = w / scale lie in [-448, 448]
(clamped: never NaN). `GroupedWeight` rows are dequantized to float32, then quantized.
An `Fp8Weight` (an FP8 checkpoint's e4m3 codes with per-tensor or per-channel scales) is
stored as it is: its codes and scales, bit for bit. Its static `input_scale` is not used:
activations are scaled per token at run time.

Block-wise (`block_k`: a DeepSeek-V3 / Qwen3-FP8 checkpoint's `weight_block_size` [bn, bk],
compressed-tensors' `strategy: block`): `weight_scale` is [N, ceil(K / block_k)], each
checkpoint block's scale repeated over its bn rows; the last group may be partial. Such a
layer runs weight-only: the "triton" kernel reads a scale per (row, group) (on every CUDA
GPU Triton runs on, FP8 tensor cores or not), the "torch" mode decodes row blocks to the
activation dtype with each element's group scale. A tensor-parallel rank's input columns
must be whole groups (ConfigError otherwise).

Execution (`mode`, picked from the device unless given):
* "scaled_mm" (CUDA compute capability >= 8.9, Ada / Hopper): W8A8. Each activation row is
  quantized on the fly with the same rule (dynamic per-token scale), then
  `torch._scaled_mm` multiplies on the FP8 tensor cores with float32 accumulation. bf16
  activations on sm_90+ use its row-wise scales (bf16 out, bias fused); otherwise it
  runs with unit scales into float32 and the scales are applied after.
* "triton" (older CUDA GPUs): weight-only, `kernels/triton_quant.fp8_linear` decodes the
  bytes with integer ops in registers (no FP8 hardware needed).
* "torch" (the CPU): weight-only in row blocks: codes become float16 by a bit shuffle
  (exactly value / 256), are multiplied in the activation dtype, and the output columns
  are scaled by 256 * scale. torch 2.13's CPU `_scaled_mm` is correct but measured 15-30x
  slower than this at one row on this AVX2 machine, and quantizing activations costs accuracy,
  so the CPU never runs W8A8 unless asked (`mode="scaled_mm"`, tests).
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

from tandem.engine.errors import ConfigError
from tandem.engine.quant.base import (
    ColumnSlice,
    Fp8Weight,
    GroupedWeight,
    LinearMethod,
    QuantLinear,
    WeightRows,
    register_linear_method,
)

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0
MODES = ("scaled_mm", "triton", "torch")
SCALED_MM_CAPABILITY = (8, 9)
BLOCK_ELEMENTS = 1 << 20  # weight elements decoded at a time by the "torch" mode
_TINY = torch.finfo(torch.float32).tiny


def quantize_rows(t: torch.Tensor, row_amax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows [R, K] -> (float8_e4m3fn codes [R, K], float32 scales [R]) with
    scale = amax(|row|) / 448 (at least float32's smallest normal, so a zero row is zeros)
    and codes = round-to-nearest(row / scale) clamped to [-448, 448]. `row_amax` [R]:
    each row's max |w| over its whole row when `t` holds some of its columns."""
    t = t.float()
    amax = t.abs().amax(-1) if row_amax is None else row_amax.to(t.device, torch.float32)
    scale = (amax / E4M3_MAX).clamp(min=_TINY)
    codes = (t / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def e4m3_as_half(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes -> float16 holding exactly value / 256 (a bit shuffle: e4m3's
    exponent and mantissa land in float16's, whose exponent bias is 8 larger; e4m3
    subnormals become float16 subnormals). Vectorised ops, unlike torch's CPU fp8 cast."""
    h = codes.view(torch.int8).to(torch.int16)
    h.bitwise_left_shift_(7).bitwise_and_(-16385)  # bit 14 held a copy of the sign
    return h.view(torch.float16)


def default_mode(device: torch.device) -> str:
    """The mode `Fp8Method` runs on `device` (see the module docstring)."""
    if device.type != "cuda":
        return "torch"
    if torch.cuda.get_device_capability(device) >= SCALED_MM_CAPABILITY:
        return "scaled_mm"
    from tandem.engine.kernels import triton_unavailable_reason

    return "torch" if triton_unavailable_reason(device) else "triton"


def quantize_blocks(t: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows [R, K] -> (e4m3 codes [R, K], float32 scales [R, ceil(K / group)]): the
    rule of `quantize_rows` over each group of `group` columns."""
    r, k = t.shape
    padded = F.pad(t.float(), (0, -k % group)).view(r, -1, group)
    scale = (padded.abs().amax(-1) / E4M3_MAX).clamp(min=_TINY)
    codes = (padded / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    return codes.view(r, -1)[:, :k].to(torch.float8_e4m3fn), scale


def _pad16(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """t zero-padded at the end of each dim in `dims` to a multiple of 16 (fp8 padded as
    bytes: F.pad has no float8 kernels)."""
    pad = [0, 0] * t.dim()
    for d in dims:
        pad[2 * (t.dim() - 1 - d) + 1] = -t.shape[d] % 16
    if not any(pad):
        return t
    if t.dtype == torch.float8_e4m3fn:
        return F.pad(t.view(torch.uint8), pad).view(torch.float8_e4m3fn)
    return F.pad(t, pad)


@register_linear_method("fp8")
class Fp8Method(LinearMethod):
    """FP8 e4m3 weights, per-output-channel float32 scales (see the module docstring)."""

    embeds_cheaply = True  # rows decode from the same storage (a tied LM head's)
    row_scaled = True  # one scale per output row, over its whole input row

    def __init__(self, *, device: torch.device, native: ctypes.CDLL | None = None,
                 mode: str | None = None, block_k: int | None = None) -> None:
        self.device = torch.device(device)
        if block_k is not None and block_k < 1:
            raise ConfigError(f"fp8 block_k must be positive, got {block_k}")
        self.block_k = block_k
        # block-wise scales span bk columns, not whole rows: a row-parallel rank's share is
        # cut in whole groups by `parallel.tp.shard_weights` (which names a misfit)
        self.row_scaled = block_k is None
        if mode is not None and mode not in MODES:
            raise ConfigError(f"fp8 mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "triton":
            from tandem.engine.kernels import triton_unavailable_reason

            reason = triton_unavailable_reason(self.device)
            if reason:
                raise ConfigError(f"fp8 mode 'triton' on {self.device}: {reason}")
        self.mode = mode or default_mode(self.device)
        if block_k is not None and self.mode == "scaled_mm":  # weight-only (module docstring)
            from tandem.engine.kernels import triton_unavailable_reason

            self.mode = "torch" if triton_unavailable_reason(self.device) else "triton"
        self.rowwise = (self.mode == "scaled_mm" and self.device.type == "cuda"
                        and torch.cuda.get_device_capability(self.device) >= (9, 0))

    def create(self, layer: QuantLinear) -> None:
        n, k = layer.out_features, layer.in_features
        layer.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn),
                              persistent=False)
        shape = (n,) if self.block_k is None else (n, -(-k // self.block_k))
        layer.register_buffer("weight_scale", torch.empty(shape, dtype=torch.float32),
                              persistent=False)

    def load(self, layer: QuantLinear, start: int, weight: WeightRows) -> None:
        if isinstance(weight, ColumnSlice) and (isinstance(weight.full, Fp8Weight)
                                                or self.block_k is not None):
            weight = weight.part()  # the rank's columns, each row with its own scale(s)
        if isinstance(weight, Fp8Weight):
            n, k = weight.shape
            if k != layer.in_features or start < 0 or start + n > layer.out_features:
                raise ConfigError(f"fp8 load of rows {(n, k)} at {start} into a "
                                  f"[{layer.out_features}, {layer.in_features}] layer")
            layer.weight[start:start + n].copy_(weight.codes)
            layer.weight_scale[start:start + n].copy_(self._scales(weight))
            return
        if self.block_k is not None:
            rows = (weight.dequantize(torch.float32) if isinstance(weight, GroupedWeight)
                    else weight)
            if rows.dim() != 2 or rows.shape[1] != layer.in_features or (
                    start + rows.shape[0] > layer.out_features):
                raise ConfigError(f"fp8 load of rows {tuple(rows.shape)} at {start} into a "
                                  f"[{layer.out_features}, {layer.in_features}] layer")
            codes, scale = quantize_blocks(rows.to(layer.weight.device), self.block_k)
            layer.weight[start:start + rows.shape[0]].copy_(codes)
            layer.weight_scale[start:start + rows.shape[0]].copy_(scale)
            return
        amax = None
        if isinstance(weight, ColumnSlice):  # scaled by the whole rows' range
            rows, amax = weight.float_rows()
        elif isinstance(weight, GroupedWeight):
            rows = weight.dequantize(torch.float32)
        else:
            rows = weight
        if rows.dim() != 2 or rows.shape[1] != layer.in_features or (
                start + rows.shape[0] > layer.out_features):
            raise ConfigError(f"fp8 load of rows {tuple(rows.shape)} at {start} into a "
                              f"[{layer.out_features}, {layer.in_features}] layer")
        codes, scale = quantize_rows(rows.to(layer.weight.device), amax)
        layer.weight[start:start + rows.shape[0]].copy_(codes)
        layer.weight_scale[start:start + rows.shape[0]].copy_(scale)

    def _scales(self, weight: Fp8Weight) -> torch.Tensor:
        """`weight`'s scales in this layer's layout: [rows] per row, [rows, groups] when
        block-wise (a per-row weight's scale repeated over the groups, exactly)."""
        g = self.block_k
        if g is None:
            if weight.group_size is not None:
                raise ConfigError(f"a block-wise FP8 weight (groups of {weight.group_size} "
                                  "columns) loaded into a per-row fp8 layer")
            return weight.scales
        if weight.group_size is None:
            return weight.scales[:, None].expand(-1, -(-weight.shape[1] // g))
        if weight.group_size != g:
            raise ConfigError(f"a block-wise FP8 weight in groups of {weight.group_size} "
                              f"columns loaded into an fp8 layer of {g}-column groups")
        return weight.scales

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.empty(0, layer.out_features, dtype=x.dtype, device=x.device)
        if self.mode == "scaled_mm":
            return self._scaled_mm(layer, x)
        if self.mode == "triton":
            from tandem.engine.kernels.triton_quant import fp8_linear

            return fp8_linear(x, layer.weight, layer.weight_scale, layer.bias,
                              group_size=self.block_k)
        if self.block_k is not None:
            return self._torch_blocks(layer, x)
        return self._torch(layer, x)

    def _scaled_mm(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        n = layer.out_features
        amax = None
        if layer.input_amax is not None:  # a row-parallel rank's columns: the whole rows'
            amax = layer.input_amax(x.float().abs().amax(-1))
        xq, sx = quantize_rows(x, amax)
        xq = _pad16(xq, (1,))
        wq = _pad16(layer.weight, (0, 1))
        bias = layer.bias
        if self.rowwise and x.dtype == torch.bfloat16:
            sw = _pad16(layer.weight_scale, (0,)).view(1, -1)
            bias = None if bias is None else _pad16(bias, (0,))
            y = torch._scaled_mm(xq, wq.t(), scale_a=sx.view(-1, 1), scale_b=sw, bias=bias,
                                 out_dtype=torch.bfloat16)
            return y[:, :n] if y.shape[1] != n else y
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y[:, :n] * sx[:, None] * layer.weight_scale
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype)

    def _torch(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        n, k = layer.out_features, layer.in_features
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        rows = max(16, BLOCK_ELEMENTS // max(k, 1))
        for r0 in range(0, n, rows):
            w = e4m3_as_half(layer.weight[r0:r0 + rows]).to(x.dtype)
            torch.matmul(x, w.t(), out=y[:, r0:r0 + rows])
        y.mul_(layer.weight_scale * 256)
        if layer.bias is not None:
            y += layer.bias
        return y

    def _torch_blocks(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """Block-wise weights on the CPU: row blocks decoded to float32 codes * group scale
        (one rounding: exactly `dequantize`), cast to the activation dtype, multiplied."""
        n, k = layer.out_features, layer.in_features
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        rows = max(16, BLOCK_ELEMENTS // max(k, 1))
        for r0 in range(0, n, rows):
            w = self._decode(layer, slice(r0, r0 + rows)).to(x.dtype)
            torch.matmul(x, w.t(), out=y[:, r0:r0 + rows])
        if layer.bias is not None:
            y += layer.bias
        return y

    def _decode(self, layer: QuantLinear, rows: slice | torch.Tensor) -> torch.Tensor:
        """Rows of the weight in float32: e4m3 codes (as value / 256) times 256 * scale."""
        codes = e4m3_as_half(layer.weight[rows]).float()
        scale = layer.weight_scale[rows] * 256
        if self.block_k is None:
            return codes * scale[:, None]
        return codes * scale.repeat_interleave(self.block_k, 1)[:, :layer.in_features]

    def dequantize(self, layer: QuantLinear) -> torch.Tensor:
        if self.block_k is None:
            return layer.weight.float() * layer.weight_scale[:, None]
        return layer.weight.float() * layer.weight_scale.repeat_interleave(
            self.block_k, 1)[:, :layer.in_features]

    def embed(self, layer: QuantLinear, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(device=layer.weight.device, dtype=torch.long)
        return self._decode(layer, ids).to(layer.dtype)
