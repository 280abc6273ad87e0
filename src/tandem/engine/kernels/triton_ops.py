"""Triton element-wise kernels of the Llama block: residual add + RMSNorm, SwiGLU, RoPE, and
the K/V write into the paged cache.

Same semantics as the torch reference in `model/ops.py` (HF's math): every load is widened to
float32 and each intermediate the reference rounds to the activation dtype is rounded here too
(bfloat16 RoPE and residual adds match torch bit for bit; RMSNorm and SwiGLU within one ulp,
from reduction order and `exp`). Rows may be strided (views of the fused QKV output); the
last dimension must be contiguous. Every index that can pass 2**31 (token * row stride, cache
block * block stride) is int64. A program handles a tile of several rows (more under the
interpreter, where each program is a Python call). Import only after
`kernels.triton_unavailable_reason` is None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import _interpreting, rows_strided_only

_TILE = 4096  # elements per program on a GPU
_TILE_INTERPRETED = 1 << 16
# read once, as @triton.jit reads TRITON_INTERPRET when this module is imported
_INTERPRETED = _interpreting()
_INTERPRET = tl.constexpr(_INTERPRETED)


def _rows_per_program(rows: int, row_elems: int) -> int:
    cap = _TILE_INTERPRETED if _INTERPRETED else _TILE
    return max(1, min(triton.next_power_of_2(max(rows, 1)), cap // row_elems))


def _warps(tile: int) -> int:
    return 4 if tile <= 2048 else 8


def _check_rows(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if not rows_strided_only(t):
        raise ValueError(f"{name}: only its rows may be strided (got strides {t.stride()})")


@triton.jit
def _cast(x, dt: tl.constexpr):
    """x.to(dt), rounding to nearest even. The interpreter truncates float32 -> bfloat16
    (a GPU rounds), so there the rounding is done on the bits."""
    if _INTERPRET and dt == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dt)


@triton.jit(do_not_specialize=["n_rows"])
def _add_rms_norm_kernel(out_ptr, res_ptr, x_ptr, w_ptr, n_rows, n_cols, out_stride,
                         res_stride, x_stride, eps, HAS_X: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    res_ptrs = res_ptr + rows[:, None] * res_stride + cols[None, :]
    r = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_X:
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        summed = _cast(r + x, res_ptr.dtype.element_ty)  # the stream keeps its dtype
        tl.store(res_ptrs, summed, mask=mask)
        r = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(r * r, axis=1) / n_cols + eps)
    normed = _cast(r * inv[:, None], res_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             _cast(normed * w[None, :], out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, *, out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (if x given); return (rms_norm(residual) * weight, residual).

    x, residual: [T, H]; the output has the dtype `weight * residual` has in torch, or is
    written into `out` ([T, H], rows may be strided).
    """
    _check_rows("residual", residual, 2)
    t, h = residual.shape
    if x is not None:
        _check_rows("x", x, 2)
        if x.shape != residual.shape:
            raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if weight.shape != (h,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{h}] vector, got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(t, h, dtype=torch.promote_types(weight.dtype, residual.dtype),
                          device=residual.device)
    else:
        _check_rows("out", out, 2)
    if t == 0:
        return out, residual
    block = triton.next_power_of_2(h)
    rows = _rows_per_program(t, block)
    _add_rms_norm_kernel[(triton.cdiv(t, rows),)](
        out, residual, residual if x is None else x, weight, t, h, out.stride(0),
        residual.stride(0), residual.stride(0) if x is None else x.stride(0), eps,
        HAS_X=x is not None, ROWS=rows, BLOCK=block, num_warps=_warps(rows * block))
    return out, residual


