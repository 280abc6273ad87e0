"""Every non-attention native CPU kernel at every CPU level this machine runs (`LEVELS_HERE`:
`load_native(level)` builds each level's library with that level's `-march`), through the
engine's own wrappers where they take a library, against references computed in torch:

* elementwise_cpu.c: add + RMSNorm (with and without x), SiLU-and-mul, RoPE on strided rows;
* linear_cpu.c: the packed float32 linear (a no-op below AVX2, where "packed" refuses it);
* quant_linear_cpu.c: the int8 / int4 weight-only linears, each path (few rows, scratch,
  auto), with and without mins and bias;
* w8a8_cpu.c: the activation quantizer and int32 GEMM exactly, the float linear bit for bit
  against its float32 epilogue over the exact integer sums and within rounding of float64;
* lora_cpu.c: the batched multi-LoRA update (slots -1 untouched, strided rows, ranks and
  sub-target widths off the kernel's blocks);
* kv_copy_cpu.c: block copies exact and digests equal to xxhash's XXH3-64 (odd sizes, over
  one 64 KiB piece, unaligned destinations, streaming stores);
* the SIMD level each library reports (`tandem_linear_simd`, `tandem_quant_linear_simd`,
  `tandem_w8a8_simd`) against the flags of the `-march` it was built for.

Shapes are seeded and off every vector width: 1 row, tails past multiples of 4 / 6 / 8 / 16,
and sizes large enough for the kernels' OpenMP paths. Float32 results are held to bounds
derived from the operations' rounding (n terms accumulated in any order: at most ~n unit
roundoffs of the sum of the terms' magnitudes), which a wrong element, a lost term or a
tail bug exceeds by orders of magnitude.
"""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
import torch
import xxhash
from torch import nn

from tandem.engine import cpu_isa as isa
from tandem.engine.kv_cache import page_copy
from tandem.engine.lora.layers import LoRABatch, LoRAContext, LoRALinear, ModuleSlots
from tandem.engine.model import cpu_linear
from tandem.engine.model.ops import Ops
from tandem.engine.native import load_native, march_flags
from tandem.engine.quant import cpu_kernels
from tandem.engine.quant.base import GroupedWeight, QuantLinear, quantize_grouped
from tandem.engine.quant.float_methods import PackedMethod
from tandem.engine.quant.w8a8 import (
    native_quantize_rows,
    panel_gemm_i32,
    quantize_rows,
    w8a8_panel_linear,
)
from tests.engine.isa_levels import LEVELS_HERE
from tests.engine.test_quant_kernels import _grouped  # random GGUF-style grouped rows

CPU = torch.device("cpu")
U = 2.0 ** -24  # float32 unit roundoff
X86 = platform.machine() in ("x86_64", "AMD64")
# (linear, quant_linear, w8a8) SIMD values of the generic -march builds (native.MARCH):
# x86-64-v2 has no AVX2; haswell and skylake-avx512 have AVX2 + FMA + F16C but no VNNI;
# cooperlake and sapphirerapids have AVX-512 VNNI (w8a8 path 3)
GENERIC_SIMD = {"scalar": (0, 0, 0), "avx2": (1, 1, 1), "avx512": (1, 1, 1),
                "avx512_bf16": (1, 1, 3), "amx": (1, 1, 3)}

per_level = pytest.mark.parametrize("level", LEVELS_HERE)


def _lib(level: str) -> ctypes.CDLL:
    lib = load_native(level)
    assert lib is not None, f"the native kernels must build at {level} on CPU machines with cc"
    return lib


def _simd(level: str) -> bool:
    """The library of `level` has the AVX2 + FMA float32 paths."""
    return bool(_lib(level).tandem_linear_simd())


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float,
            what: object) -> None:
    assert got.shape == want.shape, what
    err = (got.double() - want).abs()
    bad = ~(err <= bound)  # NaN fails too
    assert not bad.any(), (what, f"{int(bad.sum())} of {got.numel()} elements off; first at "
                           f"{bad.nonzero()[0].tolist()}: got {got.double()[bad][0].item()!r}, "
                           f"want {want[bad][0].item()!r}, max err {err.max().item():.3g}")


