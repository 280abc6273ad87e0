"""Quantized weights under tensor parallelism hold exactly the unsharded model's codes.

A GGUF's compressed Q4_0 / Q4_1 / Q8_0 blocks are sliced as they are (`shard_weights`):
output rows freely, input columns in whole 32-column blocks, vocabulary rows padded with
zero-scale rows. Per-channel formats (int8, w8a8, fp8) scale a row-parallel rank's columns
by the whole row's range (`ColumnSlice`), so each rank's dequantized weight is the TP = 1
dequantized weight's slice, bit for bit. End to end: the bundled SmolLM2 GGUF with
`quantization="gguf"` at TP = 3 gives TP = 1's greedy tokens, a third of the compressed
bytes per rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.llm import LLM
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.parallel.tp import TPPlan, local_arch, shard_weights
from tandem.engine.quant.apply import (
    QuantPlan,
    plan_quantization,
    prepare_model,
    row_scaled_weights,
)
from tandem.engine.quant.base import (
    ColumnSlice,
    GroupedWeight,
    QuantLinear,
    get_linear_method,
    quantize_grouped,
)
from tandem.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
# 6 heads of 32 (o_proj K = 192), MLP 384: whole 32-column blocks at 2 and 3 ranks;
# vocabulary 10 (3 ranks: 4 rows each, 2 of them padding)
ARCH = ModelArchConfig("llama", vocab_size=10, hidden_size=192, intermediate_size=384,
                       num_layers=1, num_heads=6, num_kv_heads=6, head_dim=32)


def _grouped(n: int, k: int, seed: int, bits: int = 4) -> GroupedWeight:
    """A random Q4_1-style (4-bit, mins) or Q8_0-style (8-bit) weight in 32-column blocks."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    return quantize_grouped(w, bits, 32, symmetric=bits == 8)


