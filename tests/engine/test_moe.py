"""Mixture-of-experts MLP (engine/model/moe.py, engine/kernels/triton_moe.py): routing equal
to transformers' routers, the grouped execution against transformers' per-expert loop and
sparse MoE blocks, quantized experts against their dequantized weights, expert-parallel
shards summing to the whole layer, and the Triton kernels (TRITON_INTERPRET=1 on the CPU,
set by tests/conftest.py) against the torch path."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.model.moe import (
    FusedMoE,
    MoESpec,
    SkipWeight,
    expert_range,
    group_by_expert,
    loop_experts,
    route,
    unfuse_experts,
)
from tandem.engine.native import load_native
from tandem.engine.quant.base import QuantLinear, get_linear_method

CPU = torch.device("cpu")
E, K, H, I = 4, 2, 64, 32


def _filled(spec: MoESpec, seed: int, experts: range | None = None,
            dtype: torch.dtype = torch.float32) -> FusedMoE:
    torch.manual_seed(seed)
    m = FusedMoE(spec, experts=experts)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.to(dtype)


def _routing(t: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, K] float32 summing to 1, ids [t, K]) of one routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if kind == "all_to_one":  # every token's first choice is expert 2
        ids = torch.stack([torch.full((t,), 2), torch.randint(0, 2, (t,), generator=g)], 1)
    elif kind == "expert_3_idle":
        ids = torch.stack([torch.randperm(3, generator=g)[:K] for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    w = torch.rand(t, K, generator=g) + 0.1
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_transformers_routers(renormalize):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x, gate = torch.randn(9, H), torch.randn(8, H)
    if renormalize:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=8,
                                                 num_experts_per_tok=2))
    else:
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=H, num_experts=8,
                                                   num_experts_per_tok=2,
                                                   norm_topk_prob=False))
    router.weight.data.copy_(gate)
    _, want_w, want_ids = router(x)
    w, ids = route(x @ gate.T, 2, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w.float(), rtol=0, atol=0)
    assert w.dtype == torch.float32
    sums = w.sum(-1)
    assert torch.allclose(sums, torch.ones(9)) if renormalize else bool((sums < 1).all())


def test_group_by_expert_sorts_once_and_counts():
    ids = torch.tensor([[3, 0], [0, 1], [3, 1]])
    g = group_by_expert(ids, 5)
    assert g.counts == [2, 2, 0, 2, 0]
    assert g.order.tolist() == [1, 2, 3, 5, 0, 4]  # stable: tokens keep their order
    assert g.tokens.tolist() == [0, 1, 1, 2, 0, 2]


@pytest.mark.parametrize(("t", "kind"), [(7, "random"), (6, "expert_3_idle"),
                                         (5, "all_to_one"), (1, "random")])
def test_grouped_matches_per_expert_loop(t, kind):
    m = _filled(MoESpec(E, K, H, I), seed=t)
    x = torch.randn(t, H)
    w, ids = _routing(t, kind, seed=t)
    got = m.grouped(x, w, ids)
    want = loop_experts(x, m.w13.detach(), m.w2.detach(), w, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_transformers_sparse_block(family, dtype):
    """The whole layer (router + grouped experts), loaded through `weight_targets` from the
    transformers block's own fused expert tensors (`unfuse_experts`), against its output."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(3)
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I,
                                                    num_local_experts=E,
                                                    num_experts_per_tok=K))
        spec = MoESpec(E, K, H, I)
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                                      num_experts=E, num_experts_per_tok=K,
                                                      norm_topk_prob=False))
        spec = MoESpec(E, K, H, I, renormalize=False, weights_in_act_dtype=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    block = block.to(dtype)
    moe = FusedMoE(spec).to(dtype)
    targets = moe.weight_targets("l.mlp.")
    # transformers holds the experts fused: experts.gate_up_proj [E, 2I, H], down_proj
    loaded = dict(unfuse_experts((f"l.mlp.{n}", t) for n, t in block.state_dict().items()))
    assert sorted(loaded) == sorted(targets)
    with torch.no_grad():
        for name, t in loaded.items():
            targets[name].copy_(t)
    x = torch.randn(1, 11, H).to(dtype)
    want = block(x)[0]
    got = moe(x[0])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of difference at most, from the matmuls' blocking
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("name", "opts"), [("int8", {"group_size": None}),
                                            ("int4", {"group_size": 32}), ("fp8", {})])