# -- the reported SIMD level -----------------------------------------------------------------


def _expected_simd(level: str) -> tuple[int, int, int]:
    if march_flags(level) != ("-march=native",):
        return GENERIC_SIMD[level]
    if not X86:
        return (0, 0, 0)
    f = isa.cpu_isa().flags  # -march=native: the CPU's own flags decide
    linear = int({"avx2", "fma"} <= f)
    quant = int({"avx2", "fma", "f16c"} <= f)
    if {"avx512f", "avx512bw", "avx512_vnni"} <= f:
        w8a8 = 3
    elif {"avx2", "avx_vnni"} <= f:
        w8a8 = 2
    else:
        w8a8 = int("avx2" in f)
    return (linear, quant, w8a8)


@per_level
def test_each_library_reports_the_simd_level_it_was_built_for(level):
    lib = _lib(level)
    got = (lib.tandem_linear_simd(), lib.tandem_quant_linear_simd(), lib.tandem_w8a8_simd())
    assert got == _expected_simd(level), (level, march_flags(level))
    if not X86:
        return
    if level == "scalar" and march_flags(level) != ("-march=native",):
        assert got == (0, 0, 0)
    if isa.LEVELS.index(level) >= isa.LEVELS.index("avx2"):
        assert got[0] == got[1] == 1 and got[2] >= 1
    if isa.LEVELS.index(level) >= isa.LEVELS.index("avx512_bf16"):
        assert got[2] == 3  # the level requires AVX-512 VNNI: vpdpbusd on zmm
    elif march_flags(level) != ("-march=native",):
        assert got[2] <= 1  # no VNNI in the generic builds below avx512_bf16


# -- elementwise_cpu.c ------------------------------------------------------------------------


def _ops(level: str) -> Ops:
    """The model's element-wise ops with the library of `level` (what `Ops()` picks when
    the engine runs at that level)."""
    ops = Ops(native=False)
    ops.lib = _lib(level)
    return ops


@per_level
def test_add_rms_norm(level):
    """residual += x exactly (one float32 add, as torch's); out within (H + 8) u of the
    float64 RMSNorm of that residual, relative: the sum of squares has at most H - 1
    roundings of positive terms (any order) plus one per square, i.e. <= H u relative,
    halved by the square root, and ~7 more roundings (mean, eps, sqrt, 1/, two products).
    A lost term of the sum shifts a whole row by ~1/(2H), a wrong element far more."""
    ops = _ops(level)
    gen = torch.Generator().manual_seed(11)
    eps = 1e-5
    for t, h in ((1, 1), (1, 7), (3, 17), (2, 64), (6, 100), (1, 1003), (37, 129),
                 (40, 1031)):  # the last over the kernel's 32,768-element OpenMP threshold
        for with_x in (True, False):
            res = torch.randn(t, h, generator=gen) * 3
            x = torch.randn(t, h, generator=gen) if with_x else None
            w = torch.randn(h, generator=gen)
            want_res = res + x if with_x else res.clone()
            res_in = res.clone()
            out, r = ops.add_rms_norm(x, res_in, w, eps)
            assert r.data_ptr() == res_in.data_ptr() and torch.equal(res_in, want_res)
            r64 = want_res.double()
            ref = w.double() * r64 / torch.sqrt(r64.pow(2).mean(-1, keepdim=True) + eps)
            _within(out, ref, (h + 8) * U * ref.abs(), (level, t, h, with_x))


