"""Triton dequantize-matmul for grouped integer (INT8 / INT4) and FP8 weights.

`grouped_linear(x, codes, scales, mins, bits, group_size, bias)` computes
`x @ W.T + bias` with W in the row-major layout of `quant/` (never materialised):
int8 codes `[N, K]` int8; int4 codes `[N, K // 2]` uint8 (low nibble = even k, high nibble
= odd k); scales / mins `[N, K // g]` (float16; any float dtype is read as float32);
`w = code * scale + min`. `fp8_linear` is the same kernel over float8_e4m3fn codes `[N, K]`
with one float32 scale per output row, or per row and group of `group_size` columns
(block-wise FP8 checkpoints: scales `[N, ceil(K / g)]`, the last group may be partial):
weight-only FP8 for GPUs without FP8 tensor cores, and for block-wise weights on any GPU.

A program computes a `BLOCK_M x BLOCK_N` output tile, walking K in `BLOCK_K` steps: codes
are loaded as bytes, dequantized in registers in float32 and fed to `tl.dot` in the
activation's dtype (float32 accumulation; float32 activations use IEEE dots, never TF32).
BLOCK_K divides the group size where it can (one scale per row per step); otherwise scales
are gathered per element and K is masked. INT4 splits x into its even and odd columns and
runs two dots of BLOCK_K / 2, so the packed bytes need no shuffling. With few output tiles
(decode, M <= 16) K is split across programs (`split_k`): float32 partials `[S, M, N]` are
summed by torch (deterministic), then bias and the cast. Under `TRITON_INTERPRET=1` the dots
run in float32 (the interpreter's 16-bit dot is wrong) with larger tiles. M is not
specialised on (the batch changes every step). Import only after
`kernels.triton_unavailable_reason` is None.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import _interpreting
from tandem.engine.kernels.triton_attention import _dot_config, _shared_memory_limit
from tandem.engine.kernels.triton_ops import _cast

_INTERPRETED = _interpreting()
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT8, _INT4, _FP8 = 8, 4, 3  # the kernel's CODE values


@triton.jit
def _e4m3_to_f32(b):
    """float8_e4m3fn bytes (as int32 0..255) -> float32, with integer ops only (so GPUs
    without FP8 conversions run it). 0x7F / 0xFF (NaN) are never stored by `quant/fp8.py`."""
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _scale_min(s_ptr, m_ptr, rn, kg, mask, stride_sn, HAS_MINS: tl.constexpr):
    """Scales (and mins) at rows rn, groups kg (broadcastable index tensors) as float32."""
    s = tl.load(s_ptr + rn * stride_sn + kg, mask=mask, other=0.0).to(tl.float32)
    if HAS_MINS:
        mn = tl.load(m_ptr + rn * stride_sn + kg, mask=mask, other=0.0).to(tl.float32)
    else:
        mn = 0.0
    return s, mn


@triton.jit(do_not_specialize=["M"])
def _grouped_linear_kernel(x_ptr, c_ptr, s_ptr, m_ptr, b_ptr, o_ptr, M, N, K, group_size,
                           k_per_split, stride_xm, stride_cn, stride_sn, stride_om, stride_os,
                           CODE: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SCALE_PER_TILE: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Program (m tile, n tile, k split): acc = x[rm, ks] @ W[rn, ks].T over its K range."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    rn64 = rn.to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    HALF: tl.constexpr = BLOCK_K // 2
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if CODE == 4:
            rj = k0 // 2 + tl.arange(0, HALF)  # byte j holds k = 2j (low) and 2j + 1 (high)
            j_ok = rj < K // 2
            mask = j_ok[:, None] & n_ok[None, :]
            raw = tl.load(c_ptr + rn64[None, :] * stride_cn + rj[:, None], mask=mask,
                          other=0).to(tl.int32)
            if SCALE_PER_TILE:
                s, mn = _scale_min(s_ptr, m_ptr, rn64[None, :], k0 // group_size,
                                   n_ok[None, :], stride_sn, HAS_MINS)
            else:
                kg = (2 * rj // group_size)[:, None]
                s, mn = _scale_min(s_ptr, m_ptr, rn64[None, :], kg, mask, stride_sn, HAS_MINS)
            w_lo = ((raw & 0xF).to(tl.float32) * s + mn).to(DOT)
            w_hi = ((raw >> 4).to(tl.float32) * s + mn).to(DOT)
            x_ok = m_ok[:, None] & j_ok[None, :]
            x_even = tl.load(x_rows + 2 * rj[None, :], mask=x_ok, other=0.0).to(DOT)
            x_odd = tl.load(x_rows + 2 * rj[None, :] + 1, mask=x_ok, other=0.0).to(DOT)
            acc += tl.dot(x_even, w_lo, input_precision=PRECISION)
            acc += tl.dot(x_odd, w_hi, input_precision=PRECISION)
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            ptrs = c_ptr + rn64[None, :] * stride_cn + rk[:, None]
            mask = k_ok[:, None] & n_ok[None, :]
            if CODE == 8:
                q = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
            else:
                q = _e4m3_to_f32(tl.load(ptrs, mask=mask, other=0).to(tl.int32))
            if SCALE_PER_TILE:
                s, mn = _scale_min(s_ptr, m_ptr, rn64[None, :], k0 // group_size,
                                   n_ok[None, :], stride_sn, HAS_MINS)
            else:
                s, mn = _scale_min(s_ptr, m_ptr, rn64[None, :], (rk // group_size)[:, None],
                                   mask, stride_sn, HAS_MINS)
            w = (q * s + mn).to(DOT)
            xt = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0).to(DOT)
            acc += tl.dot(xt, w, input_precision=PRECISION)
    out_mask = m_ok[:, None] & n_ok[None, :]
    o_rows = o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn64[None, :]
    if SPLIT:
        tl.store(o_rows + pid_k.to(tl.int64) * stride_os, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_rows, _cast(acc, o_ptr.dtype.element_ty), mask=out_mask)


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, opt-in shared memory per block) of a CUDA device; (1, unbounded) elsewhere."""
    if device.type != "cuda":
        return 1, 1 << 62
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, _shared_memory_limit(device)


