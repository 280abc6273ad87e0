"""The CPU's instruction-set level (`engine/cpu_isa.py`): detection from the CPU's flags,
the `TANDEM_CPU_ISA` cap, and the kernels it picks (float32 panels or oneDNN, bfloat16
linears packed for oneDNN only where the CPU multiplies bfloat16 in hardware)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine import cpu_isa as isa
from tandem.engine.model import cpu_linear
from tandem.engine.native import load_native
from tandem.engine.quant.base import QuantLinear
from tandem.engine.quant.float_methods import PackedMethod

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
BF16 = AVX512 | {"avx512_bf16", "avx512_vnni"}
AMX = BF16 | {"amx_bf16", "amx_int8", "amx_tile"}


@pytest.mark.parametrize(("flags", "level"), [
    (frozenset(), "scalar"), (frozenset({"avx2"}), "scalar"), (AVX2, "avx2"),
    (AVX2 | {"avx512f"}, "avx2"), (AVX512, "avx512"), (AVX512 | {"avx512_bf16"}, "avx512"),
    (BF16, "avx512_bf16"), (AMX, "amx"),
    (AVX512 | {"amx_bf16", "amx_int8", "amx_tile"}, "avx512"),  # levels are cumulative
])
def test_the_level_is_the_highest_whose_flags_and_the_lower_ones_are_all_there(flags, level):
    got = isa.resolve(flags, None)
    assert got.level == got.detected == level
    assert got.at_least(level) and got.at_least("scalar")
    if level != "amx":
        assert not got.at_least(isa.LEVELS[isa.LEVELS.index(level) + 1])


def test_the_variable_caps_the_level_and_refuses_one_the_cpu_lacks():
    assert isa.resolve(AMX, "avx2").level == "avx2"
    assert isa.resolve(AMX, " AVX512_BF16 ").level == "avx512_bf16"
    assert isa.resolve(AMX, "avx2").detected == "amx"
    assert isa.resolve(BF16, "").level == "avx512_bf16"
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA=amx but this CPU's level is "
                                         "avx512_bf16"):
        isa.resolve(BF16, "amx")
    with pytest.raises(ValueError, match="unknown CPU ISA level 'sse9'"):
        isa.resolve(BF16, "sse9")
    with pytest.raises(ValueError, match="unknown CPU ISA level"):
        isa.resolve(BF16, None).at_least("avx1024")


@pytest.fixture
def capped(monkeypatch):
    """`cpu_isa()` re-read under a `TANDEM_CPU_ISA` value (the cache cleared before and
    after)."""
    def cap(level: str | None) -> isa.CpuIsa:
        if level is None:
            monkeypatch.delenv(isa.ENV, raising=False)
        else:
            monkeypatch.setenv(isa.ENV, level)
        isa.cpu_isa.cache_clear()
        return isa.cpu_isa()

    yield cap
    isa.cpu_isa.cache_clear()


def test_this_machine_reads_its_own_flags_and_each_lower_level_can_be_forced(capped,
                                                                           monkeypatch):
    own = capped(None)
    assert own.level == own.detected == isa.detect_level(own.flags)
    monkeypatch.delenv("TANDEM_LINEAR_KERNEL", raising=False)
    for level in isa.LEVELS[:isa.LEVELS.index(own.detected) + 1]:
        got = capped(level)
        assert got.level == level and got.detected == own.detected
        native = load_native()  # the library built for this level
        assert native is load_native(level)
        # float32: the AVX2 panels below AVX-512 (where built), oneDNN from AVX-512 up
        assert cpu_linear.native_simd(native) == got.at_least("avx2")
        assert cpu_linear.native_preferred(native) == (
            got.at_least("avx2") and not got.at_least("avx512"))
        # bfloat16: only with hardware bfloat16: the native pair panels, oneDNN with AMX
        bf16 = got.at_least("avx512_bf16")
        cpu = torch.device("cpu")
        assert cpu_linear.native_simd(native, torch.bfloat16) == bf16
        assert cpu_linear.packing_available(torch.bfloat16, cpu, native) == bf16
        assert cpu_linear.native_preferred(native, torch.bfloat16) == (
            bf16 and not got.at_least("amx"))
    if own.detected != "amx":
        with pytest.raises(ValueError, match="TANDEM_CPU_ISA=amx"):
            capped("amx")


def layer(out_features: int, in_features: int, dtype: torch.dtype, bias: bool,
          seed: int, native_panels: bool | None = None
          ) -> tuple[QuantLinear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    method = PackedMethod(device=torch.device("cpu"), native=load_native(), dtype=dtype,
                          native_panels=native_panels)
    q = QuantLinear(method, in_features, out_features, bias=bias, dtype=dtype)
    method.load(q, 0, w)
    if b is not None:
        q.bias.data.copy_(b)
    method.finish(q)
    return q, w, b


@pytest.mark.parametrize("native_panels", [True, False], ids=["native", "onednn"])
def test_bfloat16_linears_pack_where_the_cpu_has_bfloat16_math(capped, native_panels):
    """Where the level allows it, in both layouts (native pair panels, oneDNN's): packed
    bfloat16 linears of odd shapes (odd K, N past a panel, one column) equal a float64
    product to one bfloat16 rounding of the output (float32 sums: (K + 2) u of |x| |W|),
    and `F.linear` in bfloat16 to its rounding, for 1..70 rows (every row tail of the 8-row
    register tile); their float weights and embedding rows read back exactly. Below it (or
    on a CPU without it), bfloat16 is not packed and the method refuses its panels."""
    own = capped(None)
    cpu = torch.device("cpu")
    if not own.at_least("avx512_bf16"):
        assert not cpu_linear.packing_available(torch.bfloat16, cpu, load_native())
        with pytest.raises(ValueError, match="AVX512-BF16"):
            PackedMethod(device=cpu, native=load_native(), native_panels=True,
                         dtype=torch.bfloat16)
        return
    for seed, (n, k, bias) in enumerate([(192, 576, False), (577, 65, True),
                                         (33, 1536, False), (1, 16, True), (64, 7, False)]):
        q, w, b = layer(n, k, torch.bfloat16, bias, seed, native_panels)
        assert (q.method.kernel is not None) == native_panels
        assert not hasattr(q, "weight") and torch.equal(q.method.dequantize(q),
                                                          w.float())
        ids = torch.tensor([0, n - 1, n // 2, 0])
        if native_panels:
            assert q.method.embeds_cheaply and torch.equal(q.method.embed(q, ids), w[ids])
        for rows in (1, 3, 7, 8, 9, 16, 70):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(
                torch.bfloat16)
            y = q(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            bound = (x.double().abs() @ w.double().abs().T) * (k + 2) * 2.0 ** -24
            if b is not None:
                bound += b.double().abs() * 2.0 ** -24
            assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + bound).all()
            torch.testing.assert_close(y, F.linear(x, w, b), atol=2e-2, rtol=1.6e-2)
    capped("avx512")
    assert not cpu_linear.packing_available(torch.bfloat16, cpu, load_native())
