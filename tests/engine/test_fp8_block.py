"""Block-wise FP8 weights (DeepSeek-V3 / Qwen3 -FP8 checkpoints' `weight_block_size`):
`Fp8Weight` with per-(row, K-group) scales, the fp8 method's CPU ("torch") and Triton
paths (the Triton kernel under TRITON_INTERPRET=1, tests/conftest.py sets it), partial
last groups, whole-group column slices."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.quant.base import Fp8Weight, QuantLinear, get_linear_method
from tests.engine.prequant_ckpt import fp8_block_linear

CPU = torch.device("cpu")


def _weight(n: int, k: int, block: tuple[int, int], seed: int = 0
            ) -> tuple[Fp8Weight, torch.Tensor]:
    """A block-wise Fp8Weight (scales repeated over each block's rows) and its float64
    dequantization w[n, k] = q[n, k] * s[n // bn, k // bk]."""
    codes, scale, _ = fp8_block_linear(torch.Generator().manual_seed(seed), n, k, block)
    full = scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    rows = scale.repeat_interleave(block[0], 0)[:n].contiguous()
    return Fp8Weight(codes, rows, None, block[1]), codes.double() * full[:, :k]


def _layer(weight: Fp8Weight, block_k: int, mode: str, bias: bool = False,
           dtype: torch.dtype = torch.float32) -> QuantLinear:
    method = get_linear_method("fp8", device=CPU, mode=mode, block_k=block_k)
    n, k = weight.shape
    layer = QuantLinear(method, k, n, bias, dtype)
    if bias:
        layer.bias.data.copy_(torch.linspace(-1, 1, n))
    method.load(layer, 0, weight.rows(0, 40))  # two loads, as fused q/k/v parts arrive
    method.load(layer, 40, weight.rows(40, n))
    method.finish(layer)
    return layer


@pytest.mark.parametrize(("n", "k", "block"), [(72, 200, (48, 64)),  # partial N and K blocks
                                               (64, 128, (128, 128))])  # one partial N block
def test_a_layer_computes_with_the_blockwise_dequantization(n, k, block):
    """The layer holds the checkpoint's codes and block scales: its dequantized weight is
    q * s[n // bn, k // bk] exactly (partial last blocks included), its CPU output is
    x @ w.T (+ bias) in float32, and an embedding row decodes the same values."""
    weight, ref = _weight(n, k, block)
    assert torch.equal(weight.dequantize(torch.float64), ref)
    layer = _layer(weight, block[1], "torch", bias=True)
    assert tuple(layer.weight_scale.shape) == (n, -(-k // block[1]))
    assert torch.equal(layer.method.dequantize(layer), ref.float())
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    want = x @ ref.float().T + layer.bias
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, n - 1, 3])
    assert torch.equal(layer.method.embed(layer, ids), ref.float()[ids])


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_triton_kernel_reads_a_scale_per_row_and_group(dtype, tol):
    """`fp8_linear(..., group_size=g)` (the fp8 method's "triton" mode, on any CUDA GPU for
    block-wise weights) equals x @ w.T against float64, with a partial last group (K 200,
    g 64) and a group that BLOCK_K does not divide (g 56: per-element scales), split K."""
    pytest.importorskip("triton")
    from tandem.engine.kernels import triton_unavailable_reason

    if triton_unavailable_reason(CPU):
        pytest.fail(triton_unavailable_reason(CPU))
    from tandem.engine.kernels.triton_quant import fp8_linear, launch_plan

    for block, split in (((48, 64), None), ((16, 56), 2)):
        weight, ref = _weight(72, 200, block, seed=block[1])
        x = torch.randn(5, 200, generator=torch.Generator().manual_seed(2)).to(dtype)
        bias = torch.randn(72, generator=torch.Generator().manual_seed(3))
        want = x.double() @ ref.T + bias.double()
        got = fp8_linear(x, weight.codes, weight.scales, bias, group_size=block[1],
                         split_k=split)
        assert got.dtype == dtype
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < tol, (block, err)
        plan = launch_plan(5, 72, 200, 8, block[1], x.element_size(), CPU, split)
        assert plan.scale_per_tile == (block[1] == 64)
    layer = _layer(_weight(72, 200, (48, 64))[0], 64, "triton")
    assert layer.method.mode == "triton"
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer(x), x @ layer.method.dequantize(layer).T, rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match=r"scales must be contiguous float \[72, 4\]"):
        fp8_linear(x, layer.weight, layer.weight_scale[:, :3].contiguous(), group_size=64)


def test_blockwise_layers_run_weight_only():
    """FP8 tensor cores' per-row scaled matmul cannot take block scales: a block-wise
    layer asked for "scaled_mm" runs the Triton kernel where Triton runs (here: the
    interpreter), the torch decode elsewhere; per-row layers keep their mode."""
    method = get_linear_method("fp8", device=CPU, mode="scaled_mm", block_k=128)
    assert method.mode == "triton" and not method.row_scaled
    assert get_linear_method("fp8", device=CPU, mode="scaled_mm").mode == "scaled_mm"
    assert get_linear_method("fp8", device=CPU).row_scaled


def test_column_slices_keep_whole_groups_and_per_row_weights_fill_block_layers():
    """A rank's input columns of a block-wise weight are whole groups (the last may end
    at K) and dequantize to exactly the unsharded slice; anything else is a ConfigError.
    A per-row FP8 weight loads into a block-wise layer with its scale repeated, exactly;
    a block-wise one into a per-row layer is refused."""
    weight, ref = _weight(72, 200, (48, 64))
    for start, stop in ((0, 64), (64, 200), (128, 200)):
        part = weight.columns(start, stop)
        assert torch.equal(part.dequantize(torch.float64), ref[:, start:stop])
    for start, stop in ((0, 100), (32, 128)):
        with pytest.raises(ConfigError, match=rf"columns \[{start}, {stop}\) of a block-wise "
                                              r"FP8 weight of K=200 are not whole groups of "
                                              "64"):
            weight.columns(start, stop)
    padded = weight.padded_rows(80)
    assert torch.equal(padded.dequantize()[72:], torch.zeros(8, 200))
    with pytest.raises(ConfigError, match=r"fp8 weight scales \(72, 3\) do not match codes "
                                          r"\(72, 200\) with group_size 64"):
        Fp8Weight(weight.codes, weight.scales[:, :3], None, 64)
    codes = weight.codes
    per_row = Fp8Weight(codes, torch.rand(72) * 1e-3)
    layer = _layer(per_row, 64, "torch")
    assert torch.equal(layer.method.dequantize(layer), per_row.dequantize())
    plain = get_linear_method("fp8", device=CPU, mode="torch")
    dst = QuantLinear(plain, 200, 72, False, torch.float32)
    with pytest.raises(ConfigError, match="a block-wise FP8 weight .* into a per-row fp8"):
        plain.load(dst, 0, weight)
