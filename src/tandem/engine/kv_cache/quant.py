"""Quantized KV cache pages: FP8 (e4m3) or INT8 codes with a float16 scale per token and head.

With `kv_cache_dtype` "fp8" or "int8" a layer's K (and V) cache is uint8
`[num_blocks, KVH, block_size * (D + 2)]`: each (block, KV head) page holds the
`block_size` rows' codes first (`[block_size, D]`, row o at byte `o * D`), then their
`block_size` float16 scales (little-endian, at byte `block_size * D + 2 * o`). The scales
sit apart from the codes, as in vLLM, so with `D` a multiple of 16 and `block_size` a
multiple of 8 every code row starts 16-byte aligned and the kernels read codes in wide
vectors (one `[BLOCK_N, D]` tile per load) instead of byte by byte. They stay inside the
page rather than in a tensor of their own so that a block is still one contiguous region
per layer and KV head: prefix-cache pages, P/D transfers and tensor-parallel page moves
move a block's K (or V) as one run of bytes that carries its own scales, with no second
tensor to keep in step. Per-row scales need no calibration, and two workers of one model
always produce the same bytes.

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
SCALE_BYTES = 2  # one float16 scale per (token, KV head) row, after the page's codes
FP16_MIN_NORMAL = 2.0 ** -14
FP16_MAX = 65504.0
_QMAX = {"int8": 127.0, "fp8": 448.0}
# the native and Triton kernels' format codes (0 = the model dtype, unquantized)
FORMAT_CODES = {"auto": 0, "int8": 1, "fp8": 2}


@dataclass(frozen=True)
class KVCacheFormat:
    """How one layer's K/V pages are stored: "auto" (the model dtype) or "fp8" / "int8"."""

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

    def cache_shape(self, num_blocks: int, num_kv_heads: int, block_size: int,
                    head_dim: int) -> tuple[int, ...]:
        """One layer's K (and V) tensor: `[num_blocks, KVH, block_size, D]` in the model
        dtype, or quantized `[num_blocks, KVH, block_size * (D + 2)]` uint8 pages."""
        if self.quantized:
            return (num_blocks, num_kv_heads, page_bytes(block_size, head_dim))
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def row_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one (token, KV head) costs with a model in `dtype` (its scale included)."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim * dtype.itemsize

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The cache tensors' dtype for a model in `dtype` (uint8 when quantized)."""
        return torch.uint8 if self.quantized else dtype


def kv_format(name: str) -> KVCacheFormat:
    """The format named `name` ("fp8_e4m3" is accepted as "fp8"); ConfigError otherwise."""
    return KVCacheFormat("fp8" if name == "fp8_e4m3" else name)


def page_bytes(block_size: int, head_dim: int) -> int:
    """Bytes of one quantized (block, KV head) page: the codes, then the scales."""
    return block_size * (head_dim + SCALE_BYTES)


def page_parts(pages: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized pages `[..., block_size * (D + 2)]` uint8 -> views (writes go through) of
    their codes `[..., block_size, D]` uint8 and scales `[..., block_size]` float16."""
    width = pages.shape[-1]
    if pages.dtype != torch.uint8 or width % block_size or width // block_size <= SCALE_BYTES:
        raise ValueError(f"quantized pages must be [..., {block_size} * (D + 2)] uint8, got "
                         f"{tuple(pages.shape)} {pages.dtype}")
    d = width // block_size - SCALE_BYTES
    codes = pages[..., : block_size * d].unflatten(-1, (block_size, d))
    return codes, pages[..., block_size * d:].view(torch.float16)


def row_scales(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., D] float -> the rows' scales [...] as float16 (amax / qmax, clamped)."""
    amax = x.abs().amax(dim=-1, keepdim=False).float()
    return (amax / _QMAX[name]).clamp_(FP16_MIN_NORMAL, FP16_MAX).to(torch.float16)


def quantize_rows(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes [..., D] uint8, scales [...] float16)."""
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
    return codes, s16


def code_values(codes: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 codes -> their values as float32 (before the scale)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if name == "int8":
        return codes.view(torch.int8).float()
    if name == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    raise ValueError(f"code_values needs kv_cache_dtype 'fp8' or 'int8', not {name!r}")


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, name: str,
                    dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] uint8 and scales [...] float16 -> [..., D] in `dtype` (code * scale in
    float32, then cast)."""
    return (code_values(codes, name) * scales.float()[..., None]).to(dtype)


def quantize_pages(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., block_size, D] float -> its quantized pages [..., block_size * (D + 2)]."""
    codes, scales = quantize_rows(x, name)
    return torch.cat([codes.flatten(-2), scales.view(torch.uint8)], dim=-1)


def dequantize_pages(pages: torch.Tensor, name: str, block_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """Quantized pages [..., block_size * (D + 2)] -> [..., block_size, D] in `dtype`."""
    codes, scales = page_parts(pages, block_size)
    return dequantize_rows(codes, scales, name, dtype)
