"""Weight-only "int8" / "int4" (`quant/int8.py`, `quant/int4.py`, `csrc/quant_linear_cpu.c`):
each kernel path against a float64 reference of the layer's own dequantized weight, the
scratch path bit for bit against the float32 GEMM, exact GGUF-style loads, unaligned
row-range loads, embed, the torch fallback, a scalar build of the C file, bad input."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.model.cpu_linear import pack_panels
from tandem.engine.native import CFLAGS, CSRC, load_native
from tandem.engine.quant import cpu_kernels
from tandem.engine.quant.base import GroupedWeight, QuantLinear, get_linear_method
from tandem.engine.quant.int8 import GroupedIntMethod

CPU = torch.device("cpu")
ROWS = (0, 1, 3, 7, 16, 100, 300)
CONFIGS = (("int8", {}), ("int8", {"group_size": 32}),
           ("int8", {"group_size": 32, "has_mins": True}), ("int4", {"group_size": 32}),
           ("int4", {"group_size": 64}), ("int4", {"group_size": 128}))


@pytest.fixture(scope="module")
def lib():
    native = load_native()
    assert native is not None, "the native kernels must build on CPU machines with cc"
    assert native.tandem_quant_linear_simd() == (platform.machine() == "x86_64"
                                                 and native.tandem_linear_simd())
    return native


@pytest.fixture(scope="module")
def scalar_lib(tmp_path_factory):
    """quant_linear_cpu.c alone, built without AVX: the portable fallback."""
    cc = shutil.which("cc")
    assert cc is not None
    flags = [f for f in CFLAGS if f not in ("-march=native", "-O3")] + ["-O1"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-mno-avx", "-mno-avx2"]
    out = tmp_path_factory.mktemp("ql") / "ql.so"
    subprocess.run([cc, *flags, str(CSRC / "quant_linear_cpu.c"), "-o", str(out)],
                   check=True, capture_output=True, timeout=120)
    so = ctypes.CDLL(str(out))
    so.tandem_quant_linear_simd.restype = ctypes.c_int64
    for name in ("tandem_quant_linear_i8", "tandem_quant_linear_i4"):
        getattr(so, name).argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
    assert so.tandem_quant_linear_simd() == 0
    return so


def _grouped(gen: torch.Generator, n: int, k: int, bits: int, g: int,
             mins: bool) -> GroupedWeight:
    """Random GGUF-style rows: any codes of the width, float16 scales / mins as stored."""
    lo, hi = (-128, 128) if bits == 8 else (0, 16)
    codes = torch.randint(lo, hi, (n, k), generator=gen).to(torch.int8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).half()
    m = (torch.randn(n, k // g, generator=gen) * 0.05).half() if mins else None
    return GroupedWeight(codes, scales, m, bits, g)


def _layer(name: str, opts: dict, native, n: int, k: int, bias: bool, gen: torch.Generator,
           dtype: torch.dtype = torch.float32) -> QuantLinear:
    method = get_linear_method(name, device=CPU, native=native, **opts)
    with torch.device("meta"):
        layer = QuantLinear(method, k, n, bias, dtype)
    layer.to_empty(device=CPU)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=gen))
    return layer


def _check(ys: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor,
           b: torch.Tensor | None) -> None:
    """Each y vs float64 x @ w.T + b, within float32 accumulation error of the magnitudes
    (observed errors are ~10x below the bound; a wrong scale or code is far above it)."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T + (0 if b is None else b.double())
    scale = x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs()) + 1e-30
    for i, y in enumerate(ys):
        assert y.shape == ref.shape and y.dtype == torch.float32
        err = ((y.double() - ref).abs() / scale).max().item() if y.numel() else 0.0
        assert err < 3e-7 * w.shape[1] ** 0.5, (i, err)


