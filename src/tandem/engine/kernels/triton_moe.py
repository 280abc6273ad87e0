"""Fused mixture-of-experts in Triton (in the style of vLLM's `fused_moe`).

`fused_moe(x, w13, w2, weights, ids)` computes, for every token t, the sum over its k
routed experts e of `weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` with the
experts' float weights stacked: `w13 [E, 2I, H]` (gate rows, then up rows), `w2 [E, H, I]`.

1. `align_block_size` (torch, on the device, no host synchronisation): the T*k assignments
   sorted by expert, each expert's run padded to a multiple of BLOCK_M (`sorted_ids`,
   padding = T*k), and the expert of every BLOCK_M block (`block_expert`; blocks past the
   end, or of the "skip" bucket E, carry an id >= E). Sized to the worst case,
   T*k + (E + 1) * (BLOCK_M - 1) rows, so nothing is read back to the host (a CUDA graph
   captures it).
2. `_gate_up_kernel`: one launch, a program per (block, column tile of I): rows x[token]
   of the block's assignments times the gate and up rows of its expert, SiLU-and-mul fused
   in the epilogue -> `inter [T*k, I]` at each assignment's row.
3. `_down_kernel`: one launch over the same blocks: `inter` rows times the expert's down
   weight, each output rounded to the activation dtype, times its routing weight (float32)
   and rounded again (transformers' order) -> `[T*k, H]`, summed over k by torch.
Ids >= E (experts another tensor-parallel rank holds) are skipped: their rows stay 0.

Float32 accumulation; float32 activations use IEEE dots (never TF32); under
`TRITON_INTERPRET=1` the dots run in float32. Import only after
`kernels.triton_unavailable_reason` is None.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.triton_attention import _dot_config, _shared_memory_limit
from tandem.engine.kernels.triton_ops import _cast


class Aligned(NamedTuple):
    """Assignments grouped by expert in BLOCK_M blocks (see the module docstring)."""

    sorted_ids: torch.Tensor  # [P] int32: flat assignment index, T*k = padding
    block_expert: torch.Tensor  # [P / BLOCK_M] int32: the block's expert, >= E: skip


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """ids [T, k] (values in [0, E]; E = skip) -> `Aligned`, each expert's run padded to a
    multiple of `block_m`; P = T*k + (E + 1) * (block_m - 1), rounded up to `block_m`."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    rows = triton.cdiv(n + (num_experts + 1) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))  # (bincount would read its size back from the GPU)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first index in `order`
    pos = (ends - padded)[sorted_e] + torch.arange(n, device=dev) - first[sorted_e]
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    starts = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return Aligned(sorted_ids, block_expert)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, o_ptr, sorted_ptr, bexp_ptr, num_assign, top_k,
                    num_experts, N, K, stride_xm, stride_we, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Program (block, n tile): o[a] = silu(x[a // k] @ Wg.T) * (x[a // k] @ Wu.T) over the
    block's assignments a, columns n of its expert's gate (rows n) and up (rows N + n)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < num_experts:
        a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        a_ok = a < num_assign
        rows = x_ptr + (a // top_k).to(tl.int64)[:, None] * stride_xm
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w_e = w_ptr + e.to(tl.int64) * stride_we
        gate_cols = w_e + rn.to(tl.int64)[None, :] * stride_wn
        up_cols = w_e + (rn + N).to(tl.int64)[None, :] * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            xt = tl.load(rows + rk[None, :], mask=a_ok[:, None] & k_ok[None, :],
                         other=0.0).to(DOT)
            w_mask = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(gate_cols + rk[:, None], mask=w_mask, other=0.0).to(DOT)
            wu = tl.load(up_cols + rk[:, None], mask=w_mask, other=0.0).to(DOT)
            acc_g += tl.dot(xt, wg, input_precision=PRECISION)
            acc_u += tl.dot(xt, wu, input_precision=PRECISION)
        dt = o_ptr.dtype.element_ty
        g = _cast(acc_g, dt).to(tl.float32)  # the gate_up output, in the activation dtype
        u = _cast(acc_u, dt).to(tl.float32)
        silu = _cast(g / (1.0 + tl.exp(-g)), dt).to(tl.float32)
        tl.store(o_ptr + a.to(tl.int64)[:, None] * stride_om + rn[None, :],
                 _cast(silu * u, dt), mask=a_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, rw_ptr, o_ptr, sorted_ptr, bexp_ptr, num_assign, num_experts,
                 N, K, stride_hm, stride_we, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Program (block, n tile): o[a] = round(round(h[a] @ Wd.T) * rw[a]) over the block's
    assignments a, output columns n of its expert's down weight."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < num_experts:
        a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        a_ok = a < num_assign
        a64 = a.to(tl.int64)
        rows = h_ptr + a64[:, None] * stride_hm
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        cols = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            ht = tl.load(rows + rk[None, :], mask=a_ok[:, None] & k_ok[None, :],
                         other=0.0).to(DOT)
            wt = tl.load(cols + rk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                         other=0.0).to(DOT)
            acc += tl.dot(ht, wt, input_precision=PRECISION)
        dt = o_ptr.dtype.element_ty
        rw = tl.load(rw_ptr + a64, mask=a_ok, other=0.0)
        y = _cast(acc, dt).to(tl.float32) * rw[:, None]
        tl.store(o_ptr + a64[:, None] * stride_om + rn[None, :], _cast(y, dt),
                 mask=a_ok[:, None] & n_ok[None, :])


class MoETiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


def moe_tiles(assignments: int, device: torch.device, elt: int = 2) -> MoETiles:
    """Tile sizes for `assignments` = T*k rows of `elt`-byte activations (few rows: a small
    BLOCK_M, so an expert's padding stays small); pipeline stages cut to the device's shared
    memory (the gate_up kernel holds an x tile and two weight tiles per stage)."""
    if device.type != "cuda":  # the interpreter: few, large programs
        return MoETiles(16, 64, 64, 4, 1)
    if assignments <= 64:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif assignments <= 1024:
        bm, bn, bk, warps, stages = 32, 64, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 64, 128, 64, 8, 3
    per_stage = (bm * bk + 2 * bk * bn) * elt
    while stages > 1 and stages * per_stage > _shared_memory_limit(device):
        stages -= 1
    return MoETiles(bm, bn, bk, warps, stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, *, tiles: MoETiles | None = None) -> torch.Tensor:
    """x [T, H] (float32 / bfloat16 / float16, contiguous rows), w13 [E, 2I, H], w2 [E, H, I]
    (x's dtype, contiguous), routing weights [T, k] (float32) and expert ids [T, k] (ids
    >= E are skipped) -> [T, H] in x's dtype."""
    t, h = x.shape
    e, two_i, h2 = w13.shape
    inter = two_i // 2
    if h2 != h or tuple(w2.shape) != (e, h, inter) or two_i % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != t:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must "
                         f"be [{t}, k]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"expert weights {w13.dtype} / {w2.dtype} differ from x {x.dtype}")
    k = ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    p = tiles or moe_tiles(t * k, x.device, x.element_size())
    al = align_block_size(ids.clamp(max=e), e, p.block_m)
    dot, precision = _dot_config(x.dtype, x.device)
    blocks = al.block_expert.numel()
    inter_out = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, p.block_n))](
        x, w13, inter_out, al.sorted_ids, al.block_expert, t * k, k, e, inter, h,
        x.stride(0), w13.stride(0), w13.stride(1), inter_out.stride(0),
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, DOT=dot,
        PRECISION=precision, num_warps=p.warps, num_stages=p.stages)
    out = torch.zeros(t * k, h, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(blocks, triton.cdiv(h, p.block_n))](
        inter_out, w2, rw, out, al.sorted_ids, al.block_expert, t * k, e, h, inter,
        inter_out.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, DOT=dot,
        PRECISION=precision, num_warps=p.warps, num_stages=p.stages)
    return out.view(t, k, h).sum(dim=1)
