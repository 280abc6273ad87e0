"""Quantized KV cache rows: FP8 (e4m3) or INT8 codes with a float16 scale per token and head.

With `kv_cache_dtype` "fp8" or "int8" each cache row (one token, one KV head) is `D` code
bytes followed by its scale as float16 (2 bytes, little-endian), so a layer's K (and V)
cache is `[num_blocks, KVH, block_size, D + 2]` uint8 and a block stays one contiguous page
that carries its own scales (kvtransfer ships it as it is). Per-row scales need no
calibration, and two workers of one model always produce the same bytes.

  int8: s = amax|x| / 127, code = round(x / s) clamped to [-127, 127] (two's complement)
  fp8:  s = amax|x| / 448, code = e4m3fn(x / s) (round to nearest even, clamped to +-448)

s is rounded to float16 first (clamped to float16's normal range, so amax 0 gives the
smallest normal 2^-14) and the codes are computed against that rounded s; x = code * s.
These torch functions are the reference the native and Triton kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.errors import ConfigError

KV_FORMATS = ("auto", "fp8", "int8")
SCALE_BYTES = 2  # float16 scale after the codes of each row
FP16_MIN_NORMAL = 2.0 ** -14
FP16_MAX = 65504.0
_QMAX = {"int8": 127.0, "fp8": 448.0}
# the native and Triton kernels' format codes (0 = the model dtype, unquantized)
FORMAT_CODES = {"auto": 0, "int8": 1, "fp8": 2}


@dataclass(frozen=True)
class KVCacheFormat:
    """How one layer's K/V rows are stored: "auto" (the model dtype) or "fp8" / "int8"."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in KV_FORMATS:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_FORMATS}, got {self.name!r}")

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def code(self) -> int:
        """The format's number in the native / Triton kernels (0 auto, 1 int8, 2 fp8)."""
        return FORMAT_CODES[self.name]

    def row_width(self, head_dim: int) -> int:
        """Elements in the last dimension of a cache tensor: D, or D + 2 bytes quantized."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def row_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one (token, KV head) row with a model in `dtype`."""
        return self.row_width(head_dim) * (1 if self.quantized else dtype.itemsize)

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The cache tensors' dtype for a model in `dtype` (uint8 when quantized)."""
        return torch.uint8 if self.quantized else dtype


def kv_format(name: str) -> KVCacheFormat:
    """The format named `name` ("fp8_e4m3" is accepted as "fp8"); ConfigError otherwise."""
    return KVCacheFormat("fp8" if name == "fp8_e4m3" else name)


def row_scales(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., D] float -> the rows' scales [...] as float16 (amax / qmax, clamped)."""
    amax = x.abs().amax(dim=-1, keepdim=False).float()
    return (amax / _QMAX[name]).clamp_(FP16_MIN_NORMAL, FP16_MAX).to(torch.float16)


def quantize_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., D] (any float dtype) -> rows [..., D + 2] uint8: codes, then the fp16 scale."""
    fmt = kv_format(name)
    if not fmt.quantized:
        raise ValueError("quantize_rows needs kv_cache_dtype 'fp8' or 'int8', not 'auto'")
    if not x.is_floating_point():
        raise ValueError(f"quantize_rows takes float rows, got {x.dtype}")
    s16 = row_scales(x, fmt.name)
    y = x.float() / s16.float()[..., None]
    if fmt.name == "int8":
        codes = y.round_().clamp_(-127.0, 127.0).to(torch.int8).view(torch.uint8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.uint8,
                      device=x.device)
    out[..., : x.shape[-1]] = codes
    out[..., x.shape[-1]:] = s16[..., None].view(torch.uint8)
    return out


def row_codes(rows: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., D + 2] uint8 -> (codes as float32 [..., D], scales float32 [...])."""
    if rows.dtype != torch.uint8 or rows.shape[-1] <= SCALE_BYTES:
        raise ValueError(f"quantized rows must be [..., D + 2] uint8, got {tuple(rows.shape)} "
                         f"{rows.dtype}")
    d = rows.shape[-1] - SCALE_BYTES
    raw = rows[..., :d]
    if name == "int8":
        codes = raw.view(torch.int8).float()
    elif name == "fp8":
        codes = raw.view(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"row_codes needs kv_cache_dtype 'fp8' or 'int8', not {name!r}")
    scales = rows[..., d:].contiguous().view(torch.float16)[..., 0].float()
    return codes, scales


def dequantize_rows(rows: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., D + 2] uint8 -> [..., D] in `dtype` (code * scale in float32, then cast)."""
    codes, scales = row_codes(rows, name)
    return (codes * scales[..., None]).to(dtype)
