"""Row-major grouped-integer weights in plain torch: nibble packing and the fallback matmul.

Row-major layout (CUDA; CPU without the native library): int8 codes [N, K] int8, int4 codes
[N, K // 2] uint8 (low nibble = even k, high nibble = odd k), scales / mins [N, K // g]
float16. `grouped_linear` dequantizes a block of output rows at a time (a few MB of float32,
never the whole matrix) and multiplies it with `torch.matmul`; on CUDA it only runs when
Triton is missing (`kernels/triton_quant.py` is the GPU path).
"""

from __future__ import annotations

import torch

from tandem.engine.quant.base import GroupedWeight

BLOCK_BYTES = 4 << 20  # float32 bytes of weight dequantized at a time


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] integer codes in 0..15 (K even) -> [..., K // 2] uint8, even k in the low
    nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K // 2] uint8 -> [..., K] int8 codes 0..15 (inverse of `pack_nibbles`)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2).to(torch.int8)


def grouped_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bits: int, group_size: int) -> GroupedWeight:
    """Row-major storage (see the module docstring) -> `GroupedWeight` rows [N, K]."""
    full = unpack_nibbles(codes) if bits == 4 else codes
    return GroupedWeight(full, scales, mins, bits, group_size)


def grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor | None, bits: int, group_size: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, W row-major grouped codes; computed
    in float32 on the exact dequantized weight (`GroupedWeight.dequantize`)."""
    n, k = scales.shape[0], x.shape[1]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    xf = x.float()
    block = max(1, BLOCK_BYTES // (4 * k))
    for n0 in range(0, n, block):
        n1 = min(n, n0 + block)
        w = grouped_rows(codes[n0:n1], scales[n0:n1], None if mins is None else mins[n0:n1],
                         bits, group_size).dequantize(torch.float32)
        part = xf @ w.T
        if bias is not None:
            part += bias[n0:n1].float()
        y[:, n0:n1] = part
    return y