@triton.jit(do_not_specialize=["n_rows"])
def _silu_mul_kernel(out_ptr, in_ptr, n_rows, n_cols, out_stride, in_stride,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    gate_ptrs = in_ptr + rows[:, None] * in_stride + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    silu = _cast(g / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             _cast(silu * u, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I] (into `out` when given)."""
    _check_rows("gate_up", gate_up, 2)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {two_i}")
    n = two_i // 2
    if out is None:
        out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    else:
        _check_rows("out", out, 2)
        if out.shape != (t, n):
            raise ValueError(f"out must be [{t}, {n}], got {tuple(out.shape)}")
    if t == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    rows = _rows_per_program(t, block)
    grid = (triton.cdiv(t, rows), triton.cdiv(n, block))
    _silu_mul_kernel[grid](out, gate_up, t, n, out.stride(0), gate_up.stride(0),
                           ROWS=rows, BLOCK=block, num_warps=_warps(rows * block))
    return out


@triton.jit(do_not_specialize=["n_tokens"], do_not_specialize_on_alignment=["pos_ptr"])
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, n_tokens, n_heads, half, x_stride,
                 cos_stride, sin_stride, ROWS: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    tmask = tok < n_tokens
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, BLOCK_HALF)
    imask = i < half
    # both halves of a table row are equal: the first serves the whole head
    tmask2 = tmask[:, None] & imask[None, :]
    dt = x_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos[:, None] * cos_stride + i[None, :], mask=tmask2, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * sin_stride + i[None, :], mask=tmask2, other=0.0)
    c = _cast(c, dt).to(tl.float32)[:, None, :]
    s = _cast(s, dt).to(tl.float32)[:, None, :]
    mask = tmask[:, None, None] & (heads < n_heads)[None, :, None] & imask[None, None, :]
    lo_ptrs = (x_ptr + tok[:, None, None] * x_stride + heads[None, :, None] * (2 * half)
               + i[None, None, :])
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    # each product rounded as the reference rounds it (a no-op in float32)
    lo = _cast(x1 * c, dt).to(tl.float32) - _cast(x2 * s, dt).to(tl.float32)
    hi = _cast(x2 * c, dt).to(tl.float32) + _cast(x1 * s, dt).to(tl.float32)
    tl.store(lo_ptrs, _cast(lo, dt), mask=mask)
    tl.store(lo_ptrs + half, _cast(hi, dt), mask=mask)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place on x [T, heads, D] (rows may be strided) at `positions` [T]
    (int32/int64) from tables cos/sin [max_pos, D] (both halves equal). Returns x."""
    _check_rows("x", x, 3)
    t, heads, d = x.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{t}] int32/int64, got {tuple(positions.shape)} "
                         f"{positions.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != d or table.stride(1) != 1:
            raise ValueError(f"{name} must be [max_pos, {d}] with contiguous rows, got "
                             f"{tuple(table.shape)}")
    if t == 0 or heads == 0:
        return x
    half = d // 2
    block_heads, block_half = triton.next_power_of_2(heads), triton.next_power_of_2(half)
    rows = _rows_per_program(t, block_heads * block_half)
    _rope_kernel[(triton.cdiv(t, rows),)](
        x, positions.contiguous(), cos, sin, t, heads, half, x.stride(0), cos.stride(0),
        sin.stride(0), ROWS=rows, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half,
        num_warps=_warps(rows * block_heads * block_half))
    return x


@triton.jit(do_not_specialize=["n_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def _reshape_and_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, n_tokens,
                              n_heads, head_dim, block_size, k_stride, v_stride,
                              cache_block_stride, cache_head_stride, ROWS: tl.constexpr,
                              BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
    valid = (tok < n_tokens) & (slot >= 0)  # slot -1: padding, nothing written
    slot = tl.where(valid, slot, 0)
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None, None] & (heads < n_heads)[None, :, None] & (d < head_dim)[None, None, :]
    cache_off = ((slot // block_size) * cache_block_stride + (slot % block_size) * head_dim)
    cache_off = (cache_off[:, None, None] + heads[None, :, None] * cache_head_stride
                 + d[None, None, :])
    head_off = heads[None, :, None] * head_dim + d[None, None, :]
    k = tl.load(k_ptr + tok[:, None, None] * k_stride + head_off, mask=mask)
    v = tl.load(v_ptr + tok[:, None, None] * v_stride + head_off, mask=mask)
    tl.store(k_cache_ptr + cache_off, _cast(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, _cast(v, v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _div_rn(x, y):
    """x / y rounded to nearest (IEEE), as torch divides: GPUs' default `/` is approximate."""
    if _INTERPRET:
        return x / y
    else:
        return tl.math.div_rn(x, y)


@triton.jit
def _quantize_rows(x, FMT: tl.constexpr):
    """x [R, H, D] float32 -> (codes [R, H, D] uint8, scales [R, H] float16): the
    reference `kv_cache/quant.py` (FMT 1 int8, 2 fp8 e4m3fn), bit for bit."""
    amax = tl.max(tl.abs(x), axis=2)
    s = _div_rn(amax, 127.0 if FMT == 1 else 448.0)
    s16 = tl.minimum(tl.maximum(s, 6.103515625e-05), 65504.0).to(tl.float16)
    y = _div_rn(x, s16.to(tl.float32)[:, :, None])
    if FMT == 1:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        # y + 1.5 * 2^23 rounds to an integer (nearest even): it is the low mantissa bits
        q = (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
        codes = q.to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # normal (|y| >= 2^-6): round the mantissa to 3 bits (nearest even), rebias 127 -> 7
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal: |y| + 2^14 rounds |y| to a multiple of 2^-9 (the low mantissa bits)
        sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        codes = (tl.where(a >= 0x3C800000, normal, sub) | sign).to(tl.uint8)
    return codes, s16


@triton.jit(do_not_specialize=["n_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def _reshape_and_quantize_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr,
                                 slot_ptr, n_tokens, n_heads, head_dim, block_size, k_stride,
                                 v_stride, cache_block_stride, cache_head_stride,
                                 FMT: tl.constexpr, ROWS: tl.constexpr,
                                 BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    """reshape_and_cache into quantized pages [.., block_size * (D + 2)]: a row's codes at
    offset * D of its page, its float16 scale (through ks_ptr / vs_ptr, the caches as
    float16) at block_size * D + 2 * offset bytes."""
    tok = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
    valid = (tok < n_tokens) & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    row_ok = valid[:, None] & (heads < n_heads)[None, :]
    mask = row_ok[:, :, None] & (d < head_dim)[None, None, :]
    off = slot % block_size
    page = (slot // block_size) * cache_block_stride
    page = page[:, None] + heads[None, :] * cache_head_stride  # [ROWS, BLOCK_HEADS] bytes
    row = page + (off * head_dim)[:, None]
    scale = page // 2 + (block_size * head_dim // 2 + off)[:, None]  # float16 elements
    head_off = heads[None, :, None] * head_dim + d[None, None, :]
    _quantize_store(k_ptr + tok[:, None, None] * k_stride + head_off, k_cache_ptr, ks_ptr, row,
                    scale, d, mask, row_ok, FMT)
    _quantize_store(v_ptr + tok[:, None, None] * v_stride + head_off, v_cache_ptr, vs_ptr, row,
                    scale, d, mask, row_ok, FMT)


@triton.jit
def _quantize_store(src_ptrs, cache_ptr, scale_ptr, row, scale, d, mask, row_ok,
                    FMT: tl.constexpr):
    """Quantize the rows at src_ptrs [R, H, D] into codes at byte `row` [R, H] of the cache
    and scales at float16 element `scale` [R, H]."""
    x = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)
    codes, s16 = _quantize_rows(x, FMT)
    tl.store(cache_ptr + row[:, :, None] + d[None, None, :], codes, mask=mask)
    tl.store(scale_ptr + scale, s16, mask=row_ok)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      kv_cache_dtype: str = "auto", block_size: int | None = None) -> None:
    """Write k/v [T, KVH, D] (rows may be strided) into caches [num_blocks, KVH, block_size,
    D] at slot_mapping [T] (int32/int64, block * block_size + offset); slot < 0 is skipped.
    kv_cache_dtype "fp8" / "int8": the caches are uint8 pages [num_blocks, KVH,
    block_size * (D + 2)] (`block_size` must be given) and each row is quantized as
    `kv_cache/quant.py` does (the same bytes)."""
    from tandem.engine.kv_cache.quant import kv_format

    fmt = kv_format(kv_cache_dtype)
    _check_rows("k", k, 3)
    _check_rows("v", v, 3)
    t, heads, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if fmt.quantized and block_size is None:
        raise ValueError(f"a {fmt.name} KV cache needs its block_size")
    bs = block_size if fmt.quantized else (k_cache.shape[2] if k_cache.dim() == 4 else 0)
    nb = k_cache.shape[0] if k_cache.dim() else 0
    if tuple(k_cache.shape) != fmt.cache_shape(nb, heads, bs, d):
        want = ("[num_blocks, {heads}, {bs} * ({d} + 2)] uint8" if fmt.quantized
                else "[num_blocks, {heads}, block_size, {d}]").format(heads=heads, bs=bs, d=d)
        raise ValueError(f"k_cache must be {want}, got {tuple(k_cache.shape)}")
    if fmt.quantized and k_cache.dtype != torch.uint8:
        raise ValueError(f"a {fmt.name} KV cache must be uint8, got {k_cache.dtype}")
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous()
                                              and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{t}] int32/int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if t == 0:
        return
    block_heads, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(d)
    rows = _rows_per_program(t, block_heads * block_d)
    if fmt.quantized:
        _reshape_and_quantize_kernel[(triton.cdiv(t, rows),)](
            k, v, k_cache, v_cache, k_cache.view(torch.float16), v_cache.view(torch.float16),
            slot_mapping.contiguous(), t, heads, d, bs,
            k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1), FMT=fmt.code,
            ROWS=rows, BLOCK_HEADS=block_heads, BLOCK_D=block_d,
            num_warps=_warps(rows * block_heads * block_d))
        return
    _reshape_and_cache_kernel[(triton.cdiv(t, rows),)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), t, heads, d, k_cache.shape[2],
        k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1), ROWS=rows,
        BLOCK_HEADS=block_heads, BLOCK_D=block_d,
        num_warps=_warps(rows * block_heads * block_d))
