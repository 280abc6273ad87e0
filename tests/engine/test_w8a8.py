"""W8A8 (`quant/w8a8.py`, `csrc/w8a8_cpu.c`): the per-token activation quantizer and the
int8 GEMM against exact torch references, every kernel path this machine can run (the
compiled SIMD path plus standalone scalar builds, one with the VNNI unsigned-activation
bookkeeping), the linear method's loads, apply, embed and fallbacks."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.native import CFLAGS, CSRC, load_native
from tandem.engine.quant.base import (
    GroupedWeight,
    QuantLinear,
    get_linear_method,
    quantize_grouped,
)
from tandem.engine.quant.w8a8 import (
    MIN_ROWS_ENV,
    W8A8Method,
    native_quantize_rows,
    panel_gemm_i32,
    quantize_rows,
    w8a8_panel_linear,
)

CPU = torch.device("cpu")
ROWS = (1, 2, 5, 17, 64, 300)
# (N, K): N never a multiple of 16 but one; K any (odd, not a multiple of 4 or 8, large)
SHAPES = ((5, 4), (17, 7), (33, 130), (40, 576), (16, 3), (47, 1001))


@pytest.fixture(scope="module")
def lib():
    native = load_native()
    assert native is not None, "the native kernels must build on CPU machines with cc"
    return native


@pytest.fixture(scope="module")
def scalar_libs(tmp_path_factory):
    """w8a8_cpu.c alone without SIMD: signed activations, and unsigned (code + 128 with
    the column-sum correction, as the VNNI paths do)."""
    cc = shutil.which("cc")
    assert cc is not None
    flags = [f for f in CFLAGS if f != "-march=native" and f != "-O3"] + ["-O1"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-mno-avx", "-mno-avx2"]
    libs = []
    for extra in ([], ["-DW8A8_TEST_UNSIGNED"]):
        out = tmp_path_factory.mktemp("w8a8") / "w8a8.so"
        subprocess.run([cc, *flags, *extra, str(CSRC / "w8a8_cpu.c"), "-o", str(out), "-lm"],
                       check=True, capture_output=True, timeout=120)
        so = ctypes.CDLL(str(out))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        so.tandem_w8a8_simd.restype = i64
        so.tandem_w8a8_gemm_i32.argtypes = [p] * 3 + [i64] * 4
        so.tandem_w8a8_linear_f32.argtypes = [p] * 5 + [i64] * 4
        so.tandem_w8a8_quantize_f32.argtypes = [p] * 3 + [i64] * 4
        assert so.tandem_w8a8_simd() == 0
        libs.append(so)
    return libs


def _codes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """int8 codes in [-127, 127] with the extremes over-represented (saturation checks)."""
    c = torch.randint(-127, 128, shape, generator=gen)
    extreme = torch.rand(shape, generator=gen) < 0.3
    return torch.where(extreme, 127 * torch.sign(c), c).to(torch.int8)


def _panels(codes: torch.Tensor, scales: torch.Tensor | None = None):
    """Row-major [N, K] (and [N, 1]) -> panel buffers [P, K, 16] / [P, 1, 16]."""
    n, k = codes.shape
    p = (n + 15) // 16
    pc = torch.zeros(p * 16, k, dtype=torch.int8)
    pc[:n] = codes
    ps = torch.zeros(p * 16, 1, dtype=torch.float16)
    if scales is not None:
        ps[:n] = scales
    return (pc.view(p, 16, k).transpose(1, 2).contiguous(),
            ps.view(p, 16, 1).transpose(1, 2).contiguous())


def _layer(method: W8A8Method, n: int, k: int, bias: bool = True,
           dtype: torch.dtype = torch.float32) -> QuantLinear:
    with torch.device("meta"):
        layer = QuantLinear(method, k, n, bias, dtype)
    layer.to_empty(device=CPU)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(n)))
    return layer


def test_quantizer_matches_torch_reference_exactly(lib):
    gen = torch.Generator().manual_seed(0)
    for m, k in ((1, 1), (3, 7), (17, 8), (64, 576), (5, 1001)):
        x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m).view(m, 1)
        x[0, : k // 2] = 0.5  # repeated values: a row's codes hit the same ties
        if m > 2:
            x[2] = 0.0  # amax 0: scale 0, codes 0
        codes, scales = quantize_rows(x)
        got_codes, got_scales = native_quantize_rows(x, lib)
        assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales), (m, k)
        nonzero = scales[:, 0] > 0
        assert (codes[nonzero].abs().amax(1) == 127).all()
        assert codes.abs().max() <= 127
        err = (codes.float() * scales - x).abs()
        assert (err <= scales * 0.5 * (1 + 1e-5)).all()  # round to nearest


def _cpu_path() -> int | None:
    """The path `-march=native` compiles on this CPU (3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2,
    0 none), from /proc/cpuinfo; None off Linux x86."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        line = next(x for x in text.splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return None
    flags = set(line.split())
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return 3
    return 2 if {"avx2", "avx_vnni"} <= flags else int("avx2" in flags)