@pytest.mark.parametrize("native", [True, False], ids=["panels", "torch"])
@pytest.mark.parametrize("name,opts", CONFIGS)
def test_apply_matches_float64_reference(name, opts, native, lib):
    gen = torch.Generator().manual_seed(CONFIGS.index((name, opts)) * 2 + native)
    g = opts.get("group_size")
    for n, k, bias in ((37, 384, True), (48, 128, False), (1, 256, True)):
        layer = _layer(name, opts, lib if native else None, n, k, bias, gen)
        if opts.get("has_mins"):  # a GGUF 4-bit tensor in an int8 layer, loaded exactly
            layer.method.load(layer, 0, _grouped(gen, n, k, 4, g, True))
        else:
            layer.method.load(layer, 0, torch.randn(n, k, generator=gen) * 0.1)
        w = layer.method.dequantize(layer)
        assert w.dtype == torch.float32 and w.shape == (n, k)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            _check([layer(x)], x, w, layer.bias)


# (bits, g, K, mins): per channel, groups, and group sizes whose k steps do not divide into
# the kernel's accumulator chains (130 columns; 3 int4 lines per group)
@pytest.mark.parametrize("bits,g,k,mins", [(8, 576, 576, False), (8, 130, 130, False),
                                           (8, 32, 384, True), (4, 32, 384, True),
                                           (4, 64, 384, True), (4, 128, 384, False),
                                           (4, 6, 96, True)])
