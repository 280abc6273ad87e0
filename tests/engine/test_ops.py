"""Native fused element-wise kernels against their torch reference (HF math); the bfloat16
kernels also against float64 computed from the same bfloat16 inputs, at each CPU level."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.ops import Ops
from tandem.engine.native import load_native
from tests.engine.isa_levels import LEVELS_HERE, forced_level


@pytest.fixture(scope="module")
def ops():
    assert load_native() is not None, "the native kernels must build on CPU machines with cc"
    return Ops(native=True), Ops(native=False)


@pytest.mark.parametrize("rows", [1, 3, 700])  # 700 rows crosses the parallel threshold
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm(ops, rows, with_x):
    native, ref = ops
    torch.manual_seed(rows)
    x = torch.randn(rows, 96) if with_x else None
    res = torch.randn(rows, 96) * 3
    w = torch.randn(96)
    want, want_res = ref.add_rms_norm(x, res.clone(), w, 1e-5)
    res_native = res.clone()
    got, got_res = native.add_rms_norm(x, res_native, w, 1e-5)
    assert got_res.data_ptr() == res_native.data_ptr()  # updated in place
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_silu_mul(ops, rows):
    native, ref = ops
    torch.manual_seed(0)
    gu = torch.randn(rows, 2 * 80) * 4
    torch.testing.assert_close(native.silu_mul(gu), ref.silu_mul(gu), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 9, 400])
def test_rope_in_place_on_a_strided_view(ops, rows):
    native, ref = ops
    torch.manual_seed(1)
    heads, d, max_pos = 5, 32, 4096
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    pos = torch.randint(0, max_pos, (rows,))
    # like the model: q and k heads are the first columns of a wider qkv row
    qkv = torch.randn(rows, (heads + 2) * d)
    view_native = qkv.clone()[:, : heads * d].view(rows, heads, d)
    view_ref = qkv.clone()[:, : heads * d].view(rows, heads, d)
    native.rope_(view_native, pos, cos, sin)
    ref.rope_(view_ref, pos, cos, sin)
    torch.testing.assert_close(view_native, view_ref, rtol=1e-6, atol=1e-6)


# -- bfloat16 ---------------------------------------------------------------------------------
# The kernels compute in float32 and round each stored value once to nearest even, so each
# output is within one bfloat16 rounding (2**-8 relative) of the float32 result, itself
# within a few float32 unit roundoffs (U) of float64. torch's bfloat16 chain rounds after
# most ops (HF's RMSNorm rounds the normalised row, then the product with the weight): within
# a few bfloat16 roundings of the same value.

B = 2.0 ** -8  # bfloat16 unit roundoff
U = 2.0 ** -24  # float32 unit roundoff


def _bf16_ops(level: str) -> Ops:
    """What a bfloat16 model's `Ops()` is at `level`: the native kernels of that level."""
    with forced_level(level):
        ops = Ops(native=True, dtype=torch.bfloat16)
    assert ops.lib is not None and ops.lib is load_native(level), level
    return ops


def _bf16(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float,
            what: object) -> None:
    assert got.shape == want.shape and got.dtype == torch.bfloat16, what
    err = (got.double() - want).abs()
    bad = ~(err <= bound)  # NaN fails too
    assert not bad.any(), (what, f"{int(bad.sum())} of {got.numel()} off; first at "
                           f"{bad.nonzero()[0].tolist()}: got {got.double()[bad][0].item()!r}, "
                           f"want {want[bad][0].item()!r}, max err {err.max().item():.3g}")


# rows x width: 1 and many rows, widths off every vector width (and past silu's 256-float
# chunks); the last over the kernels' 32,768-element OpenMP threshold
BF16_SHAPES = ((1, 1), (1, 17), (3, 100), (1, 576), (9, 300), (64, 576))