def _checkpoint(seed: int = 0) -> dict[str, GroupedWeight]:
    h, i, v = ARCH.hidden_size, ARCH.intermediate_size, ARCH.vocab_size
    kv = ARCH.num_kv_heads * ARCH.head_dim
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
              p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
              p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
              p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
              p + "mlp.down_proj.weight": (h, i)}
    return {name: _grouped(*shape, seed=seed + j, bits=8 if "embed" in name else 4)
            for j, (name, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_compressed_blocks_shard_exactly(world: int) -> None:
    """Every rank's compressed slice dequantizes to its part of the whole tensor; the
    ranks' parts put back together are the whole tensor (vocabulary padding rows are 0)."""
    ckpt = _checkpoint()
    shards = [dict(shard_weights(ckpt.items(), ARCH, TPPlan.build(ARCH, r, world)))
              for r in range(world)]
    for name, whole in ckpt.items():
        full = whole.dequantize()
        parts = [s[name] for s in shards]
        assert all(isinstance(p, GroupedWeight) for p in parts), name
        deq = [p.dequantize() for p in parts]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(deq, dim=1), full), name
        elif "k_proj" in name or "v_proj" in name:
            plans = [TPPlan.build(ARCH, r, world) for r in range(world)]
            d = ARCH.head_dim
            for plan, got in zip(plans, deq, strict=True):
                start = plan.kv_head_start * d
                assert torch.equal(got, full[start:start + plan.num_kv_heads * d]), name
        else:  # q and gate / up rows; vocabulary rows padded to a multiple of world
            rows = torch.cat(deq)
            vocab = name in ("model.embed_tokens.weight", "lm_head.weight")
            assert len(rows) == (-(-len(full) // world) * world if vocab else len(full))
            assert torch.equal(rows[:len(full)], full), name
            assert not rows[len(full):].any(), name  # padding rows dequantize to 0


def test_compressed_columns_split_off_a_block_boundary_are_refused() -> None:
    """o_proj's 96 input columns in 32-column blocks cannot split 2 ways (48 each)."""
    arch = ModelArchConfig("llama", vocab_size=10, hidden_size=96, intermediate_size=256,
                           num_layers=1, num_heads=6, num_kv_heads=2, head_dim=16)
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ConfigError) as e:
        list(shard_weights([(name, _grouped(96, 96, 0))], arch, TPPlan.build(arch, 1, 2)))
    assert str(e.value) == (
        f"tensor_parallel_size 2: {name} keeps 32-column blocks, but each rank holds 48 of "
        "its 96 input columns (rank 1 from column 48); pick a size that splits them into "
        "whole blocks")


def test_a_rank_whose_columns_split_a_group_is_refused_naming_the_layer() -> None:
    """int4's 32-column groups: an MLP of 160 gives each of 2 ranks 80 down_proj columns."""
    arch = dataclasses.replace(ARCH, intermediate_size=160)
    local = local_arch(arch, TPPlan.build(arch, 0, 2))
    plan = plan_quantization("int4", local, {}, CPU, None)
    with torch.device("meta"), pytest.raises(ConfigError) as e:
        prepare_model(LlamaForCausalLM(local, None), plan, torch.float32)  # type: ignore[arg-type]
    assert str(e.value) == ("layers.0.mlp.down_proj [192 x 80]: int4: in_features 80 is not a "
                            "multiple of group_size 32")


def _method(kind: str):  # noqa: ANN202 - a LinearMethod
    return get_linear_method(kind, device=CPU, native=None)


@pytest.mark.parametrize("kind", ["int8", "w8a8", "fp8"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("source", ["float", "grouped"])
def test_per_channel_row_parallel_shards_equal_the_unsharded_weight(
        kind: str, world: int, source: str) -> None:
    """A row-parallel rank's per-channel codes and scales come from the whole row's range:
    its dequantized weight is the TP = 1 dequantized weight's columns, bit for bit (a
    rank scaling its own columns, as before, differs)."""
    n, k = 12, 192
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g)
    w[:, 5] *= 40  # an outlier column: one rank's range differs from the row's
    whole = w if source == "float" else quantize_grouped(w, 4, 32, symmetric=False)
    method = _method(kind)
    one = QuantLinear(method, k, n, False, torch.float32)
    method.load(one, 0, whole)
    method.finish(one)
    ref = method.dequantize(one)
    size = k // world
    for r in range(world):
        cols = slice(r * size, (r + 1) * size)
        mine = QuantLinear(method, size, n, False, torch.float32)
        method.load(mine, 0, ColumnSlice(whole, r * size, size))
        method.finish(mine)
        assert torch.equal(method.dequantize(mine), ref[:, cols]), (kind, r)
    # the last rank scaled by its own columns' range (without the outlier): not TP = 1's
    own = QuantLinear(method, size, n, False, torch.float32)
    last = k - size
    method.load(own, 0, whole[:, last:] if source == "float" else whole.columns(last, k))
    assert not torch.equal(method.dequantize(own), ref[:, last:])


def test_only_per_channel_layers_take_whole_rows() -> None:
    """`row_scaled_weights`: the weights whose layer scales whole input rows (per-channel
    int8 / w8a8 / fp8), not group-wise int8 / int4, not float."""
    plan = QuantPlan("mixed", {
        "layers.0.self_attn.o_proj": _method("w8a8"),
        "layers.0.mlp.down_proj": get_linear_method("int8", device=CPU, group_size=32),
        "layers.0.mlp.gate_up_proj": _method("fp8"),
        "layers.0.self_attn.qkv_proj": get_linear_method("int4", device=CPU)})
    assert row_scaled_weights(plan, ARCH) == {
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight"}
    name = "model.layers.0.self_attn.o_proj.weight"
    w = torch.randn(192, 192)
    (_, got), = shard_weights([(name, w)], ARCH, TPPlan.build(ARCH, 1, 3), {name})
    assert isinstance(got, ColumnSlice) and (got.start, got.size) == (64, 64)
    assert got.full is w and torch.equal(got.part(), w[:, 64:128])


@pytest.fixture(scope="module")
def gguf_tp1() -> LLM:
    return LLM(quantization="gguf", num_kv_blocks=64, max_model_len=256, num_threads=1)


def test_bundled_gguf_tp3_keeps_the_compressed_blocks(gguf_tp1: LLM) -> None:
    """SmolLM2's Q4_1 / Q8_0 tensors sliced 3 ways (o_proj 192 and down_proj 512 input
    columns per rank: whole 32-blocks): TP = 1's greedy tokens, a third of the compressed
    bytes on rank 0 (the float norms whole)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Tensor parallelism splits"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref = [o.outputs[0].token_ids for o in gguf_tp1.generate(prompts, params)]
    llm = LLM(quantization="gguf", tensor_parallel_size=3, num_kv_blocks=64,
              max_model_len=256, num_threads=1)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    assert got == ref
    whole, mine = gguf_tp1.model_memory_bytes(), llm.model_memory_bytes()
    assert whole / 3 <= mine < whole / 3 * 1.01, (whole, mine)


@pytest.mark.parametrize("kind", ["w8a8", "fp8"])
def test_row_parallel_activation_scales_span_the_whole_row(kind: str) -> None:
    """A method that quantizes its input per token (w8a8; fp8 on FP8 tensor cores, run
    here as `scaled_mm` on the CPU) takes each token's range over every rank's columns
    (`input_amax`, the all-reduce max a rank's `share_input_ranges` installs): the ranks'
    partial outputs add up to TP = 1's output up to float rounding; each rank's own range
    (no `input_amax`) moves it by a quantization step."""
    method = (get_linear_method("fp8", device=CPU, mode="scaled_mm") if kind == "fp8"
              else _method(kind))
    n, k, world, rows = 24, 192, 3, 20  # 20 rows: w8a8's int8 GEMM (not weight-only)
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    x[:, 7] *= 30  # an outlier channel in rank 0's columns
    one = QuantLinear(method, k, n, False, torch.float32)
    method.load(one, 0, w)
    method.finish(one)
    ref = one(x)
    amax = x.abs().amax(1, keepdim=True)
    size = k // world
    sums = {}
    for shared in (True, False):
        total = torch.zeros_like(ref)
        for r in range(world):
            mine = QuantLinear(method, size, n, False, torch.float32)
            method.load(mine, 0, ColumnSlice(w, r * size, size))
            method.finish(mine)
            if shared:  # what the all-reduce max hands every rank
                mine.input_amax = lambda t: t.copy_(amax.view(t.shape))
            total += mine(x[:, r * size:(r + 1) * size])
        sums[shared] = (total - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert sums[True] < 1e-5 * scale < sums[False], (sums, scale)
