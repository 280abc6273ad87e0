"""Triton dequant-matmul (engine/kernels/triton_quant.py) against float64 references of the
dequantized weight; on the CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tandem.engine.kernels import triton_unavailable_reason  # noqa: E402
from tandem.engine.quant.base import quantize_grouped  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |got - ref| / max |ref| against float64 (16-bit: the output rounding dominates)
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def TQ():
    assert triton_unavailable_reason(DEVICE) is None
    from tandem.engine.kernels import triton_quant

    return triton_quant


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K // 2] uint8, k = 2j in byte j's low nibble."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


CASES = [  # (seed, bits, symmetric, M, N, K, group, has_bias, dtype, split_k)
    (0, 8, True, 1, 16, 64, 32, False, torch.float32, None),
    (1, 8, True, 5, 48, 128, 64, True, torch.float32, None),
    (2, 8, True, 33, 48, 256, 256, True, torch.float32, 2),  # per channel, K split
    (3, 8, True, 5, 48, 144, 72, True, torch.float32, 2),  # group 72: per-element
    (4, 4, False, 1, 16, 64, 32, True, torch.float32, None),  # Q4_1-like: mins
    (5, 4, False, 33, 48, 128, 32, False, torch.float32, 2),
    (6, 4, True, 5, 48, 128, 64, True, torch.float32, None),  # Q4_0-like
    (7, 4, False, 5, 33, 40, 20, True, torch.float32, None),  # group 20, K masked
    (8, 8, True, 5, 48, 128, 32, True, torch.bfloat16, None),
    (9, 4, False, 33, 48, 128, 32, True, torch.bfloat16, 2),
    (10, 4, False, 5, 16, 64, 64, False, torch.float16, None),
    (11, 8, True, 1, 48, 64, 32, True, torch.float16, 2),
]


@pytest.mark.parametrize(("seed", "bits", "sym", "m", "n", "k", "g", "has_bias", "dtype",
                          "split_k"), CASES)
def test_grouped_linear_matches_float64_dequantized(TQ, seed, bits, sym, m, n, k, g,
                                                    has_bias, dtype, split_k):
    gen = torch.Generator().manual_seed(seed)
    gw = quantize_grouped(torch.randn(n, k, generator=gen) * 0.5, bits, g, sym)
    codes = gw.codes if bits == 8 else pack_int4(gw.codes)
    wide = torch.randn(m, k + 24, generator=gen).to(dtype)
    x = wide[:, 8:8 + k]  # strided rows
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    ref = x.double() @ gw.dequantize(torch.float64).t()
    if bias is not None:
        ref = ref + bias.double()
    to = {"device": DEVICE}
    got = TQ.grouped_linear(x.to(**to), codes.to(**to), gw.scales.to(**to),
                            None if gw.mins is None else gw.mins.to(**to), bits, g,
                            None if bias is None else bias.to(**to), split_k=split_k)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    plan = TQ.launch_plan(m, n, k, bits, g, x.element_size(), DEVICE, split_k)
    if split_k is not None:
        assert plan.splits == split_k  # the split path really ran
    assert plan.scale_per_tile == (g % 16 == 0 and (bits == 8 or g % 32 == 0))


def test_fp8_linear_decodes_every_e4m3_code_exactly(TQ):
    """Row n of W holds code n everywhere (NaN codes excluded), x = e_0: y[0, n] is the
    decoded value times the row's scale, exactly (one product, the rest zero)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    w = codes[:, None].expand(-1, 32).contiguous().view(torch.float8_e4m3fn)
    scale = torch.full((len(codes),), 0.5)
    x = torch.zeros(3, 32)
    x[0, 0] = 1.0
    x[1, 5] = -2.0
    got = TQ.fp8_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE)).cpu()
    want = w.float()[:, 0] * 0.5
    assert torch.equal(got[0], want)
    assert torch.equal(got[1], -2 * want)
    assert torch.equal(got[2], torch.zeros_like(want))


@pytest.mark.parametrize(("seed", "m", "k", "dtype"), [(0, 5, 256, torch.float32),
                                                        (1, 33, 200, torch.bfloat16)])
def test_fp8_linear_matches_float64(TQ, seed, m, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(48, k, generator=gen)
    scale = w.abs().amax(1) / 448
    wq = (w / scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen)
    ref = x.double() @ (wq.double() * scale.double()[:, None]).t() + bias.double()
    got = TQ.fp8_linear(x.to(DEVICE), wq.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE),
                        split_k=2)
    assert got.dtype == dtype and rel_err(got, ref) < TOL[dtype]
    assert TQ.launch_plan(m, 48, k, 8, k, x.element_size(), DEVICE, 2).splits == 2


def test_empty_batch_and_bad_inputs(TQ):
    gw = quantize_grouped(torch.randn(16, 64), 8, 32, True)
    args = (gw.codes.to(DEVICE), gw.scales.to(DEVICE), None)
    out = TQ.grouped_linear(torch.empty(0, 64, device=DEVICE), *args, 8, 32)
    assert out.shape == (0, 16)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        TQ.grouped_linear(x, *args, 2, 32)
    with pytest.raises(ValueError, match="group_size 48 does not divide K=64"):
        TQ.grouped_linear(x, *args, 8, 48)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        TQ.grouped_linear(torch.randn(2, 32, device=DEVICE), *args, 8, 32)
    with pytest.raises(ValueError, match=r"scales must be contiguous float \[16, 2\]"):
        TQ.grouped_linear(x, gw.codes.to(DEVICE), gw.scales[:, :1].to(DEVICE), None, 8, 32)
    with pytest.raises(ValueError, match="4-bit codes must be 2-D torch.uint8"):
        TQ.grouped_linear(x, *args, 4, 32)  # int8 codes passed as int4
    with pytest.raises(ValueError, match="bias must be"):
        TQ.grouped_linear(x, *args, 8, 32, torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16"):
        TQ.grouped_linear(x.double(), *args, 8, 32)


def test_gpu_check_quant_section_runs_every_method_within_tolerance(TQ):
    """bench/gpu_kernels.py's quantized-matmul checks (gpu_check's `quant` section), at a
    dry-run size: each method matches its reference and reports a bandwidth."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu_kernels as gk

    sizes = gk.QuantSizes((("tiny", 48, 128),), (1,), 1, 5.0)
    res = gk.quant_checks(sizes, torch.bfloat16, DEVICE, gk.Timer(DEVICE), 10.0, 1 << 20)
    names = {"bf16_matmul", "int8_grouped", "int4_g32_grouped", "fp8_triton"}
    if DEVICE.type == "cpu" or torch.cuda.get_device_capability() >= (8, 9):
        names.add("fp8_scaled_mm")
    assert set(res) == {f"tiny_m1_{n}" for n in names}
    for name, r in res.items():
        assert r["ok"] and r["rel_err"] <= r["tol"] and r["weight_gb_per_s"] > 0, (name, r)
        assert r["sets"] >= 2  # rotating copies of the weight
    assert res["tiny_m1_int4_g32_grouped"]["weight_bytes"] == 48 * 64 + 2 * 2 * 48 * 4
    assert res["tiny_m1_fp8_triton"]["plan"]["block_k"] == 128