def test_bfloat16_models_take_the_bfloat16_kernels():
    ops = Ops(native=True, dtype=torch.bfloat16)
    lib = load_native()
    assert ops.lib is lib
    assert ops._kernel("rope", torch.bfloat16) is lib.tandem_rope_bf16
    assert ops._kernel("silu_mul", torch.float32) is lib.tandem_silu_mul_f32
    assert ops._kernel("silu_mul", torch.float16) is None  # torch
    assert Ops(native=True, dtype=torch.float16).lib is None
    assert Ops(native=False, dtype=torch.bfloat16).lib is None


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_add_rms_norm_bfloat16(level):
    """residual = bf16(residual + x) exactly (torch's bfloat16 add); out within one
    rounding of the float64 RMSNorm of that residual, plus the float32 kernel's (H + 8) U
    (the sum of squares)."""
    ops, ref = _bf16_ops(level), Ops(native=False)
    gen = torch.Generator().manual_seed(21)
    eps = 1e-5
    for t, h in BF16_SHAPES:
        for with_x in (True, False):
            res = _bf16(gen, t, h, scale=3.0)
            x = _bf16(gen, t, h) if with_x else None
            w = _bf16(gen, h)
            want_res = (res.float() + x.float()).bfloat16() if with_x else res.clone()
            res_in = res.clone()
            out, r = ops.add_rms_norm(x, res_in, w, eps)
            what = (level, t, h, with_x)
            assert r.data_ptr() == res_in.data_ptr() and torch.equal(res_in, want_res), what
            r64 = want_res.double()
            want = w.double() * r64 / torch.sqrt(r64.pow(2).mean(-1, keepdim=True) + eps)
            e = (h + 8) * U
            _within(out, want, (B * (1 + e) + e) * want.abs(), what)
            torch_out, torch_res = ref.add_rms_norm(x, res.clone(), w, eps)
            assert torch.equal(torch_res, want_res), what
            torch.testing.assert_close(out, torch_out, rtol=4 * B, atol=1e-6, msg=str(what))


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_silu_mul_bfloat16(level):
    """bf16(silu(g) * u) within one rounding of float64 plus the float32 kernel's 8 U;
    gates out to +-100 (exp(-g) overflows to inf: -0, as the float32 formula gives)."""
    ops, ref = _bf16_ops(level), Ops(native=False)
    gen = torch.Generator().manual_seed(22)
    extremes = torch.tensor([-100.0, -90.0, -20.0, 0.0, 20.0, 90.0, 100.0]).bfloat16()
    for t, i in BF16_SHAPES:
        gu = _bf16(gen, t, 2 * i, scale=4.0)
        gu[0, : min(i, 7)] = extremes[: min(i, 7)]
        out = ops.silu_mul(gu)
        g, u = gu[:, :i].double(), gu[:, i:].double()
        want = g * torch.sigmoid(g) * u
        _within(out, want, (B * (1 + 8 * U) + 8 * U) * want.abs() + 1e-30, (level, t, i))
        torch.testing.assert_close(out, ref.silu_mul(gu), rtol=4 * B, atol=1e-6,
                                   msg=str((level, t, i)))
    gu[-1, -1] = float("nan")  # an up value: silu(g) * NaN, narrowed NaN
    assert ops.silu_mul(gu)[-1, -1].isnan()