def test_gemm_int32_is_exact_on_every_path(lib, scalar_libs):
    """int32 sums vs an int64 reference of the codes, bit for bit, for the compiled SIMD
    path (the one this CPU has: an AVX-512 VNNI machine runs vpdpbusd on activations +
    128 with the column-sum correction) and both scalar builds."""
    if platform.machine() in ("x86_64", "AMD64") and _cpu_path() is not None:
        assert lib.tandem_w8a8_simd() == _cpu_path()
    gen = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        w = _codes(gen, n, k)
        panels, _ = _panels(w)
        for m in ROWS:
            a = _codes(gen, m, k)
            want = a.long() @ w.long().T
            assert torch.equal(panel_gemm_i32(a, panels, n, lib).long(), want), (m, n, k)
            if m in (5, 64):
                for so in scalar_libs:
                    assert torch.equal(panel_gemm_i32(a, panels, n, so).long(), want)


def test_linear_matches_float64_reference_and_torch_path(lib, scalar_libs):
    """y = dequantized activations x dequantized weights (+ bias) within float32 rounding;
    the native kernel, the scalar builds and the torch `_int_mm` path agree bit for bit
    (same exact int32 sums, same float32 epilogue order)."""
    gen = torch.Generator().manual_seed(2)
    for n, k in SHAPES:
        g = quantize_grouped(torch.randn(n, k, generator=gen), 8, k, symmetric=True)
        codes, scales = _panels(g.codes, g.scales)
        bias = torch.randn(n, generator=gen)
        torch_layer = _layer(W8A8Method(device=CPU), n, k)
        torch_layer.method.load(torch_layer, 0, g)
        with torch.no_grad():
            torch_layer.bias.copy_(bias)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen) * 4
            xq, xs = quantize_rows(x)
            acc = xq.double() @ g.codes.double().T
            terms = acc.abs() * xs.double() * g.scales.double().T
            want = acc * xs.double() * g.scales.double().T + bias.double()
            y = w8a8_panel_linear(x, codes, scales, bias, n, lib)
            bound = 4 * 2.0 ** -24 * (terms + bias.double().abs())
            assert ((y.double() - want).abs() <= bound).all(), (m, n, k)
            assert torch.equal(torch_layer(x), y)
            if m in (2, 17):
                for so in scalar_libs:
                    assert torch.equal(w8a8_panel_linear(x, codes, scales, bias, n, so), y)