def test_kernel_paths(bits, g, k, mins, lib, scalar_lib):
    """Both native paths (few rows in registers, dequantized scratch) at every row count,
    and the scalar build; the scratch path equals the float32 GEMM on the dequantized
    weight bit for bit (same tile code, exact dequantization)."""
    gen = torch.Generator().manual_seed(bits * 1000 + g)
    n = 75
    gw = _grouped(gen, n, k, bits, g, mins)
    p = cpu_kernels.panel_count(n)
    codes = torch.empty(p, k if bits == 8 else k // 2, 16,
                        dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(p, k // g, 16, dtype=torch.float16)
    mn = torch.empty_like(scales) if mins else None
    cpu_kernels.write_panel_rows(codes, scales, mn, 0, gw)
    cpu_kernels.clear_padding(codes, scales, mn, n)
    w = gw.dequantize()
    wp = pack_panels(w)
    fn = cpu_kernels.int8_panel_linear if bits == 8 else cpu_kernels.int4_panel_linear
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        b = torch.randn(n, generator=gen) if m % 2 else None
        _check([fn(x, codes, scales, mn, g, b, n, so, mode=mode) for so, mode in (
            (lib, "few"), (lib, "scratch"), (lib, "auto"), (scalar_lib, "auto"))], x, w, b)
        y = torch.empty(m, n)
        if m:
            lib.tandem_linear_packed_f32(x.data_ptr(), wp.data_ptr(),
                                         None if b is None else b.data_ptr(), y.data_ptr(),
                                         m, n, k, torch.get_num_threads())
        assert torch.equal(fn(x, codes, scales, mn, g, b, n, lib, mode="scratch"), y)


@pytest.mark.parametrize("native", [True, False], ids=["panels", "torch"])
def test_grouped_loads_are_exact(native, lib):
    """GGUF Q4_1 / Q4_0 / Q8_0 rows keep their bits; 4-bit rows fit an int8 layer with mins;
    a coarser source group repeats its scales; other combinations re-quantize."""
    gen = torch.Generator().manual_seed(7)
    n, k = 40, 256
    q41 = _grouped(gen, n, k, 4, 32, True)
    q40 = GroupedWeight(q41.codes, q41.scales, (q41.scales.float() * -8).half(), 4, 32)
    q80 = _grouped(gen, n, k, 8, 32, False)
    q4_64 = _grouped(gen, n, k, 4, 64, False)
    exact = [("int4", {"group_size": 32}, q41), ("int4", {"group_size": 32}, q40),
             ("int8", {"group_size": 32}, q80), ("int8", {"group_size": 32, "has_mins": True},
                                                 q41),
             ("int4", {"group_size": 32}, q4_64), ("int8", {"group_size": 32}, q4_64)]
    for name, opts, gw in exact:
        layer = _layer(name, opts, lib if native else None, n, k, False, gen)
        layer.method.load(layer, 0, gw)
        assert torch.equal(layer.method.dequantize(layer), gw.dequantize()), (name, opts)
    # 8-bit rows into int4: dequantized and re-quantized (4-bit accuracy, deterministic)
    layer = _layer("int4", {"group_size": 32}, lib if native else None, n, k, False, gen)
    layer.method.load(layer, 0, q80)
    w, ref = layer.method.dequantize(layer), q80.dequantize()
    groups = ref.view(n, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # the int4 scale of each group
    err = (w - ref).view(n, -1, 32).abs().amax(-1)
    assert (err <= step / 2 + 2e-3 * groups.abs().amax(-1)).all()
    # mins into a layer without: re-quantized, still close
    layer = _layer("int8", {"group_size": 32}, lib if native else None, n, k, False, gen)
    layer.method.load(layer, 0, q41)
    torch.testing.assert_close(layer.method.dequantize(layer), q41.dequantize(), atol=2e-3,
                               rtol=0)


@pytest.mark.parametrize("native", [True, False], ids=["panels", "torch"])
@pytest.mark.parametrize("name,opts", [CONFIGS[2], CONFIGS[3]])
def test_row_range_loads_in_random_splits(name, opts, native, lib):
    """Rows loaded in random unaligned parts, in random order, give the same buffers as one
    load (fused q/k/v parts: e.g. rows 576..768 of 960); padded columns are zero."""
    gen = torch.Generator().manual_seed(11)
    n, k = 150, 128
    gw = _grouped(gen, n, k, 4, 32, True)
    whole = _layer(name, opts, lib if native else None, n, k, False, gen)
    whole.method.load(whole, 0, gw)
    for _ in range(25):
        cuts = sorted(torch.randperm(n - 1, generator=gen)[:int(torch.randint(
            0, 6, (1,), generator=gen))].add(1).tolist())
        bounds = list(zip([0, *cuts], [*cuts, n], strict=True))
        layer = _layer(name, opts, lib if native else None, n, k, False, gen)
        for i in torch.randperm(len(bounds), generator=gen).tolist():
            a, b = bounds[i]
            layer.method.load(layer, a, gw.rows(a, b))
        for buf in ("codes", "scales", "mins"):
            assert torch.equal(getattr(layer, buf), getattr(whole, buf)), (bounds, buf)
    if native:
        assert (whole.codes[-1, :, n % 16:] == 0).all()
        assert (whole.scales[-1, :, n % 16:] == 0).all()


@pytest.mark.parametrize("native", [True, False], ids=["panels", "torch"])
@pytest.mark.parametrize("name,opts", [CONFIGS[0], CONFIGS[3]])
def test_embed_bfloat16_and_bytes(name, opts, native, lib):
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 128
    layer = _layer(name, opts, lib if native else None, n, k, True, gen, torch.bfloat16)
    layer.method.load(layer, 0, torch.randn(n, k, generator=gen))
    w = layer.method.dequantize(layer)
    ids = torch.tensor([5, 69, 0, 5, 16, 17])
    emb = layer.method.embed(layer, ids)
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, w[ids].to(torch.bfloat16))
    x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T + layer.bias.double()
    torch.testing.assert_close(y.double(), ref, atol=0.05, rtol=0.01)
    rows = -(-n // 16) * 16 if native else n
    per_row = k if name == "int8" else k // 2
    groups = k // opts.get("group_size", k) * (2 if name == "int4" else 1)
    assert layer.method.weight_bytes(layer) == rows * (per_row + 2 * groups)


def test_bad_input(lib):
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ConfigError, match="int4 group_size"):
        get_linear_method("int4", device=CPU, group_size=48)
    with pytest.raises(ConfigError, match="int8 group_size"):
        get_linear_method("int8", device=CPU, group_size=0)
    with pytest.raises(ConfigError, match="not a multiple of group_size"):
        _layer("int4", {"group_size": 64}, lib, 8, 96, False, gen)
    layer = _layer("int8", {}, lib, 8, 64, False, gen)
    with pytest.raises(ConfigError, match=r"expected float rows \[r, 64\]"):
        layer.method.load(layer, 0, torch.randn(8, 32))
    with pytest.raises(ConfigError, match="outside"):
        layer.method.load(layer, 4, torch.randn(8, 64))
    with pytest.raises(ConfigError, match="K=32"):
        layer.method.load(layer, 0, _grouped(gen, 8, 32, 8, 32, False))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.int8_panel_linear(torch.zeros(1, 64, dtype=torch.float64), layer.codes,
                                      layer.scales, None, 64, None, 8, lib)
    assert isinstance(layer.method, GroupedIntMethod) and layer.method.panels