def test_quantized_experts_match_dequantized_reference(name, opts):
    """Experts stored as `QuantLinear` pairs of a linear method compute exactly the loop
    over their dequantized weights (the method's kernels: native panels on the CPU)."""
    spec = MoESpec(E, K, H, I)
    ref = _filled(spec, seed=5)
    method = get_linear_method(name, device=CPU, native=load_native(), **opts)
    with torch.device("meta"):
        moe = FusedMoE(spec)
        moe.quantize(method, torch.float32)
    moe.to_empty(device=CPU)
    moe.gate.weight.data.copy_(ref.gate.weight)
    targets = moe.weight_targets("p.")
    for n, t in ref.weight_targets("p.").items():
        if n != "p.gate.weight":
            dst = targets[n]
            dst.layer.method.load(dst.layer, dst.start, t.detach())
    for layer in moe.modules():
        if isinstance(layer, QuantLinear):
            layer.method.finish(layer)
    w13, w2 = moe.dequantized()
    assert w13.shape == (E, 2 * I, H) and w2.shape == (E, H, I)
    assert not torch.equal(w13, ref.w13.detach())  # really quantized
    x = torch.randn(13, H)
    with torch.no_grad():
        w, ids = route(moe.gate(x), K, True)
        got = moe(x)
    torch.testing.assert_close(got, loop_experts(x, w13, w2, w, ids), rtol=1e-4, atol=1e-5)


def test_packed_experts_compute_the_float_layer():
    """`convert_experts` with the CPU's packed float panels (how the engine serves float32
    CPU models) keeps the layer's output; the stacked weights are gone."""
    from tandem.engine.quant.float_methods import PackedMethod

    moe = _filled(MoESpec(E, K, H, I), seed=9)
    x = torch.randn(6, H)
    with torch.no_grad():
        want = moe(x)
        moe.convert_experts(PackedMethod(device=CPU, native=load_native()))
        got = moe(x)
    assert moe.w13 is None and moe.experts[0].gate_up_proj.method.name == "packed"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_expert_parallel_shards_sum_to_the_layer():
    """Rank r of 2 holds experts [2r, 2r + 2): the two partial outputs (what the all-reduce
    sums) equal the whole layer; the other rank's experts load nothing."""
    spec = MoESpec(E, K, H, I)
    whole = _filled(spec, seed=7)
    x = torch.randn(9, H)
    parts = []
    for rank in range(2):
        shard = FusedMoE(spec, experts=expert_range(E, rank, 2))
        targets = shard.weight_targets("p.")
        skipped = {n for n, t in targets.items() if isinstance(t, SkipWeight)}
        assert len(skipped) == 2 * 3
        assert all(f".experts.{2 * (1 - rank)}." in n or f".experts.{3 - 2 * rank}." in n
                   for n in skipped)
        with torch.no_grad():
            for n, t in whole.weight_targets("p.").items():
                if n not in skipped:
                    targets[n].copy_(t)
            parts.append(shard(x))
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], whole(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="must divide the model's 4 experts"):
        expert_range(4, 0, 3)


def _triton():
    pytest.importorskip("triton")
    from tandem.engine.kernels import triton_unavailable_reason

    assert triton_unavailable_reason(CPU) is None
    from tandem.engine.kernels import triton_moe

    return triton_moe


def test_align_block_size_groups_assignments_in_blocks():
    tm = _triton()
    ids = torch.tensor([[3, 0], [0, 1], [3, 1], [4, 0]])  # 4 = skipped (another rank's)
    al = tm.align_block_size(ids, 4, 4)
    rows = al.sorted_ids.view(-1, 4).tolist()
    blocks = al.block_expert.tolist()
    pad = 8
    assert rows[:4] == [[1, 2, 7, pad], [3, 5, pad, pad], [0, 4, pad, pad], [6, pad, pad, pad]]
    assert blocks[:4] == [0, 1, 3, 4]
    assert all(b >= 4 for b in blocks[3:]) and all(r == [pad] * 4 for r in rows[4:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "kind"), [(7, "random"), (6, "expert_3_idle"),
                                         (5, "all_to_one"), (1, "random")])
def test_triton_fused_moe_matches_torch(t, kind, dtype):
    tm = _triton()
    m = _filled(MoESpec(E, K, H, I), seed=t, dtype=dtype)
    x = torch.randn(t, H).to(dtype)
    w, ids = _routing(t, kind, seed=t)
    with torch.no_grad():
        got = tm.fused_moe(x, m.w13, m.w2, w, ids)
        want = m.grouped(x, w, ids)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_triton_backend_layer_and_skipped_experts():
    """`backend="triton"` runs the whole layer through the kernels; with an expert-parallel
    shard the other rank's assignments contribute nothing."""
    _triton()
    spec = MoESpec(E, K, H, 48)  # I not a multiple of the column tile
    torch.manual_seed(11)
    x = torch.randn(10, H)
    for experts in (None, range(2, 4)):
        m = _filled(spec, seed=11, experts=experts)
        tri = FusedMoE(spec, experts=experts, backend="triton")
        tri.load_state_dict(m.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(tri(x), m(x), rtol=1e-5, atol=1e-5)