@per_level
def test_silu_mul(level):
    """silu(gate) * up within 8 u relative of float64: glibc's (vector) expf is within
    1 ulp (2 u), then 1 + e, the division and the product round once each (e's error
    shrinks through 1 + e): <= 5 u; 4.5 u observed. Gates out to +-100: exp(-g) overflows
    to inf below about -88 and silu gives -0 there, as the formula does in float32 (the
    float64 values, < 1e-36, sit under the 1e-30 absolute floor)."""
    ops = _ops(level)
    gen = torch.Generator().manual_seed(12)
    for t, i in ((1, 1), (1, 9), (3, 33), (4, 100), (7, 515), (40, 1000)):
        gu = torch.randn(t, 2 * i, generator=gen) * 4
        extremes = torch.tensor([-100.0, -90.0, -20.0, 0.0, 20.0, 90.0, 100.0])
        gu[0, : min(i, 7)] = extremes[: min(i, 7)]
        out = ops.silu_mul(gu)
        g, u = gu[:, :i].double(), gu[:, i:].double()
        ref = g * torch.sigmoid(g) * u
        _within(out, ref, 8 * U * ref.abs() + 1e-30, (level, t, i))


def _rope_tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().float().contiguous(), emb.sin().float().contiguous()


@per_level
def test_rope_on_strided_rows(level):
    """Rotate-half RoPE in place on the first `heads` heads of rows `stride` floats apart
    (q inside a fused qkv buffer): each output is a*c -+ b*s, two rounded products and a
    rounded sum, so within 3 u (|a c| + |b s|) of float64 with the same float32 tables;
    every float outside those heads keeps its bits."""
    ops = _ops(level)
    gen = torch.Generator().manual_seed(13)
    max_pos = 300
    for t, heads, total, d in ((1, 1, 1, 2), (3, 2, 5, 6), (5, 3, 3, 10), (17, 4, 7, 70),
                               (2, 1, 2, 34), (64, 8, 12, 128)):  # last: OpenMP path
        cos, sin = _rope_tables(max_pos, d)
        buf = torch.randn(t, total * d + 3, generator=gen)
        before = buf.clone()
        x = buf.as_strided((t, heads, d), (total * d + 3, d, 1))
        positions = torch.randint(0, max_pos, (t,), generator=gen)
        got = ops.rope_(x, positions, cos, sin)
        assert got.data_ptr() == x.data_ptr()
        assert torch.equal(buf[:, heads * d:], before[:, heads * d:]), (level, t, heads, d)
        v = before[:, : heads * d].view(t, heads, d).double()
        c = cos[positions].double()[:, None, :]
        s = sin[positions].double()[:, None, :]
        half = d // 2
        a, b = v[..., :half], v[..., half:]
        ref = torch.cat((a * c[..., :half] - b * s[..., :half],
                         b * c[..., half:] + a * s[..., half:]), dim=-1)
        mag = torch.cat(((a * c[..., :half]).abs() + (b * s[..., :half]).abs(),
                         (b * c[..., half:]).abs() + (a * s[..., half:]).abs()), dim=-1)
        _within(x, ref, 3 * U * mag, (level, t, heads, d))


# -- linear_cpu.c -----------------------------------------------------------------------------


def _gemm_bound(x: torch.Tensor, w_abs: torch.Tensor, b: torch.Tensor | None,
                terms: int) -> torch.Tensor:
    """`terms` u of the magnitudes |x| @ |W|^T + |b| (float64): the error of a float32 sum
    of that many rounded terms in any order."""
    mag = x.double().abs() @ w_abs.T
    if b is not None:
        mag = mag + b.double().abs()
    return terms * U * mag + 1e-30


def _packed_layer(lib: ctypes.CDLL, w: torch.Tensor, b: torch.Tensor | None) -> QuantLinear:
    n, k = w.shape
    method = PackedMethod(device=CPU, native=lib, native_panels=True)
    with torch.device("meta"):
        layer = QuantLinear(method, k, n, b is not None, torch.float32)
    layer.to_empty(device=CPU)
    if b is not None:
        layer.bias.data.copy_(b)
    method.load(layer, 0, w)
    method.finish(layer)
    return layer