def _block_k(group_size: int, cap: int, floor: int) -> tuple[int, bool]:
    """(BLOCK_K, one scale per row per K step): the largest power of two in [floor, cap]
    dividing the group size, else `cap` with per-element scales."""
    bk = cap
    while bk >= floor:
        if group_size % bk == 0:
            return bk, True
        bk //= 2
    return cap, False


def _config(m: int, elt: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, K cap, warps, stages) for M rows of `elt`-byte activations."""
    if device.type != "cuda":  # the interpreter: few, large programs
        return min(64, max(16, triton.next_power_of_2(m))), 64, 128, 4, 1
    _, shared = _device_limits(device)
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = triton.next_power_of_2(m), 128, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    # x tile + code bytes per stage, plus the dequantized tile fed to the dot
    while bm > 16 and (stages * (bm * bk * elt + bk * bn) + bk * bn * elt) > shared:
        bm //= 2
    return bm, bn, bk, warps, stages


def _split_k(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """K splits for about two programs per SM when the output has few tiles (<= 16)."""
    sms, _ = _device_limits(device)
    steps = triton.cdiv(k, block_k)
    if device.type != "cuda" or tiles >= sms or steps < 2:
        return 1
    return max(1, min(steps, 16, triton.cdiv(2 * sms, tiles)))


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
           mins: torch.Tensor | None, bias: torch.Tensor | None, n: int, k: int,
           groups: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or (x.shape[0] and x.stride(1) != 1):
        raise ValueError(f"x must be [M, {k}] with contiguous rows, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, not {x.dtype}")
    if not codes.is_contiguous():
        raise ValueError("codes must be contiguous")
    for name, t in (("scales", scales), ("mins", mins)):
        if t is None:
            continue
        if tuple(t.shape) != (n, groups) or not t.is_contiguous() or not t.is_floating_point():
            raise ValueError(f"{name} must be contiguous float [{n}, {groups}], got "
                             f"{tuple(t.shape)} {t.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    for t in (codes, scales, mins, bias):
        if t is not None and t.device != x.device:
            raise ValueError(f"tensors on {t.device} and {x.device}")


class LaunchPlan(NamedTuple):
    """Tile sizes of one call: BLOCK_M/N/K, one scale per K step, the K split, warps,
    pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    scale_per_tile: bool
    splits: int
    k_per_split: int
    warps: int
    stages: int


