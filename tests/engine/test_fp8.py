"""The "fp8" linear method (engine/quant/fp8.py): e4m3 quantization, every execution mode
against float64 references of its own dequantized weights (and, for W8A8, activations)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.quant.base import QuantLinear, get_linear_method, quantize_grouped
from tandem.engine.quant.fp8 import E4M3_MAX, Fp8Method, e4m3_as_half, quantize_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
MODES = ["torch", "scaled_mm", "triton"]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def test_every_e4m3_code_decodes_exactly_through_float16():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # NaNs are never stored
    half = e4m3_as_half(codes)
    assert half.dtype == torch.float16
    assert torch.equal(half.float() * 256, codes.float())


@pytest.mark.parametrize("seed", range(4))
def test_quantize_rows_saturates_and_round_trips_within_e4m3_precision(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(40, 96, generator=gen) * torch.logspace(-30, 30, 40)[:, None]
    w[3] = 0.0  # a zero row
    w[5, 7] = 1e4 * w[5].abs().max()  # an outlier: the rest of its row goes subnormal
    w[9] = torch.randn(96, generator=gen) * 1e-39  # float32 subnormals
    codes, scale = quantize_rows(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    q = codes.float()
    assert torch.isfinite(q).all() and q.abs().max() <= E4M3_MAX
    assert (scale > 0).all()
    nonzero = w.abs().amax(1) > 0
    # each row's largest magnitude maps to the top code (a subnormal row's scale is clamped)
    top = q.abs().amax(1)
    assert (top[nonzero & (w.abs().amax(1) > 1e-30)] == E4M3_MAX).all()
    assert (q[~nonzero] == 0).all()
    deq = q.double() * scale.double()[:, None]
    # round to nearest: half an ulp (2**-4 relative) for normals, half the subnormal step
    # (2**-10 scale) below 2**-6 scale; 1e-6 for the float32 division before the cast
    bound = torch.maximum(w.double().abs() * 2.0 ** -4, scale.double()[:, None] * 2.0 ** -10)
    assert ((deq - w.double()).abs() <= bound * (1 + 1e-6)).all()


def make_layer(method: Fp8Method, n: int, k: int, bias: bool, dtype: torch.dtype,
               gen: torch.Generator) -> tuple[QuantLinear, torch.Tensor]:
    """A loaded layer (rows 0..19 as float rows, the rest as a grouped int8 weight) and its
    float64 dequantized weight."""
    with torch.device(DEVICE):
        layer = QuantLinear(method, k, n, bias, dtype)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=gen).to(dtype))
    w = torch.randn(n, k, generator=gen) * 0.1
    method.load(layer, 0, w[:20].to(dtype))
    gw = quantize_grouped(w[20:], 8, 32, True)
    method.load(layer, 20, gw)
    method.finish(layer)
    codes, scale = quantize_rows(torch.cat([w[:20].to(dtype).float(), gw.dequantize()]))
    assert torch.equal(layer.weight.cpu().view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(layer.weight_scale.cpu(), scale)
    deq = method.dequantize(layer).cpu()
    assert torch.equal(deq, codes.float() * scale[:, None])
    return layer, deq.double()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("seed", "m", "bias", "dtype"), [
    (0, 1, True, torch.float32), (1, 5, False, torch.float32), (2, 33, True, torch.float32),
    (3, 5, True, torch.bfloat16)])
def test_apply_matches_float64_reference(mode, seed, m, bias, dtype):
    if mode == "triton":
        pytest.importorskip("triton")
    if mode == "scaled_mm" and DEVICE.type == "cuda" and (
            torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    gen = torch.Generator().manual_seed(seed)
    method = Fp8Method(device=DEVICE, mode=mode)
    n, k = 48, 64
    layer, deq = make_layer(method, n, k, bias, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    if mode == "scaled_mm":  # W8A8: the reference sees the same quantized activations
        xq, sx = quantize_rows(x)
        xr = xq.double() * sx.double()[:, None]
    else:
        xr = x.double()
    ref = xr @ deq.t()
    if bias:
        ref += layer.bias.detach().double().cpu()
    got = layer(x.to(DEVICE))
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    assert layer(torch.empty(0, k, dtype=dtype, device=DEVICE)).shape == (0, n)


def test_w8a8_differs_from_weight_only_by_the_activation_rounding_only():
    """The CPU's _scaled_mm path really quantizes activations: it disagrees with the
    weight-only result by about e4m3's precision, not by float32 rounding."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=gen)
    x = torch.randn(9, 64, generator=gen)
    outs = []
    for mode in ("torch", "scaled_mm"):
        with torch.device("cpu"):
            layer = QuantLinear(Fp8Method(device=torch.device("cpu"), mode=mode), 64, 48, False,
                                torch.float32)
        layer.method.load(layer, 0, w)
        outs.append(layer(x).double())
    err = ((outs[0] - outs[1]).abs().max() / outs[0].abs().max()).item()
    assert 1e-4 < err < 0.1


def test_embed_reads_only_the_asked_rows_bit_exactly():
    gen = torch.Generator().manual_seed(3)
    method = get_linear_method("fp8", device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        layer, deq = make_layer(method, 48, 64, False, dtype, gen)
        ids = torch.tensor([0, 47, 20, 20, 5])
        got = method.embed(layer, ids.to(DEVICE))
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), method.dequantize(layer).cpu()[ids].to(dtype))


def test_registry_storage_bytes_and_meta_create():
    method = get_linear_method("fp8", device=torch.device("cpu"))
    assert isinstance(method, Fp8Method) and method.mode == "torch"
    with torch.device("meta"):
        layer = QuantLinear(method, 64, 48, True, torch.float32)
    assert layer.weight.shape == (48, 64) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == (48,) and layer.weight_scale.dtype == torch.float32
    assert layer.weight.is_meta  # create never fills values
    assert method.weight_bytes(layer) == 48 * 64 + 4 * 48
    with pytest.raises(ConfigError, match="fp8 mode must be one of"):
        Fp8Method(device=torch.device("cpu"), mode="int8")
    with torch.device("cpu"):
        layer = QuantLinear(method, 64, 48, False, torch.float32)
    with pytest.raises(ConfigError, match=r"fp8 load of rows \(8, 32\) at 0"):
        method.load(layer, 0, torch.zeros(8, 32))