@per_level
def test_linear_packed(level):
    """The packed float32 linear (through the "packed" method with native panels) within
    (K + 2) u of the magnitudes of float64 x @ W^T + b: one rounded FMA per k, any tiling,
    plus the bias add. Shapes cover N off the 16-column panels, M off the 6-row tiles and,
    at K = 2000, more rows than one L2 block of activations (96). Below AVX2 the kernel is
    not built: "packed" refuses native panels and a direct call writes nothing."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(14)
    if not _simd(level):
        assert not cpu_linear.native_simd(lib)
        with pytest.raises(ValueError, match="AVX2"):
            PackedMethod(device=CPU, native=lib, native_panels=True)
        w, x = torch.randn(17, 9, generator=gen), torch.randn(3, 9, generator=gen)
        wp = cpu_linear.pack_panels(w)
        y = torch.full((3, 17), float("nan"))
        lib.tandem_linear_packed_f32(x.data_ptr(), wp.data_ptr(), None, y.data_ptr(), 3, 17,
                                     9, torch.get_num_threads())
        assert y.isnan().all()
        return
    for m, n, k, bias in ((1, 1, 1, True), (1, 17, 9, False), (5, 16, 64, True),
                          (6, 33, 130, True), (7, 40, 3, False), (13, 75, 257, True),
                          (2, 100, 31, True), (100, 21, 2000, False), (63, 48, 96, True)):
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        layer = _packed_layer(lib, w, b)
        assert layer.packed.shape == ((n + 15) // 16, k, 16)
        x = torch.randn(m, k, generator=gen)
        y = layer(x)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        _within(y, ref, _gemm_bound(x, w.double().abs(), b, k + 2), (level, m, n, k))


# -- linear_bf16_cpu.c -----------------------------------------------------------------------


@per_level
def test_linear_bf16(level):
    """The bfloat16 pair-panel linear at each level's code path (VDPBF16PS with AVX512-BF16,
    widened pairs and FMAs with plain AVX-512, the portable loop below): each output is the
    float32 sum rounded once to bfloat16, so within bfloat16's unit roundoff (2^-8
    relative) plus (K + 2) u of |x| |W| + |b| of float64 x @ W^T + b. Shapes cover N off the
    32-column panels, odd K (the last input without a partner), M off the 8-row tiles,
    strided rows of x (lda > K). Untouched where the output is not written."""
    lib = _lib(level)
    simd = lib.tandem_linear_bf16_simd()
    assert simd == (2 if isa.LEVELS.index(level) >= isa.LEVELS.index("avx512_bf16") else
                    1 if level == "avx512" else 0) or march_flags(level) == ("-march=native",)
    gen = torch.Generator().manual_seed(15)
    bf = torch.bfloat16
    for m, n, k, bias, extra in ((1, 1, 1, True, 0), (1, 33, 7, False, 3), (8, 32, 64, True, 0),
                                 (9, 65, 577, True, 5), (17, 100, 130, False, 0),
                                 (3, 40, 2, True, 1), (70, 31, 1536, False, 0)):
        w = torch.randn(n, k, generator=gen).to(bf)
        b = torch.randn(n, generator=gen).to(bf) if bias else None
        wp = cpu_linear.pack_bf16_panels(w)
        assert wp.shape == ((n + 31) // 32, (k + 1) // 2, 32, 2)
        assert torch.equal(cpu_linear.bf16_panel_rows(wp, torch.arange(n), k), w)
        xs = torch.randn(m, k + extra, generator=gen).to(bf)  # rows k + extra apart
        y = torch.full((m, n), float("nan"), dtype=bf)
        lib.tandem_linear_bf16(xs.data_ptr(), wp.data_ptr(),
                               None if b is None else b.data_ptr(), y.data_ptr(), m, n, k,
                               k + extra, torch.get_num_threads())
        x = xs[:, :k]
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        bound = ref.abs() * 2.0 ** -8 + _gemm_bound(
            x, w.double().abs(), b, k + 2)
        _within(y, ref, bound, (level, simd, m, n, k))


# -- quant_linear_cpu.c -----------------------------------------------------------------------


def _quant_panels(gw: GroupedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n, k = gw.shape
    p = cpu_kernels.panel_count(n)
    codes = torch.empty(p, k if gw.bits == 8 else k // 2, 16,
                        dtype=torch.int8 if gw.bits == 8 else torch.uint8)
    scales = torch.empty(p, k // gw.group_size, 16, dtype=torch.float16)
    mins = torch.empty_like(scales) if gw.mins is not None else None
    cpu_kernels.write_panel_rows(codes, scales, mins, 0, gw)
    cpu_kernels.clear_padding(codes, scales, mins, n)
    return codes, scales, mins


# (bits, N, K, g, mins): per channel; groups whose k steps do not divide into the kernel's
# accumulator chains (g = 130; g = 6: three int4 lines); N off the 16-column panels
QUANT_CASES = ((8, 37, 130, 130, False), (8, 75, 96, 32, True), (8, 1, 64, 16, False),
               (4, 37, 96, 32, True), (4, 75, 384, 128, False), (4, 20, 96, 6, True),
               (4, 16, 64, 64, False))
QUANT_ROWS = (1, 2, 3, 5, 9, 17, 40)  # few-rows tiles of 4, auto's switches at 8 / 16


@per_level
@pytest.mark.parametrize("bits,n,k,g,mins", QUANT_CASES)
def test_quant_linear(level, bits, n, k, g, mins):
    """Each path ("few", "scratch", "auto"; the scalar build ignores the mode) within
    (2K + 8) u of the magnitudes of float64 x @ W^T + b with W the exact real weight
    q * s + m: at most K + G rounded multiply-adds of the partial sums and folds (or the
    dequantized weight's two roundings and K FMAs), doubled for the scalar build's
    separate multiply and add. Where the AVX2 path is built, "scratch" equals the float32
    GEMM on the dequantized weight bit for bit (same tile code)."""
    lib = _lib(level)
    assert lib.tandem_quant_linear_simd() == (X86 and _simd(level))
    gen = torch.Generator().manual_seed(bits * 1000 + n * 10 + g)
    gw = _grouped(gen, n, k, bits, g, mins)
    codes, scales, mn = _quant_panels(gw)
    q = gw.codes.double()
    s = gw.scales.double().repeat_interleave(g, dim=1)
    m = gw.mins.double().repeat_interleave(g, dim=1) if mins else torch.zeros_like(q)
    w_real, w_abs = q * s + m, (q * s).abs() + m.abs()
    fn = cpu_kernels.int8_panel_linear if bits == 8 else cpu_kernels.int4_panel_linear
    wp = cpu_linear.pack_panels(gw.dequantize()) if _simd(level) else None
    for rows in QUANT_ROWS:
        x = torch.randn(rows, k, generator=gen)
        b = torch.randn(n, generator=gen) if rows % 2 else None
        ref = x.double() @ w_real.T + (0 if b is None else b.double())
        bound = _gemm_bound(x, w_abs, b, 2 * k + 8)
        for mode in ("few", "scratch", "auto"):
            y = fn(x, codes, scales, mn, g, b, n, lib, mode=mode)
            _within(y, ref, bound, (level, bits, n, k, g, mins, rows, mode))
            if mode == "scratch" and wp is not None:
                want = torch.empty(rows, n)
                lib.tandem_linear_packed_f32(x.data_ptr(), wp.data_ptr(),
                                             None if b is None else b.data_ptr(),
                                             want.data_ptr(), rows, n, k,
                                             torch.get_num_threads())
                assert torch.equal(y, want), (level, bits, n, k, g, rows)


@per_level
@pytest.mark.parametrize("n,k,g,mins", [(37, 130, 130, False), (75, 96, 32, True),
                                        (1, 64, 16, False), (33, 65, 65, True),
                                        (64, 576, 576, False)])
def test_quant_linear_i8_bf16(level, n, k, g, mins):
    """Weight-only int8 panels with bfloat16 activations (`tandem_quant_linear_i8_bf16`) at
    each level's path: the weights are GroupedWeight.dequantize's float32 values rounded to
    bfloat16 (the weights of a bfloat16 model of the dequantized checkpoint), multiplied in
    float32 and rounded once: within bfloat16's unit roundoff of |y| plus (K + 2) u of the
    magnitudes, against float64 over those weights. N off the 32-column pairs (an odd
    count of 16-column code panels), odd K, groups and mins, every row tail of the tile."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(16)
    gw = _grouped(gen, n, k, 8, g, mins)
    codes, scales, mns = _quant_panels(gw)
    w = gw.dequantize(torch.float32).to(torch.bfloat16).double()
    for m in (1, 3, 8, 9, 17):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16) if mins else None
        y = cpu_kernels.int8_panel_linear_bf16(x, codes, scales, mns, g, b, n, lib)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        ref = x.double() @ w.T + (0 if b is None else b.double())
        bound = ref.abs() * 2.0 ** -8 + _gemm_bound(x, w.abs(), b, k + 2)
        _within(y, ref, bound, (level, m, n, k, g, mins))


