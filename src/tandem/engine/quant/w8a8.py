""""w8a8": int8 per-channel symmetric weights and per-token dynamic int8 activations.

y = (xq @ wq.T) * x_scale[row] * w_scale[col] (+ bias), the product summed exactly in
int32. Weights: codes in [-127, 127] (never -128, so the AVX2 sign trick stays exact) and
one float16 scale per output channel (amax / 127, `quantize_grouped`). Activations, per
row: s = amax(|x|) / 127 in float32, codes = round_half_even(x / s) clamped to
[-127, 127] (amax 0 -> s 0, codes 0); `quantize_rows` is the reference.

Storage: on the CPU with the native library the int8 panel layout of `quant/int8.py`
(codes [P, K, 16] int8, scales [P, 1, 16] float16; P = ceil(N / 16)), so rows below
`min_rows` run the weight-only int8 kernel (`cpu_kernels.int8_panel_linear`) on the same
buffers and from `min_rows` on the int8 GEMM of `csrc/w8a8_cpu.c`. Elsewhere row-major
codes [N, K] int8 and scales [N, 1] float16: CUDA multiplies with `torch._int_mm`
(cuBLASLt int8, padded to M > 16 and K, N multiples of 8), a CPU without the native
library with torch's CPU `_int_mm` (or an exact float64 product where it is missing).

Measured (`bench/w8a8_micro.py`, results in bench/results/w8a8_micro.json; this 2-core
AVX2 EPYC, no VNNI, 2 threads, the fastest of 5 passes over DRAM-streamed weight copies,
on a machine shared with other jobs -- load 3-18 -- so single entries are noisy; ranges
over SmolLM2's 960x576, 576x576, 3072x576, 576x1536 and 49152x576 from two runs),
weight-only int8 time / w8a8 time (> 1: w8a8 faster; a few entries > 3 or < 0.65, single
calls hit by other jobs, left out):
  M = 1: 0.72-0.99, M = 8: 0.85-1.19, M = 16: 0.98-1.50, M = 64: 0.97-1.42,
  M = 256-1024: 1.10-2.38;
float32 panels / w8a8 at 64-1,024 rows: 0.97-1.83, mostly 1.3-1.7 (weight-only int8 is
0.77-1.26x float32 there). One thread with the weights in cache: w8a8 ~100-115 G
int-ops/s, float32 panels ~70-85 GFLOPS. So on AVX2 the int8 GEMM wins from 16 rows on (a
tie at 8: the weight-only kernel keeps those, its activations are not rounded):
`DEFAULT_MIN_ROWS = 16`.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.native import SIGNATURES
from tandem.engine.quant import cpu_kernels
from tandem.engine.quant.base import (
    GroupedWeight,
    QuantLinear,
    WeightRows,
    register_linear_method,
)
from tandem.engine.quant.int8 import Int8Method

logger = logging.getLogger(__name__)
PANEL = cpu_kernels.PANEL
MIN_ROWS_ENV = "TANDEM_W8A8_MIN_ROWS"
MAX_K = 65536  # int32 sums cannot overflow (VNNI sums (a + 128) * w before correcting)
DEFAULT_MIN_ROWS = 16  # rows from which the int8 GEMM runs (measured: module docstring)


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization (the reference): x [M, K] float32 ->
    (codes [M, K] int8, scales [M, 1] float32). `amax` [M, 1]: each row's max |x| when
    x holds only some of its columns (a row-parallel rank's)."""
    x = x.to(torch.float32)
    scale = (x.abs().amax(dim=1, keepdim=True) if amax is None else amax) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe).clamp(-127, 127)
    codes = torch.where(scale > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.int8), torch.where(scale > 0, scale, torch.zeros_like(scale))


def _row_amax(x: torch.Tensor) -> torch.Tensor:
    """Each row's max |x| [M, 1] float32 (a new tensor: collectives reduce it in place)."""
    return x.to(torch.float32).abs().amax(dim=1, keepdim=True)


def native_quantize_rows(x: torch.Tensor, native: ctypes.CDLL) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """`quantize_rows` by the native kernel (bit-identical): [M, K] float32 ->
    (codes [M, K] int8, scales [M, 1] float32)."""
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, 1, dtype=torch.float32)
    if m:
        native.tandem_w8a8_quantize_f32(x.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                        m, k, k, torch.get_num_threads())
    return codes, scales


def panel_gemm_i32(codes_x: torch.Tensor, codes: torch.Tensor, n_out: int,
                   native: ctypes.CDLL) -> torch.Tensor:
    """Exact int32 sums: codes_x [M, K] int8 @ panel codes [P, K, 16] -> [M, N] int32."""
    codes_x = codes_x.contiguous()
    m, k = codes_x.shape
    y = torch.empty(m, n_out, dtype=torch.int32)
    if m and native.tandem_w8a8_gemm_i32(codes_x.data_ptr(), codes.data_ptr(), y.data_ptr(),
                                         m, n_out, k, torch.get_num_threads()):
        raise MemoryError("w8a8 kernel: out of scratch memory")
    return y


def w8a8_panel_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None, n_out: int,
                      native: ctypes.CDLL) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 by the native int8 GEMM over panel codes
    [P, K, 16] int8 and scales [P, 1, 16] float16; bias [N] float32 or None."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n_out, dtype=torch.float32)
    if m and native.tandem_w8a8_linear_f32(
            x.data_ptr(), codes.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), m, n_out, k,
            torch.get_num_threads()):
        raise MemoryError("w8a8 kernel: out of scratch memory")
    return y