def launch_plan(m: int, n: int, k: int, code_bits: int, group_size: int, x_elt: int,
                device: torch.device, split_k: int | None = None) -> LaunchPlan:
    """The tiles and K split `grouped_linear` / `fp8_linear` use for x [m, k] of `x_elt`-byte
    elements and an [n, k] weight of `code_bits`-bit codes (split_k None: chosen)."""
    bm, bn, cap, warps, stages = _config(m, x_elt, device)
    bk, per_tile = _block_k(group_size, cap, 32 if code_bits == 4 else 16)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    splits = _split_k(tiles, k, bk, device) if split_k is None else split_k
    if splits < 1:
        raise ValueError(f"split_k must be >= 1, got {splits}")
    k_per_split = triton.cdiv(triton.cdiv(max(k, 1), splits), bk) * bk
    return LaunchPlan(bm, bn, bk, per_tile, triton.cdiv(max(k, 1), k_per_split), k_per_split,
                      warps, stages)


def _launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
            mins: torch.Tensor | None, code: int, group_size: int, bias: torch.Tensor | None,
            n: int, k: int, split_k: int | None) -> torch.Tensor:
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    p = launch_plan(m, n, k, 4 if code == _INT4 else 8, group_size, x.element_size(),
                    x.device, split_k)
    dot, precision = _dot_config(x.dtype, x.device)  # IEEE float32 dots, never TF32
    dst = out if p.splits == 1 else torch.empty(p.splits, m, n, dtype=torch.float32,
                                                device=x.device)
    grid = (triton.cdiv(m, p.block_m), triton.cdiv(n, p.block_n), p.splits)
    _grouped_linear_kernel[grid](
        x, codes, scales, scales if mins is None else mins, scales if bias is None else bias,
        dst, m, n, k, group_size, p.k_per_split, x.stride(0), codes.stride(0),
        scales.stride(0), n, m * n, CODE=code, HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None, SCALE_PER_TILE=p.scale_per_tile, SPLIT=p.splits > 1,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, DOT=dot, PRECISION=precision,
        num_warps=p.warps, num_stages=p.stages)
    if p.splits > 1:
        acc = dst.sum(0)
        if bias is not None:
            acc += bias.float()
        out.copy_(acc)
    return out


def grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor | None, bits: int, group_size: int,
                   bias: torch.Tensor | None = None, *, split_k: int | None = None
                   ) -> torch.Tensor:
    """x [M, K] (float32 / bfloat16 / float16, rows may be strided) @ W.T + bias -> [M, N]
    in x.dtype, W = codes * scales + mins over groups of `group_size` columns.

    bits=8: codes [N, K] int8; bits=4: codes [N, K // 2] uint8 (k = 2j in byte j's low
    nibble, 2j + 1 in its high one; group_size even). scales / mins [N, K // group_size].
    `split_k` overrides the K-split count (None: chosen from the device and the shape).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    want = torch.int8 if bits == 8 else torch.uint8
    if codes.dim() != 2 or codes.dtype != want:
        raise ValueError(f"{bits}-bit codes must be 2-D {want}, got {tuple(codes.shape)} "
                         f"{codes.dtype}")
    n = codes.shape[0]
    k = codes.shape[1] * (2 if bits == 4 else 1)
    if group_size <= 0 or k % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"group_size {group_size} does not divide K={k}"
                         + (" (int4 needs an even group)" if bits == 4 else ""))
    _check(x, codes, scales, mins, bias, n, k, k // group_size)
    return _launch(x, codes, scales, mins, _INT8 if bits == 8 else _INT4, group_size, bias,
                   n, k, split_k)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, group_size: int | None = None,
               split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ W.T + bias -> [M, N] in x.dtype, weight [N, K] float8_e4m3fn (decoded
    with integer ops). `group_size` None: scale [N] float32, W = weight * scale[:, None];
    g: scale [N, ceil(K / g)] float32, W[n, k] = weight[n, k] * scale[n, k // g]."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be 2-D float8_e4m3fn, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    n, k = weight.shape
    if group_size is None:
        if tuple(scale.shape) != (n,):
            raise ValueError(f"scale must be [{n}], got {tuple(scale.shape)}")
        scales, group_size, groups = scale.reshape(n, 1), max(k, 1), 1
    else:
        if group_size < 1:
            raise ValueError(f"group_size must be positive, got {group_size}")
        scales, groups = scale, triton.cdiv(k, group_size)
    _check(x, weight, scales, None, bias, n, k, groups)
    return _launch(x, weight.view(torch.uint8), scales, None, _FP8, group_size, bias, n, k,
                   split_k)