# -- w8a8_cpu.c -------------------------------------------------------------------------------

W8A8_SHAPES = ((5, 4), (17, 7), (33, 130), (16, 3), (40, 576), (47, 1001))  # (N, K)
# every remainder of the 4 / 6 / 8-row tiles of the three paths
W8A8_ROWS = (1, 2, 3, 5, 6, 7, 12, 17, 64)


def _w8a8_panels(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor,
                                                                     torch.Tensor]:
    """[N, K] int8 and [N, 1] float16 -> panels [P, K, 16] and [P, 1, 16]."""
    n, k = codes.shape
    p = (n + 15) // 16
    pc = torch.zeros(p * 16, k, dtype=torch.int8)
    pc[:n] = codes
    ps = torch.zeros(p * 16, 1, dtype=torch.float16)
    ps[:n] = scales
    return (pc.view(p, 16, k).transpose(1, 2).contiguous(),
            ps.view(p, 16, 1).transpose(1, 2).contiguous())


@per_level
def test_w8a8_quantizer_is_exact(level):
    """Per-row codes and scales equal torch's reference (float32 amax / 127, x / s rounded
    half to even, clamped) bit for bit, at K off the 8-wide vector loop; every code is
    within half a step of x (float64)."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(15)
    for m, k in ((1, 1), (3, 7), (17, 8), (5, 9), (64, 576), (5, 1001), (40, 1000)):
        x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m).view(m, 1)
        x[0, : k // 2] = 0.5  # repeated values: ties
        if m > 2:
            x[2] = 0.0  # amax 0: scale 0, codes 0
        want_codes, want_scales = quantize_rows(x)
        codes, scales = native_quantize_rows(x, lib)
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales), (m, k)
        err = (codes.double() * scales.double() - x.double()).abs()
        assert (err <= scales.double() * 0.5 * (1 + 1e-6)).all(), (level, m, k)


@per_level
def test_w8a8_gemm_and_linear(level):
    """The int32 GEMM equals int64 sums of the codes exactly; the float linear equals its
    float32 epilogue ((sum * xs) * ws + b, each rounded, as torch computes it) over those
    exact sums bit for bit, and so lies within 4 u of the float64 product of the
    dequantized operands (three roundings and the sum's conversion)."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(16)
    for n, k in W8A8_SHAPES:
        g = quantize_grouped(torch.randn(n, k, generator=gen), 8, k, symmetric=True)
        codes, scales = _w8a8_panels(g.codes, g.scales)
        extreme = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
        extreme[:, ::3] = 127 * extreme[:, ::3].sign()  # saturating pair sums (AVX2)
        ext_codes, _ = _w8a8_panels(extreme, g.scales)
        bias = torch.randn(n, generator=gen)
        for m in W8A8_ROWS:
            a = torch.randint(-127, 128, (m, k), generator=gen).to(torch.int8)
            a[:, ::2] = -127
            for wc, w in ((codes, g.codes), (ext_codes, extreme)):
                got = panel_gemm_i32(a, wc, n, lib)
                assert torch.equal(got.long(), a.long() @ w.long().T), (level, m, n, k)
            x = torch.randn(m, k, generator=gen) * 4
            xq, xs = quantize_rows(x)
            acc = xq.long() @ g.codes.long().T
            for b in (bias, None):
                y = w8a8_panel_linear(x, codes, scales, b, n, lib)
                ws = g.scales.float().T
                want = acc.float() * xs * ws + (0.0 if b is None else b)
                assert torch.equal(y, want), (level, m, n, k, b is None)
                exact = acc.double() * xs.double() * ws.double()
                ref = exact + (0 if b is None else b.double())
                mag = exact.abs() + (0 if b is None else b.double().abs())
                _within(y, ref, 4 * U * mag, (level, m, n, k))


# -- lora_cpu.c -------------------------------------------------------------------------------


class _Fixed(nn.Module):
    """A base linear whose output is a given tensor (a view into a wider buffer)."""

    def __init__(self, y: torch.Tensor) -> None:
        super().__init__()
        self.y = y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.y


def _lora_ref(x: torch.Tensor, y0: torch.Tensor, slots: torch.Tensor, sl: ModuleSlots
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 y0 + each adapter token's update, and the magnitudes |y0| + (|A||x|)|Bt|."""
    ref, mag = y0.double().clone(), y0.double().abs()
    r = sl.rank
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        xa = sl.a[s].double() @ x[t].double()
        xa_abs = sl.a[s].double().abs() @ x[t].double().abs()
        for j, (off, n) in enumerate(sl.outs):
            bt = sl.b[j][s].double()
            ref[t, off:off + n] += xa[j * r:(j + 1) * r] @ bt
            mag[t, off:off + n] += xa_abs[j * r:(j + 1) * r] @ bt.abs()
    return ref, mag


@per_level
def test_lora(level):
    """The multi-LoRA update through `LoRALinear`'s native plan (y a column slice of a
    wider buffer) and by a direct call on rows of x `x_stride` apart: within
    (in + 2R + 2) u of the magnitudes (the shrink's dot of `in` rounded products, then R
    rounded multiply-adds onto y); tokens of slot -1 and every column outside the
    sub-targets keep their bits. Ranks give A row counts off the 4-row work items, output
    widths off the 256-column blocks, adapters of smaller rank zero-padded."""
    lib = _lib(level)
    gen = torch.Generator().manual_seed(17)
    # (T, in, R, sub-targets (offset, width), each token's slot); the last over the
    # kernel's OpenMP threshold
    cases = ((1, 8, 3, [(0, 5)], [0]),
             (5, 33, 3, [(0, 40), (45, 300), (350, 7)], [0, -1, 1, 2, 0]),
             (9, 130, 4, [(2, 513), (515, 16)], [-1, 1, 1, 0, 2, 2, 0, -1, 1]),
             (3, 7, 2, [(0, 3), (3, 3), (6, 3)], [2, 2, 2]),
             (40, 576, 8, [(0, 576), (576, 192), (768, 192)], [i % 4 - 1 for i in range(40)]))
    for t, n_in, rank, outs, token_slots in cases:
        num_slots, width = 3, max(o + n for o, n in outs) + 5
        sl = ModuleSlots.allocate(num_slots, rank, n_in, outs, CPU, torch.float32)
        for s in range(num_slots):
            for j, (_, n) in enumerate(outs):
                r = rank if s != 1 else max(1, rank - 1)  # slot 1: a smaller rank, padded
                a = torch.randn(r, n_in, generator=gen) / n_in ** 0.5
                sl.set(s, j, a, torch.randn(n, r, generator=gen))
        slots = torch.tensor(token_slots, dtype=torch.int64)
        x = torch.randn(t, n_in, generator=gen)
        buf = torch.randn(t, width + 4, generator=gen)
        before = buf.clone()
        y0 = buf[:, 2:2 + width]
        ref, mag = _lora_ref(x, y0, slots, sl)
        ctx = LoRAContext()
        layer = LoRALinear(_Fixed(y0), sl, ctx)
        batch = LoRABatch.build(slots.numpy(), num_slots, CPU, native=lib, rank=rank)
        assert batch.mode == "native"
        with ctx.use(batch):
            y = layer(x)
        assert y.data_ptr() == y0.data_ptr()
        what = (level, t, n_in, rank, outs)
        _within(y, ref, (n_in + 2 * rank + 2) * U * mag, what)
        touched = torch.zeros_like(buf, dtype=torch.bool)
        for off, n in outs:
            touched[slots >= 0, 2 + off:2 + off + n] = True
        assert torch.equal(buf[~touched], before[~touched]), what
        # rows of x 3 floats past `in` apart (the wrapper passes contiguous rows)
        xbuf = torch.randn(t, n_in + 3, generator=gen)
        xbuf[:, :n_in] = x
        y2 = before[:, 2:2 + width].clone()
        b, n, off = sl.c_args()
        scratch = torch.empty(t, 3 * rank)
        lib.tandem_lora_f32(xbuf.data_ptr(), y2.data_ptr(), scratch.data_ptr(),
                            slots.data_ptr(), sl.a.data_ptr(), b, n, off, t, n_in,
                            n_in + 3, y2.stride(0), rank, len(outs), torch.get_num_threads())
        assert torch.equal(y2, y), what  # same sums in the same order


# -- kv_copy_cpu.c ----------------------------------------------------------------------------


@per_level
def test_kv_copy_hash(level, monkeypatch):
    """`copy_blocks` with the library of `level`: block i of src_idx lands on block i of
    dst_idx (negative: hashed only), exactly, other blocks keep their bytes, and the digest
    is xxhash's XXH3-64 of the source blocks in order; block sizes tiny, odd, around and
    over the 64 KiB piece; destinations at every alignment class; ordinary and streaming
    (non-temporal, from AVX2 up) stores; no destination at all."""
    lib = _lib(level)
    monkeypatch.setattr(page_copy, "_kernel", lambda: lib.tandem_kv_copy_hash)
    assert page_copy.available()
    rng = np.random.default_rng(18)
    digest = page_copy.Digest()
    for trial, block in enumerate((1, 3, 64, 1000, 4099, 65535, 65536, 65537, 150001)):
        nsrc, ndst = 5, 6
        src = rng.integers(0, 256, nsrc * block, dtype=np.uint8)
        shift = (1, 0, 17, 63, 32, 5, 0, 48, 7)[trial]  # the destination's misalignment
        raw = rng.integers(0, 256, ndst * block + 128, dtype=np.uint8)
        base = (-raw.ctypes.data) % 64 + shift
        dst = raw[base:base + ndst * block]
        assert dst.ctypes.data % 64 == shift
        s_ids = rng.integers(0, nsrc, 5).tolist()  # repeats allowed
        d_ids = rng.permutation(ndst)[:5].tolist()
        d_ids[trial % 5] = -1
        want = dst.copy().reshape(ndst, block)
        for s, d in zip(s_ids, d_ids, strict=True):
            if d >= 0:
                want[d] = src.reshape(nsrc, block)[s]
        ref = xxhash.xxh3_64(b"".join(src.reshape(nsrc, block)[s].tobytes() for s in s_ids))
        for stream in (False, True):
            dst[:] = rng.integers(0, 256, dst.size, dtype=np.uint8)
            keep = dst.copy().reshape(ndst, block)
            untouched = [d for d in range(ndst) if d not in d_ids]
            digest.reset()
            page_copy.copy_blocks(src.ctypes.data, page_copy.block_indices(s_ids),
                                  dst.ctypes.data, page_copy.block_indices(d_ids), block,
                                  digest, stream=stream)
            got = dst.reshape(ndst, block)
            for d in d_ids:
                if d >= 0:
                    assert np.array_equal(got[d], want[d]), (level, block, stream, d)
            assert np.array_equal(got[untouched], keep[untouched]), (level, block, stream)
            assert digest.intdigest() == ref.intdigest(), (level, block, stream)
        digest.reset()
        page_copy.copy_blocks(src.ctypes.data, page_copy.block_indices(s_ids), None, None,
                              block, digest)
        assert digest.intdigest() == ref.intdigest(), (level, block)