def int_mm(a: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Exact a [M, K] int8 @ codes [N, K].T int8 -> [M, N] int32 with torch."""
    if a.device.type == "cuda":
        m, k = a.shape
        n = codes.shape[0]
        mp, kp, np_ = max(24, -(-m // 8) * 8), -(-k // 8) * 8, -(-n // 8) * 8
        if (mp, kp) != (m, k):
            a = torch.nn.functional.pad(a, (0, kp - k, 0, mp - m))
        if (kp, np_) != (k, n):  # slow path: no SmolLM2 / Llama shape needs it
            codes = torch.nn.functional.pad(codes, (0, kp - k, 0, np_ - n))
        return torch._int_mm(a, codes.t())[:m, :n]
    if hasattr(torch, "_int_mm"):
        return torch._int_mm(a, codes.t())
    return (a.double() @ codes.double().t()).to(torch.int32)  # |sum| < 2^53: exact


def resolve_min_rows(min_rows: int | None) -> int:
    """The constructor's `min_rows`, else `TANDEM_W8A8_MIN_ROWS`, else the default."""
    if min_rows is None:
        raw = os.environ.get(MIN_ROWS_ENV, "").strip()
        if not raw:
            return DEFAULT_MIN_ROWS
        try:
            min_rows = int(raw)
        except ValueError:
            raise ConfigError(f"{MIN_ROWS_ENV} must be an integer, got {raw!r}") from None
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1:
        raise ConfigError(f"w8a8 min_rows must be an integer >= 1, got {min_rows!r}")
    return min_rows


@register_linear_method("w8a8")
class W8A8Method(Int8Method):
    """int8 weights x per-token int8 activations, int32 accumulation (module docstring).

    The weights are "int8"'s per-channel storage (same buffers, loads and `embed`); only
    `apply` differs. min_rows: steps with at least this many rows use the int8 GEMM on the
    native CPU layout, fewer the weight-only int8 kernel (default: measured,
    `DEFAULT_MIN_ROWS`; env `TANDEM_W8A8_MIN_ROWS`). Ignored off the native CPU path."""

    def __init__(self, *, device: torch.device, native: ctypes.CDLL | None = None,
                 min_rows: int | None = None) -> None:
        super().__init__(device=device, native=native)
        self.min_rows = resolve_min_rows(min_rows)
        # the weight-only kernel, where this build has it
        self._weight_only = self.panels and "tandem_quant_linear_i8" in SIGNATURES

    def create(self, layer: QuantLinear) -> None:
        n, k = layer.out_features, layer.in_features
        if k < 1 or n < 1:
            raise ConfigError(f"w8a8 needs a non-empty weight, got {n} x {k}")
        if self.panels and k > MAX_K:
            raise ConfigError(f"w8a8's int32 sums need in_features <= {MAX_K}, got {k}")
        super().create(layer)

    def _convert(self, layer: QuantLinear, rows: WeightRows) -> GroupedWeight:
        """As "int8", but code -128 is re-quantized: the AVX2 sign trick needs |code| <= 127."""
        if (isinstance(rows, GroupedWeight) and rows.bits == 8 and rows.codes.numel()
                and int(rows.codes.min()) < -127):
            rows = rows.dequantize(torch.float32)
        return super()._convert(layer, rows)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        n = layer.out_features
        if x.dim() != 2 or x.shape[1] != layer.in_features:
            raise ValueError(f"w8a8 input must be [T, {layer.in_features}], got "
                             f"{tuple(x.shape)}")
        if x.shape[0] == 0:
            return x.new_empty((0, n), dtype=layer.dtype)
        gemm = x.shape[0] >= self.min_rows or not self._weight_only
        if (self.panels and not gemm and x.dtype == torch.bfloat16
                and cpu_kernels.bf16_int8_ready(self.native)):  # bfloat16 in and out
            return cpu_kernels.int8_panel_linear_bf16(
                x, layer.codes, layer.scales, None, layer.in_features, layer.bias, n,
                self.native)
        bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        if self.panels:
            xf = x.to(torch.float32).contiguous()
            if gemm and layer.input_amax is not None:  # a row-parallel rank's columns
                xq, xs = quantize_rows(xf, layer.input_amax(_row_amax(xf)))
                y = panel_gemm_i32(xq, layer.codes, n, self.native).float() * xs
                y = y * layer.scales.reshape(-1)[:n].float()
                if bias is not None:
                    y = y + bias
            elif x.shape[0] >= self.min_rows:
                y = w8a8_panel_linear(xf, layer.codes, layer.scales, bias, n, self.native)
            elif self._weight_only:
                y = cpu_kernels.int8_panel_linear(xf, layer.codes, layer.scales, None,
                                                  layer.in_features, bias, n, self.native)
            else:  # weight-only kernel not built: the int8 GEMM serves every row count
                y = w8a8_panel_linear(xf, layer.codes, layer.scales, bias, n, self.native)
            return y.to(layer.dtype)
        amax = None if layer.input_amax is None else layer.input_amax(_row_amax(x))
        xq, xs = quantize_rows(x, amax)
        y = int_mm(xq, layer.codes).float() * xs * layer.scales.float().view(1, n)
        if bias is not None:
            y = y + bias
        return y.to(layer.dtype)
