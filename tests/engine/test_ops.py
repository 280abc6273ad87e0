"""Native fused element-wise kernels against their torch reference (HF math)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.ops import Ops
from tandem.engine.native import load_native


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
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert native_preferred(lib) is not avx512  # AVX-512: oneDNN's kernels are faster
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