def test_method_loads_rows_and_applies(lib):
    """Fused parts at unaligned row offsets (float rows, 8-bit per-channel grouped rows
    kept bit-exact, Q8_0 g32 and int4 rows requantized, a -128 code requantized), then
    apply with min_rows=1 (the int8 GEMM) on the native and the torch layout, embed, T=0,
    a bf16 layer, weight bytes."""
    gen = torch.Generator().manual_seed(3)
    k = 96
    float_part = torch.randn(7, k, generator=gen)
    channel = quantize_grouped(torch.randn(10, k, generator=gen), 8, k, symmetric=True)
    q8_0 = quantize_grouped(torch.randn(9, k, generator=gen), 8, 32, symmetric=True)
    q4_1 = quantize_grouped(torch.randn(6, k, generator=gen), 4, 32, symmetric=False)
    low = quantize_grouped(torch.randn(3, k, generator=gen), 8, k, symmetric=True)
    low.codes[0, 0] = -128
    parts = [float_part, channel, q8_0, q4_1, low]
    want_rows = [quantize_grouped(float_part, 8, k, True), channel,
                 quantize_grouped(q8_0.dequantize(), 8, k, True),
                 quantize_grouped(q4_1.dequantize(), 8, k, True),
                 quantize_grouped(low.dequantize(), 8, k, True)]
    want = torch.cat([r.dequantize() for r in want_rows])
    n = want.shape[0]
    outputs = []
    x = torch.randn(33, k, generator=gen)
    for native in (lib, None):
        method = get_linear_method("w8a8", device=CPU, native=native, min_rows=1)
        assert isinstance(method, W8A8Method) and method.panels == (native is not None)
        layer = _layer(method, n, k)
        starts = torch.tensor([0] + [p.shape[0] for p in parts]).cumsum(0).tolist()
        for start, part in reversed(list(zip(starts, parts, strict=False))):  # any order
            method.load(layer, start, part)
        method.finish(layer)
        if native is not None:  # the last panel's padded columns are zero, not garbage
            assert not layer.codes[-1, :, n % 16:].any()
            assert not layer.scales[-1, :, n % 16:].any()
        assert torch.equal(method.dequantize(layer), want)
        assert int(layer.codes.min()) >= -127
        ids = torch.tensor([0, n - 1, 8, 16, 8])
        assert torch.equal(method.embed(layer, ids), want[ids])
        assert layer(x[:0]).shape == (0, n)
        outputs.append(layer(x))
        assert method.weight_bytes(layer) == layer.codes.numel() + 2 * layer.scales.numel()
    assert torch.equal(outputs[0], outputs[1])
    bf = _layer(W8A8Method(device=CPU, native=lib, min_rows=1), 20, k, dtype=torch.bfloat16)
    bf.method.load(bf, 0, float_part.repeat(3, 1)[:20])
    bf.method.finish(bf)
    xb = torch.randn(4, k, generator=gen).bfloat16()
    yb = bf(xb)
    assert yb.dtype == torch.bfloat16 and bf.method.embed(bf, ids[2:4]).dtype == torch.bfloat16
    ref = w8a8_panel_linear(xb.float(), bf.codes, bf.scales, bf.bias.float(), 20, lib)
    assert torch.equal(yb, ref.bfloat16())


def test_decode_rows_use_the_weight_only_kernel(lib):
    """Below min_rows the layer computes x @ W.T with unquantized activations (K1's int8
    kernel on the same panels) where that kernel is built, else the int8 GEMM."""
    gen = torch.Generator().manual_seed(4)
    n, k = 37, 64
    w = torch.randn(n, k, generator=gen)
    method = W8A8Method(device=CPU, native=lib, min_rows=8)
    layer = _layer(method, n, k, bias=False)
    method.load(layer, 0, w)
    method.finish(layer)
    x = torch.randn(3, k, generator=gen)
    y = layer(x)
    if method._weight_only:
        want = x.double() @ method.dequantize(layer).double().T
        bound = k * 2.0 ** -23 * (x.double().abs() @ method.dequantize(layer).double().abs().T)
        assert ((y.double() - want).abs() <= bound).all()
        assert not torch.equal(y, w8a8_panel_linear(x, layer.codes, layer.scales, None, n,
                                                    lib))
    else:
        assert torch.equal(y, w8a8_panel_linear(x, layer.codes, layer.scales, None, n, lib))
    big = torch.randn(8, k, generator=gen)
    assert torch.equal(layer(big), w8a8_panel_linear(big, layer.codes, layer.scales, None, n,
                                                     lib))


def test_min_rows_option_env_and_bad_input(monkeypatch, lib):
    monkeypatch.setenv(MIN_ROWS_ENV, "37")
    assert W8A8Method(device=CPU).min_rows == 37
    assert W8A8Method(device=CPU, min_rows=2).min_rows == 2
    monkeypatch.setenv(MIN_ROWS_ENV, "lots")
    with pytest.raises(ConfigError, match=MIN_ROWS_ENV):
        W8A8Method(device=CPU)
    monkeypatch.delenv(MIN_ROWS_ENV)
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="min_rows"):
            W8A8Method(device=CPU, min_rows=bad)
    method = W8A8Method(device=CPU)
    layer = _layer(method, 8, 16)
    with pytest.raises(ConfigError, match=r"\[r, 16\]"):
        method.load(layer, 0, torch.zeros(2, 15))
    with pytest.raises(ConfigError, match="outside"):
        method.load(layer, 7, torch.zeros(2, 16))
    with pytest.raises(ConfigError, match="K=32"):
        method.load(layer, 0, GroupedWeight(torch.zeros(2, 32, dtype=torch.int8),
                                            torch.ones(2, 1, dtype=torch.float16), None, 8,
                                            32))
    with pytest.raises(ValueError, match=r"\[T, 16\]"):
        layer(torch.zeros(3, 5))
    with pytest.raises(ConfigError, match="in_features <= 65536"), torch.device("meta"):
        QuantLinear(W8A8Method(device=CPU, native=lib), 65537, 16, False, torch.float32)
