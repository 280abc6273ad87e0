"""ctypes-level calls of the native INT8 / INT4 weight-only kernels (`csrc/quant_linear_cpu.c`)
and the 16-column panel layout they read.

Panel layout (P = ceil(N / 16), padded columns zero): int8 codes [P, K, 16] int8, int4 codes
[P, K // 2, 16] uint8 (byte [p, j, c]: k = 2j low nibble, k = 2j + 1 high nibble), scales /
mins [P, K // g, 16] float16. Output row n lives in panel n // 16, column n % 16.

torch's own CPU kernels are not used: on this 2-core AVX2 machine, 3072 x 576 weight, they
are 3-60x slower than float32 `F.linear` at every row count. Lead's measurement (2 threads):
M=1 f32 0.51 ms, `_weight_int8pack_mm` 1.57, `_weight_int4pack_mm_for_cpu` 2.24; M=16 0.97
/ 24.1 / 31.8 ms. Ours (1 thread, hot weights, best of 30): M=1 0.26 / 1.91 / 4.42 ms; M=16
2.52 / 86.7 / 150.5 ms, and `torch._int_mm` at 17 rows 54-80 ms.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.engine.quant.base import GroupedWeight
from tandem.engine.quant.torch_ref import pack_nibbles, unpack_nibbles

PANEL = 16
# kernel path: "auto" picks by row count (the register path up to 16 rows), "few" forces
# the in-register dequantization, "scratch" the dequantized-panel GEMM
MODES = {"auto": 0, "few": 1, "scratch": 2}


def panel_count(n: int) -> int:
    return (n + PANEL - 1) // PANEL


def _view(buf: torch.Tensor) -> torch.Tensor:
    """[P, L, 16] -> a [P, 16, L] view (row-major per output row within a panel)."""
    return buf.permute(0, 2, 1)


def _index(rows: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows.to(device=device, dtype=torch.long)
    return rows // PANEL, rows % PANEL


def write_panel_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     start: int, rows: GroupedWeight) -> None:
    """Store `rows` (bits and group size of the buffers; K // g scales each) as output rows
    [start, start + len) of the panel buffers. Any start / length, 16-aligned or not."""
    p, c = _index(torch.arange(start, start + rows.shape[0]), codes.device)
    data = pack_nibbles(rows.codes) if rows.bits == 4 else rows.codes
    _view(codes)[p, c] = data.to(device=codes.device, dtype=codes.dtype)
    _view(scales)[p, c] = rows.scales.to(device=scales.device, dtype=torch.float16)
    if mins is not None:
        src = rows.mins if rows.mins is not None else torch.zeros_like(rows.scales)
        _view(mins)[p, c] = src.to(device=mins.device, dtype=torch.float16)


def clear_padding(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                  n: int) -> None:
    """Zero the padded columns n .. 16P of the last panel (codes, scales and mins)."""
    tail = n % PANEL
    if tail:
        for buf in (codes, scales, mins):
            if buf is not None:
                buf[-1, :, tail:] = 0


def read_panel_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    bits: int, group_size: int, ids: torch.Tensor) -> GroupedWeight:
    """Output rows `ids` [T] of the panel buffers as `GroupedWeight` rows [T, K]."""
    p, c = _index(ids, codes.device)
    data = _view(codes)[p, c]
    return GroupedWeight(unpack_nibbles(data) if bits == 4 else data, _view(scales)[p, c],
                         None if mins is None else _view(mins)[p, c], bits, group_size)


def panel_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
               bits: int, group_size: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of W, dequantized -> [T, K] float32 (exactly `dequantize`'s rows);
    reads only those rows' codes."""
    return read_panel_rows(codes, scales, mins, bits, group_size, ids).dequantize()


def _call(fn: ctypes._CFuncPtr, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
          mins: torch.Tensor | None, group_size: int, bias: torch.Tensor | None, n_out: int,
          mode: str) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"x must be [M, K] float32, got {tuple(x.shape)} {x.dtype}")
    if bias is not None and bias.dtype != torch.float32:
        raise ValueError(f"bias must be float32, got {bias.dtype}")
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n_out, dtype=torch.float32)
    if m:
        fn(x.data_ptr(), codes.data_ptr(), scales.data_ptr(),
           None if mins is None else mins.data_ptr(),
           None if bias is None else bias.data_ptr(), y.data_ptr(),
           m, n_out, k, group_size, MODES[mode], torch.get_num_threads())
    return y


def int8_panel_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                      n_out: int, native: ctypes.CDLL, *, mode: str = "auto") -> torch.Tensor:
    """x [M, K] float32 @ W.T (+ bias [N] float32) -> [M, N] float32, W in int8 panels
    (codes [P, K, 16], scales / mins [P, K // g, 16] float16; mins may be None)."""
    return _call(native.tandem_quant_linear_i8, x, codes, scales, mins, group_size, bias,
                 n_out, mode)


def bf16_int8_ready(native: ctypes.CDLL | None) -> bool:
    """The library multiplies bfloat16 activations by int8 panels natively (AVX512-BF16:
    `tandem_quant_linear_i8_bf16`); elsewhere bfloat16 models widen to float32."""
    return native is not None and native.tandem_linear_bf16_simd() >= 2


def int8_panel_linear_bf16(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor | None, group_size: int,
                           bias: torch.Tensor | None, n_out: int,
                           native: ctypes.CDLL) -> torch.Tensor:
    """x [M, K] bfloat16 @ W.T (+ bias [N]) -> [M, N] bfloat16, W in int8 panels as for
    `int8_panel_linear`: each pair of code panels dequantized to bfloat16 once per call and
    multiplied with VDPBF16PS (`csrc/linear_bf16_cpu.c`), float32 sums."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"x must be [M, K] bfloat16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    y = torch.empty(m, n_out, dtype=torch.bfloat16)
    if m and native.tandem_quant_linear_i8_bf16(
            x.data_ptr(), codes.data_ptr(), scales.data_ptr(),
            None if mins is None else mins.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), m, n_out, k, group_size,
            torch.get_num_threads()):
        raise MemoryError("int8 bfloat16 kernel: out of scratch memory")
    return y


def int4_panel_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                      n_out: int, native: ctypes.CDLL, *, mode: str = "auto") -> torch.Tensor:
    """As `int8_panel_linear` with int4 panels: codes [P, K // 2, 16] uint8, g even."""
    return _call(native.tandem_quant_linear_i4, x, codes, scales, mins, group_size, bias,
                 n_out, mode)