def _rope_tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 tables, as `RotaryEmbedding` keeps them for a bfloat16 model."""
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().float().contiguous(), emb.sin().float().contiguous()


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_rope_bfloat16_on_strided_rows(level):
    """In place on the first `heads` heads of rows `total * d + 3` elements apart (q in a
    fused qkv row): a*c -+ b*s in float32 (3 U (|a c| + |b s|) of float64 with the same
    tables), rounded once; every element outside those heads keeps its bits."""
    ops, ref = _bf16_ops(level), Ops(native=False)
    gen = torch.Generator().manual_seed(23)
    max_pos = 300
    for t, heads, total, d in ((1, 1, 1, 2), (3, 2, 5, 6), (5, 3, 3, 34), (17, 4, 7, 70),
                               (1, 9, 15, 64), (64, 8, 12, 128)):  # last: OpenMP path
        cos, sin = _rope_tables(max_pos, d)
        buf = _bf16(gen, t, total * d + 3)
        before = buf.clone()
        x = buf.as_strided((t, heads, d), (total * d + 3, d, 1))
        positions = torch.randint(0, max_pos, (t,), generator=gen)
        assert ops.rope_(x, positions, cos, sin).data_ptr() == x.data_ptr()
        what = (level, t, heads, total, d)
        assert torch.equal(buf[:, heads * d:], before[:, heads * d:]), what
        v = before[:, : heads * d].view(t, heads, d).double()
        c = cos[positions].double()[:, None, :]
        s = sin[positions].double()[:, None, :]
        half = d // 2
        a, b = v[..., :half], v[..., half:]
        want = torch.cat((a * c[..., :half] - b * s[..., :half],
                          b * c[..., half:] + a * s[..., half:]), dim=-1)
        mag = torch.cat(((a * c[..., :half]).abs() + (b * s[..., :half]).abs(),
                         (b * c[..., half:]).abs() + (a * s[..., half:]).abs()), dim=-1)
        _within(x, want, B * want.abs() + 4 * U * mag, what)
        # torch: bfloat16 tables and a rounding after each product and the sum
        y = before.clone()
        ref.rope_(y.as_strided((t, heads, d), (total * d + 3, d, 1)), positions, cos, sin)
        _within(x, y[:, : heads * d].view(t, heads, d).double(), 8 * B * mag, what)
    x[-1, -1, 0] = float("nan")  # rotates into its pair: both NaN
    ops.rope_(x, positions, cos, sin)
    assert x[-1, -1, 0].isnan() and x[-1, -1, d // 2].isnan()


def _packed(lin: torch.nn.Linear, lib):
    """`lin` converted to the "packed" linear method (the engine's float CPU layout)."""
    from tandem.engine.quant.apply import convert_linear
    from tandem.engine.quant.float_methods import PackedMethod

    return convert_linear(lin, PackedMethod(device=torch.device("cpu"), native=lib))


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 100])  # register tiles are 6 rows
@pytest.mark.parametrize(("out_f", "in_f"), [(96, 64), (13, 37), (260, 200)])  # + tails
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("native", [True, False])  # the packed-panel kernel, and oneDNN
def test_packed_linear_matches_torch(rows, out_f, in_f, bias, native, monkeypatch):
    monkeypatch.setenv("TANDEM_LINEAR_KERNEL", "native")  # whatever this CPU would pick
    torch.manual_seed(rows * 1000 + out_f)
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    x = torch.randn(rows, in_f)
    want = torch.nn.functional.linear(x, lin.weight, lin.bias).detach()
    lib = load_native() if native else None
    fast = _packed(lin, lib)
    assert (fast.method.kernel is not None) == bool(lib and lib.tandem_linear_simd())
    torch.testing.assert_close(fast(x), want, rtol=1e-5, atol=1e-5)
    # the packed layout still reads back as the weight it was made from
    assert torch.equal(fast.method.dequantize(fast), lin.weight.detach())


def test_the_linear_kernel_is_chosen_from_the_cpu_unless_overridden(monkeypatch):
    from tandem.engine.model.cpu_linear import native_preferred

    lib = load_native()
    if not (lib and lib.tandem_linear_simd()):
        assert not native_preferred(lib)  # nothing to prefer: oneDNN
        return
    monkeypatch.delenv("TANDEM_LINEAR_KERNEL", raising=False)
    from tandem.engine.cpu_isa import cpu_isa

    # AVX-512 (the engine's level: the CPU's, capped by TANDEM_CPU_ISA): oneDNN is faster
    assert native_preferred(lib) is not cpu_isa().at_least("avx512")
    monkeypatch.setenv("TANDEM_LINEAR_KERNEL", "oneDNN")
    assert not native_preferred(lib)
    monkeypatch.setenv("TANDEM_LINEAR_KERNEL", "native")
    assert native_preferred(lib)
    monkeypatch.setenv("TANDEM_LINEAR_KERNEL", "fast")
    with pytest.raises(ValueError, match="TANDEM_LINEAR_KERNEL"):
        native_preferred(lib)


def test_large_blocks_of_rows_take_several_passes(monkeypatch):
    """More rows than one L2-sized activation block (MC) still give every row."""
    monkeypatch.setenv("TANDEM_LINEAR_KERNEL", "native")
    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 40)  # K=1536: MC = 126 rows, so 300 rows = 3 blocks
    x = torch.randn(300, 1536)
    torch.testing.assert_close(_packed(lin, load_native())(x),
                               torch.nn.functional.linear(x, lin.weight, lin.bias).detach(),
                               rtol=1e-5, atol=1e-4)


def test_malloc_arenas_are_limited_unless_the_environment_decides(monkeypatch):
    """glibc takes the one-arena setting; a `MALLOC_ARENA_MAX` in the environment wins."""
    import ctypes.util
    import platform

    from tandem.engine.cpu_tuning import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    glibc = platform.libc_ver()[0] == "glibc" and ctypes.util.find_library("c") is not None
    assert limit_malloc_arenas() is glibc
