"""Paged attention in Triton: one varlen kernel for mixed batches, and split-KV decode.

KV cache layout (per layer, K and V alike): `[num_blocks, KVH, block_size, D]`, contiguous, so
one block of one KV head is a contiguous `[block_size, D]` page. Block tables are int32
`[B, W]`; entries past a sequence's last block are never read. Every kernel packs the query
heads that share a KV head (the GQA group) into the M dimension of its tile, so each K/V tile
is loaded once per group, and accumulates in float32 with an online (streaming) softmax in
base 2 (`scale * log2(e)` is folded into the scores).

Only host-side Python ints (shapes, `max_query_len`, `num_splits`) pick launch shapes; all
per-sequence lengths are read in-kernel, so none of these calls syncs with the device and a
CUDA graph captured with fixed shapes stays valid for any lengths.

A quantized cache (`kv_cache_dtype` "int8" / "fp8", `kv_cache/quant.py`) is uint8
`[num_blocks, KVH, block_size * (D + 2)]`: each (block, KV head) page holds its rows' codes
`[block_size, D]`, then their float16 scales `[block_size]`, which the kernels read through
a float16 view of the same cache. With D a multiple of 16 and block_size of 8 every code
row is 16-byte aligned, so a `[BLOCK_N, D]` tile of codes is one vectorized load. The
kernels (constexpr KV_FMT: 0 float, 1 int8, 2 fp8) convert the codes exactly (fp8 in
integer arithmetic, so no GPU fp8 support is needed) and fold the scales in per key:
scores = (q . codes) * s_k, acc += (p * s_v) codes.

Tiles fit the device's opt-in shared memory per block (`varlen_tiles`, `decode_tiles`
over `attention_shared_bytes`): large head dims (Gemma 3's 256) take narrower key tiles on
99 KiB GPUs (sm_86 / sm_89) instead of failing to launch.

Under `TRITON_INTERPRET=1` (CPU tensors) tiles are upcast to float32 before `tl.dot` (the
interpreter's bfloat16 dot is wrong); on CUDA, 16-bit tiles feed the tensor cores directly
and float32 uses IEEE (not TF32) dots.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.engine.kv_cache.quant import kv_format

_LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _codes_to_float(b, KV_FMT: tl.constexpr):
    """uint8 codes -> float32 values (KV_FMT 1: int8; 2: fp8 e4m3fn, subnormals included)."""
    if KV_FMT == 1:
        return b.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        x = b.to(tl.int32)
        normal = (((x & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        sub = (x & 7).to(tl.float32) * 0.001953125  # exponent 0: m * 2^-9
        mag = tl.where((x & 0x78) == 0, sub, normal)
        return tl.where((x & 0x80) != 0, -mag, mag)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, start, key_lo,
                 key_hi, pos, row_ok, window, scale_log2, stride_kb, stride_ks, offs_d, d_ok,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                 PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr):
    """One online-softmax update of (m_i, l_i, acc) with keys [start, start + BLOCK_N) that
    lie in [key_lo, key_hi); query row r sits at position pos[r] (causal + window masks).
    k_ptr / v_ptr: this KV head's page in block 0; ks_ptr / vs_ptr: the same as float16
    (quantized caches: their scales are read through it)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = (n >= key_lo) & (n < key_hi)
    blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    if KV_FMT == 0:
        kv_off = blk * stride_kb + (n % BLOCK_SIZE) * stride_ks
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    else:
        # a page: BLOCK_SIZE rows of HEAD_DIM codes (16-byte aligned rows), then the scales
        kv_off = blk * stride_kb + (n % BLOCK_SIZE) * HEAD_DIM
        s_off = blk * (stride_kb // 2) + (BLOCK_SIZE * HEAD_DIM // 2) + n % BLOCK_SIZE
        k = _codes_to_float(tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask,
                                    other=0), KV_FMT).to(DOT)
        k_scale = tl.load(ks_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32) * scale_log2
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * k_scale[None, :]
    keep = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= pos[:, None])
    keep = keep & ((window == 0) | (n[None, :] > pos[:, None] - window))
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to attend yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    if KV_FMT == 0:
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
        pv = tl.dot(p.to(v_ptr.dtype.element_ty).to(DOT), v, input_precision=PRECISION)
    else:
        v = _codes_to_float(tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask,
                                    other=0), KV_FMT).to(DOT)
        p_v = p * tl.load(vs_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        pv = tl.dot(p_v.to(DOT), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


# Per-step values are not specialised on: the batch size and block-table width vary every step,
# and the metadata pointers are views at arbitrary int32 offsets of one uploaded buffer, so
# Triton's default (==1 / %16 integer and 16-byte pointer-alignment keys) would compile new
# variants mid-serving as those change. Only loop/launch-shaping constexprs pick a kernel.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["seq_lens_ptr", "qs_ptr"])
def _varlen_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, bt_ptr, seq_lens_ptr, qs_ptr,
                   num_seqs,
                   scale_log2, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_kb, stride_kh, stride_ks,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                   KV_FMT: tl.constexpr):
    """Program (tile, kvh): BLOCK_Q query tokens x GROUP heads of one sequence. Sequence b owns
    tiles [qs[b] // BLOCK_Q + b, qs[b + 1] // BLOCK_Q + b + 1) (a superset of what it needs),
    found by binary search, so the grid is T // BLOCK_Q + B without reading lengths."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qs_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(qs_ptr + b)
    qlen = tl.load(qs_ptr + b + 1) - q_start
    local = tile - (q_start // BLOCK_Q + b)
    if local * BLOCK_Q >= qlen:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - qlen  # the new tokens are the sequence's last qlen positions

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = local * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < qlen)
    pos = ctx + tok
    t64 = (q_start + tok).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + t64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0).to(DOT)

    first = ctx + local * BLOCK_Q
    key_hi = tl.minimum(first + BLOCK_Q, seq_len)  # causal: nothing above the tile's last row
    key_lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)  # window's left edge
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head = kvh.to(tl.int64) * stride_kh
    s_head = kvh.to(tl.int64) * (stride_kh // 2)
    for start in range((key_lo // BLOCK_N) * BLOCK_N, key_hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr + kv_head, v_ptr + kv_head,
                                     ks_ptr + s_head, vs_ptr + s_head, bt_row, start, key_lo,
                                     key_hi, pos, row_ok, window, scale_log2, stride_kb,
                                     stride_ks, offs_d, d_ok, BLOCK_SIZE, BLOCK_N, DOT,
                                     PRECISION, HEAD_DIM, KV_FMT)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + t64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["seq_lens_ptr"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
                   bt_ptr, seq_lens_ptr, scale_log2, window, stride_qb, stride_qh, stride_ob,
                   stride_oh, stride_bt, stride_kb, stride_kh, stride_ks, stride_wb, stride_wh,
                   stride_ab, stride_ah, stride_as,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                   KV_FMT: tl.constexpr):
    """Program (b, kvh, split): the GROUP heads of one KV head over one split of the keys.
    The attended keys [lo, seq_len) are cut into NUM_SPLITS runs of whole BLOCK_N tiles; a
    split past the end writes an empty partial (m = -inf, l = 0, acc = 0)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if seq_len == 0:
        return
    key_lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_tile = key_lo // BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N) - first_tile, NUM_SPLITS)
    start = (first_tile + split * per_split) * BLOCK_N
    stop = tl.minimum(start + per_split * BLOCK_N, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    head = kvh * GROUP + offs_m
    row_ok = offs_m < GROUP
    io_mask = row_ok[:, None] & d_ok[None, :]
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0).to(DOT)
    pos = tl.zeros([BLOCK_M], tl.int32) + (seq_len - 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + b64 * stride_bt
    kv_head = kvh.to(tl.int64) * stride_kh
    s_head = kvh.to(tl.int64) * (stride_kh // 2)
    for tile_start in range(start, stop, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr + kv_head, v_ptr + kv_head,
                                     ks_ptr + s_head, vs_ptr + s_head, bt_row, tile_start,
                                     key_lo, stop, pos, row_ok, window, scale_log2, stride_kb,
                                     stride_ks, offs_d, d_ok, BLOCK_SIZE, BLOCK_N, DOT,
                                     PRECISION, HEAD_DIM, KV_FMT)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + b64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=io_mask)
    else:
        ml = b64 * stride_wb + head * stride_wh + split
        tl.store(ws_m_ptr + ml, m_i, mask=row_ok)
        tl.store(ws_l_ptr + ml, l_i, mask=row_ok)
        a_off = b64 * stride_ab + head * stride_ah + split * stride_as
        tl.store(ws_acc_ptr + a_off[:, None] + offs_d[None, :], acc, mask=io_mask)


@triton.jit(do_not_specialize_on_alignment=["seq_lens_ptr"])
def _reduce_kernel(o_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, seq_lens_ptr, stride_ob, stride_oh,
                   stride_wb, stride_wh, stride_ab, stride_ah, stride_as,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """Program (b, h): merge the NUM_SPLITS partials of one head (log-sum-exp in base 2)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if tl.load(seq_lens_ptr + b) == 0:
        return
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    ml = b * stride_wb + h * stride_wh + s
    m = tl.load(ws_m_ptr + ml, mask=s_ok, other=float("-inf"))
    lsum = tl.load(ws_l_ptr + ml, mask=s_ok, other=0.0)
    a_off = b * stride_ab + h * stride_ah + s * stride_as
    acc = tl.load(ws_acc_ptr + a_off[:, None] + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # the first split is never empty, so the max is finite
    out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=d_ok)


@dataclass
class DecodeWorkspace:
    """Static float32 split-KV partials, reusable across steps and CUDA-graph replays:
    `m`/`l` `[max_batch, num_heads, num_splits]`, `acc` `[max_batch, num_heads, num_splits, D]`."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the softmax denominator's usual name)
    acc: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, num_splits: int,
                 device: torch.device | str) -> DecodeWorkspace:
        shape = (max_batch, num_heads, num_splits)
        return cls(m=torch.empty(shape, dtype=torch.float32, device=device),
                   l=torch.empty(shape, dtype=torch.float32, device=device),
                   acc=torch.empty((*shape, head_dim), dtype=torch.float32, device=device))

    @property
    def num_splits(self) -> int:
        return int(self.m.shape[2])


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Power-of-two split-KV count for decode (<= 16): enough (batch, KV head, split) programs
    for about two per SM, each split at least 256 keys; 1 when the batch already fills the GPU
    or contexts are short."""
    programs = max(1, batch * num_kv_heads)
    want = triton.next_power_of_2(max(1, math.ceil(2 * num_sms / programs)))
    splits = min(want, 16)
    while splits > 1 and max_seq_len < splits * 256:
        splits //= 2
    return splits


def _dot_config(dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    if dtype not in _TL_DTYPES:
        raise ValueError(f"attention supports float32, bfloat16 and float16, not {dtype}")
    if device.type != "cuda" or dtype == torch.float32:
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "tf32"


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, kv_cache_dtype: str,
           block_size: int | None) -> tuple[int, int]:
    """Validate shapes/dtypes shared by both entry points; returns the GQA group size and
    the block size (a float cache's shape[2]; a quantized cache's must be given)."""
    fmt = kv_format(kv_cache_dtype)
    if q.dim() != 3 or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"q and out must be [T, H, D] of one dtype, got {tuple(q.shape)} "
                         f"{q.dtype} and {tuple(out.shape)} {out.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if fmt.quantized and block_size is None:
        raise ValueError(f"a {fmt.name} KV cache needs its block_size")
    bs = k_cache.shape[2] if block_size is None else block_size
    want_shape = fmt.cache_shape(k_cache.shape[0], k_cache.shape[1], bs, head_dim)
    if k_cache.shape != want_shape or k_cache.shape != v_cache.shape or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{num_heads} query heads of dim {head_dim} need contiguous "
                         f"k_cache and v_cache {list(want_shape)} ([num_blocks, KV heads, "
                         f"...]), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    want = fmt.cache_dtype(q.dtype)
    if k_cache.dtype != want or v_cache.dtype != want:
        raise ValueError(f"cache dtype {k_cache.dtype} is not {want} (q {q.dtype}, "
                         f"kv_cache_dtype {fmt.name!r})")
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not fit a cache of {num_kv_heads} KV "
                         "heads")
    for t in (q, out):
        if t.shape[0] and (t.stride(2) != 1 or t.stride(1) != head_dim):
            raise ValueError("q/out heads and head_dim must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or seq_lens.dim() != 1 or (
            block_tables.shape[0] != seq_lens.shape[0]):
        raise ValueError("block_tables must be [B, W] (rows contiguous) and seq_lens [B]")
    return num_heads // num_kv_heads, bs


def _row_stride(k_cache: torch.Tensor) -> int:
    """A float cache's row stride (stride_ks); quantized pages' rows are HEAD_DIM apart."""
    return k_cache.stride(2) if k_cache.dim() == 4 else 0


def _scale_views(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_cache_dtype: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels' ks_ptr / vs_ptr point at: a quantized cache as float16 (its scales
    are read through it), a float cache itself (unused)."""
    if kv_format(kv_cache_dtype).quantized:
        return k_cache.view(torch.float16), v_cache.view(torch.float16)
    return k_cache, v_cache


def _check_window(sliding_window: int) -> None:
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0 = none), got {sliding_window}")


# opt-in shared memory per block where the device cannot be asked: the smallest of the
# GPUs Triton serves (sm_86 / sm_89: A10, L4, RTX 30x0 / 40x0; 99 KiB)
DEFAULT_SHARED_LIMIT = 99 * 1024


class TilePlan(NamedTuple):
    """An attention launch's tile: BLOCK_M query rows, BLOCK_N keys, pipeline stages."""

    block_m: int
    block_n: int
    stages: int


def attention_shared_bytes(block_m: int, block_n: int, stages: int, d_pad: int, elt: int,
                           wgmma: bool = False) -> int:
    """An upper bound on the shared memory (bytes) of a varlen or decode launch: the Q
    tile, the buffered K / V tiles and the P tile fed to the second dot, in `elt`-byte
    elements, plus 1 KiB of barriers. Measured from the kernels Triton 3.9 compiles for
    sm_80 / sm_86 / sm_89 / sm_90 at head dims 64-256 (`tests/engine/test_attention_tiles.
    py` checks it): with mma.sync (compute capability < 9, or tiles under 64 rows) the
    pipeliner keeps one K and one V buffer from 2 stages on (1 tile at 1 stage, two each
    from 5); Hopper's wgmma tiles (`wgmma`, 64+ rows) keep `stages` of each."""
    if wgmma and block_m >= 64:
        kv = 2 * stages
    else:
        kv = 1 if stages == 1 else 2 if stages <= 4 else 2 * (stages - 3)
    return elt * (block_m * d_pad + kv * block_n * d_pad + block_m * block_n) + 1024


def _halvings(top: int, floor: int) -> list[int]:
    out = [top]
    while out[-1] // 2 >= floor:
        out.append(out[-1] // 2)
    return out


def varlen_tiles(max_query_len: int, group: int, d_pad: int, elt: int, shared_limit: int,
                 wgmma: bool = False) -> TilePlan:
    """The varlen kernel's tile. BLOCK_M (query tokens × the GQA group's heads): a power
    of two from 16 to 128 covering the longest chunk, at most 64 in fp32, never under the
    group. It is the first that fits `shared_limit` (`attention_shared_bytes`) in this
    order: 64 keys and 2 stages with BLOCK_M halved down to 64; 32 keys (FlashAttention's
    head-dim-256 tile on 99 KiB GPUs: 64 x 32); then BLOCK_M under 64 with 64 and 32 keys;
    then 16 keys, 2 stages and 1. Nothing fitting: the smallest (Triton then names the
    shortfall). bf16 at D 128: 128 x 64 everywhere; D 256: 128 x 64 on an H100 / H200,
    64 x 32 on sm_86 / sm_89."""
    top = min(128, max(16, triton.next_power_of_2(max(1, max_query_len) * group)))
    if elt == 4:  # fp32 tiles are twice the shared memory
        top = min(top, 64)
    floor = max(16, triton.next_power_of_2(group))
    return _varlen_plan(max(top, floor), floor, d_pad, elt, shared_limit, wgmma)


@functools.cache  # called per layer per step; its keys are powers of two and device facts
def _varlen_plan(top: int, floor: int, d_pad: int, elt: int, shared_limit: int,
                 wgmma: bool) -> TilePlan:
    """`varlen_tiles`' search, BLOCK_M from `top` halved down to `floor`."""
    rows = _halvings(top, floor)
    big = [m for m in rows if m >= min(top, 64)]
    small = [m for m in rows if m < min(top, 64)]
    order = ([(m, 64, 2) for m in big] + [(m, 32, 2) for m in big]
             + [(m, 64, 2) for m in small] + [(m, 32, 2) for m in small]
             + [(floor, 16, 2), (floor, 16, 1)])
    for m, n, stages in order:
        if attention_shared_bytes(m, n, stages, d_pad, elt, wgmma) <= shared_limit:
            return TilePlan(m, n, stages)
    return TilePlan(*order[-1])


def varlen_block_m(max_query_len: int, group: int, d_pad: int, elt: int,
                   shared_limit: int, wgmma: bool = False) -> int:
    """`varlen_tiles`' BLOCK_M."""
    return varlen_tiles(max_query_len, group, d_pad, elt, shared_limit, wgmma).block_m


def decode_tiles(config: DecodeConfig, group: int, d_pad: int, elt: int, shared_limit: int,
                 wgmma: bool = False) -> DecodeConfig:
    """`config` cut to fit `shared_limit`: stages down to 3 (one K / V buffer), then
    BLOCK_N halved (to 16), then 1 stage; unchanged when it fits (bf16 at every head dim
    up to 256 on a 99 KiB GPU; float32 at D 256 there takes 32 keys)."""
    block_m = max(16, triton.next_power_of_2(group))

    def fits(c: DecodeConfig) -> bool:
        return attention_shared_bytes(block_m, c.block_n, c.num_stages, d_pad, elt,
                                      wgmma) <= shared_limit

    if fits(config):
        return config
    if config.num_stages > 3:
        config = replace(config, num_stages=3)
    while not fits(config) and config.block_n > 16:
        config = replace(config, block_n=config.block_n // 2)
    if not fits(config):
        config = replace(config, num_stages=1)
    return config


@functools.cache
def _shared_memory_limit(device: torch.device) -> int:
    """Opt-in shared memory per block on a CUDA device (bytes; `DEFAULT_SHARED_LIMIT` when
    neither torch nor Triton's driver says); unbounded elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1 << 62
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if limit is None:  # older torch: ask Triton's driver
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            limit = triton.runtime.driver.active.utils.get_device_properties(
                index)["max_shared_mem"]
        except Exception:  # noqa: BLE001 - any driver failure: the conservative default
            limit = DEFAULT_SHARED_LIMIT
    return int(limit)


@functools.cache
def _wgmma(device: torch.device) -> bool:
    """Whether Triton may compile 64-row tiles to Hopper's wgmma (compute capability 9+),
    whose K / V buffers are deeper (`attention_shared_bytes`)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, *, scale: float, max_query_len: int,
                    sliding_window: int = 0, kv_cache_dtype: str = "auto",
                    block_size: int | None = None) -> None:
    """Varlen causal attention of a mixed batch into `out` (q/out `[T, H, D]`). Sequence b's
    new tokens are q rows [query_start[b], query_start[b + 1]), its last positions of
    `seq_lens[b]` (their K/V already cached). `max_query_len` (a host int, an upper bound is
    fine) only picks the tile size. Rows past query_start[B] and qlen-0 sequences are untouched.
    kv_cache_dtype "int8" / "fp8": the caches are quantized uint8 pages
    [num_blocks, KVH, block_size * (D + 2)] and `block_size` must be given."""
    group, bs = _check(q, k_cache, v_cache, out, block_tables, seq_lens, kv_cache_dtype,
                       block_size)
    _check_window(sliding_window)
    num_seqs = seq_lens.shape[0]
    if query_start.dtype != torch.int32 or query_start.shape != (num_seqs + 1,):
        raise ValueError("query_start must be int32 [B + 1]")
    if q.shape[0] == 0 or num_seqs == 0:
        return
    dot, precision = _dot_config(q.dtype, q.device)
    head_dim = q.shape[2]
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, stages = varlen_tiles(max_query_len, group, d_pad, q.element_size(),
                                            _shared_memory_limit(q.device), _wgmma(q.device))
    block_q = block_m // group
    grid = (q.shape[0] // block_q + num_seqs, k_cache.shape[1])
    _varlen_kernel[grid](
        q, k_cache, v_cache, *_scale_views(k_cache, v_cache, kv_cache_dtype), out,
        block_tables, seq_lens, query_start, num_seqs,
        scale * _LOG2E, sliding_window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), _row_stride(k_cache),
        GROUP=group, BLOCK_SIZE=bs, HEAD_DIM=head_dim,
        D_PAD=d_pad, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n, DOT=dot, PRECISION=precision,
        KV_FMT=kv_format(kv_cache_dtype).code, num_warps=8 if block_m >= 128 else 4,
        num_stages=stages)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (`bench/gpu_sweep.py` measures the choices).

    `num_stages` is Triton's software-pipelining depth over the key tiles. The K/V tile
    loads depend on a block-table load, so the pipeliner gives them fewer stages than
    `num_stages`: compiled for sm_90 (Triton 3.9), 3 and 4 keep one shared-memory buffer
    per tile and wait for every copy before computing (no overlap); 5 is the first value
    with two buffers (the next tile loads while this one computes). `bench/gpu_sweep.py`
    reports what the installed Triton compiles."""

    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_n < 16 or self.num_stages < 1:
            raise ValueError(f"block_n must be >= 16 and num_stages >= 1, got {self}")


# what `paged_decode_attention` launches unless told otherwise: the one place to change it
DECODE_CONFIG = DecodeConfig()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           *, scale: float, sliding_window: int = 0, num_splits: int = 1,
                           workspace: DecodeWorkspace | None = None,
                           kv_cache_dtype: str = "auto", block_size: int | None = None,
                           config: DecodeConfig | None = None) -> None:
    """Decode attention (one new token per sequence, q/out `[B, H, D]`) into `out`; rows with
    seq_lens[b] == 0 are untouched. num_splits > 1 splits each context into that many key
    ranges (computed in-kernel) reduced by a second kernel through `workspace` (allocated
    per call when None, which a CUDA graph must not rely on). kv_cache_dtype and block_size
    as `paged_attention`'s; `config` the launch parameters (default `DECODE_CONFIG`), cut
    to the device's shared memory (`decode_tiles`)."""
    group, bs = _check(q, k_cache, v_cache, out, block_tables, seq_lens, kv_cache_dtype,
                       block_size)
    d_pad = max(16, triton.next_power_of_2(q.shape[2]))
    cfg = decode_tiles(DECODE_CONFIG if config is None else config, group, d_pad,
                       q.element_size(), _shared_memory_limit(q.device), _wgmma(q.device))
    _check_window(sliding_window)
    batch, num_heads, head_dim = q.shape
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} rows for a batch of {batch}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if batch == 0:
        return
    if num_splits > 1 and workspace is None:
        workspace = DecodeWorkspace.allocate(batch, num_heads, head_dim, num_splits, q.device)
    if workspace is not None and num_splits > 1 and (
            workspace.acc.shape[0] < batch or workspace.acc.shape[1] != num_heads
            or workspace.acc.shape[3] != head_dim or workspace.num_splits < num_splits
            or not all(t.is_contiguous() for t in (workspace.m, workspace.l, workspace.acc))):
        raise ValueError(f"workspace {tuple(workspace.acc.shape)} too small for batch {batch}, "
                         f"{num_heads} heads, dim {head_dim}, {num_splits} splits")
    ws = workspace if num_splits > 1 else None
    ws_m, ws_l, ws_acc = (ws.m, ws.l, ws.acc) if ws else (out, out, out)  # unused when 1 split
    dot, precision = _dot_config(q.dtype, q.device)
    ws_strides = ((ws.m.stride(0), ws.m.stride(1), ws.acc.stride(0), ws.acc.stride(1),
                   ws.acc.stride(2)) if ws else (0, 0, 0, 0, 0))
    _decode_kernel[(batch, k_cache.shape[1], num_splits)](
        q, k_cache, v_cache, *_scale_views(k_cache, v_cache, kv_cache_dtype), out, ws_m, ws_l,
        ws_acc, block_tables, seq_lens,
        scale * _LOG2E, sliding_window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), _row_stride(k_cache),
        *ws_strides,
        GROUP=group, BLOCK_SIZE=bs, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
        NUM_SPLITS=num_splits, DOT=dot, PRECISION=precision,
        KV_FMT=kv_format(kv_cache_dtype).code, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if ws is not None:
        _reduce_kernel[(batch, num_heads)](
            out, ws.m, ws.l, ws.acc, seq_lens, out.stride(0), out.stride(1), *ws_strides,
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4)
