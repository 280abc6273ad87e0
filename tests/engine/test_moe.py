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
    if t == 0:  # an empty step
        return torch.empty(0, K), torch.empty(0, K, dtype=torch.int64)
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
                                         (5, "all_to_one"), (1, "random"), (0, "random")])
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
    transformers block's own expert tensors (held fused in memory: [E, 2I, H] gate then up
    rows, [E, H, I] down), against its output."""
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
    state = block.state_dict()
    loaded = {"l.mlp.gate.weight": state["gate.weight"]}
    for e in range(E):
        gate_up, down = state["experts.gate_up_proj"][e], state["experts.down_proj"][e]
        loaded |= {f"l.mlp.experts.{e}.gate_proj.weight": gate_up[:I],
                   f"l.mlp.experts.{e}.up_proj.weight": gate_up[I:],
                   f"l.mlp.experts.{e}.down_proj.weight": down}
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


def _quantized(ref: FusedMoE, method, experts: range | None = None) -> FusedMoE:
    """A `FusedMoE` with `ref`'s router and its experts (those in `experts`) loaded into
    `QuantLinear` pairs of `method`, as the engine loads a checkpoint."""
    with torch.device("meta"):
        moe = FusedMoE(ref.spec, experts=experts)
        moe.quantize(method, torch.float32)
    moe.to_empty(device=CPU)
    moe.gate.weight.data.copy_(ref.gate.weight)
    targets = moe.weight_targets("p.")
    for n, t in ref.weight_targets("p.").items():
        dst = targets[n]
        if n != "p.gate.weight" and not isinstance(dst, SkipWeight):
            dst.layer.method.load(dst.layer, dst.start, t.detach())
    for layer in moe.modules():
        if isinstance(layer, QuantLinear):
            layer.method.finish(layer)
    return moe


@pytest.mark.parametrize(("name", "opts"), [("int8", {"group_size": None}),
                                            ("int4", {"group_size": 32}), ("fp8", {})])
def test_quantized_experts_match_dequantized_reference(name, opts):
    """Experts stored as `QuantLinear` pairs of a linear method compute exactly the loop
    over their dequantized weights (the method's kernels: native panels on the CPU)."""
    spec = MoESpec(E, K, H, I)
    ref = _filled(spec, seed=5)
    moe = _quantized(ref, get_linear_method(name, device=CPU, native=load_native(), **opts))
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


def test_quantized_expert_parallel_shards_hold_the_whole_layers_codes():
    """Under expert parallelism each rank quantizes its whole experts, so the ranks' int4
    partial sums add up to the unsharded quantized layer."""
    spec = MoESpec(E, K, H, I)
    ref = _filled(spec, seed=8)
    method = get_linear_method("int4", device=CPU, native=load_native(), group_size=32)
    whole = _quantized(ref, method)
    parts = [_quantized(ref, method, expert_range(E, r, 2)) for r in range(2)]
    x = torch.randn(7, H)
    with torch.no_grad():
        torch.testing.assert_close(parts[0](x) + parts[1](x), whole(x), rtol=1e-5,
                                   atol=1e-6)


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


# --- the MoE families in the engine (greedy / logprob parity with transformers, alone,
# preempted, prefix-cached and at TP = 2: tests/engine/test_architectures.py) ---

def _qwen3_moe_dir(path, **overrides):
    """A tiny Qwen3-MoE checkpoint (2 MoE layers of 4 experts, top-2) with the test
    tokenizer in `path`; returns the transformers model."""
    import transformers

    from tests.engine.utils import TINY_VOCAB, write_tiny_tokenizer

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        initializer_range=0.1, max_position_embeddings=128, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **overrides)
    torch.manual_seed(5)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(path)
    write_tiny_tokenizer(path, TINY_VOCAB)
    return model


def test_qwen3_moe_sparse_layers_follow_transformers_rule():
    from tandem.engine.model.qwen3_moe import parse_qwen3_moe, sparse_layers

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32)
    assert sparse_layers({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, 6) == (1, 5)
    cfg = parse_qwen3_moe({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert cfg.norm_topk_prob is False  # transformers' default for Qwen3-MoE
    every = parse_qwen3_moe({**base, "norm_topk_prob": True})
    assert every.moe_layers is None and every.num_experts == 8 and every.norm_topk_prob
    # transformers 5 writes num_experts as num_local_experts
    v5 = {k: v for k, v in base.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert parse_qwen3_moe(v5).num_experts == 8


def test_mixtral_checkpoint_names_become_the_standard_moe_names():
    from tandem.engine.model.mixtral import rename_experts

    p = "model.layers.3.block_sparse_moe."
    assert [x.name for x in rename_experts(None, p + "experts.5.w1.weight")] == [
        "model.layers.3.mlp.experts.5.gate_proj.weight"]
    assert [x.name for x in rename_experts(None, p + "experts.5.w3.weight")] == [
        "model.layers.3.mlp.experts.5.up_proj.weight"]
    assert [x.name for x in rename_experts(None, p + "experts.0.w2.weight")] == [
        "model.layers.3.mlp.experts.0.down_proj.weight"]
    assert [x.name for x in rename_experts(None, p + "gate.weight")] == [
        "model.layers.3.mlp.gate.weight"]
    assert rename_experts(None, "model.layers.3.self_attn.q_proj.weight") is None


def test_experts_must_split_evenly_across_tensor_parallel_ranks():
    import dataclasses

    from tandem.engine.model.qwen3_moe import parse_qwen3_moe
    from tandem.engine.parallel.tp import TPPlan, local_arch

    arch = parse_qwen3_moe(dict(vocab_size=64, hidden_size=96, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=6,
                                num_key_value_heads=3, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32))
    with pytest.raises(ConfigError, match="must divide the model's 4 experts"):
        TPPlan.build(arch, 0, 3)
    arch = dataclasses.replace(arch, num_heads=4, num_kv_heads=2, hidden_size=64)
    assert local_arch(arch, TPPlan.build(arch, 1, 2)).expert_shard == (2, 4)


def test_quantized_moe_model_serves_its_experts_quantized(tmp_path):
    """`--quantization int8` on a MoE checkpoint: every expert is an int8 `QuantLinear`
    pair (the router stays float), and the prompt logprobs stay near the float model's."""
    from tandem import LLM, SamplingParams

    model = _qwen3_moe_dir(tmp_path)
    ids = [5, 17, 33, 90, 12, 7, 8, 100, 4, 61, 22]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    want = [ref[i - 1, t].item() for i, t in enumerate(ids) if i]
    llm = LLM(str(tmp_path), dtype="float32", quantization="int8", num_threads=1)
    moe = llm.engine.model.layers[0].mlp
    assert isinstance(moe, FusedMoE) and moe.quantized
    assert {m.gate_up_proj.method.name for m in moe.experts} == {"int8"}
    assert llm.engine.model.cuda_graph_safe is False  # (on a GPU: decoded eagerly)
    assert not isinstance(moe.gate, QuantLinear) or moe.gate.method.name == "packed"
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = [d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    assert got == pytest.approx(want, abs=0.05)
    assert got != pytest.approx(want, abs=1e-5)  # (really quantized)


def test_lora_on_a_moe_model_adapts_attention_and_refuses_experts(tmp_path):
    """On a MoE base (layer 0 sparse, layer 1 dense) a PEFT adapter of the attention
    projections, and one of every projection of the dense layer, give transformers' greedy
    tokens on the merged weights; an adapter of the experts, the router or a sparse layer's
    MLP is refused naming what it adapts."""
    import json

    import transformers
    from safetensors.torch import save_file

    from tandem import LLM, LoRARequest, SamplingParams
    from tandem.engine.lora.peft import load_adapter
    from tandem.engine.model.hf_loader import config_from_hf
    from tests.engine.utils import LORA_TARGETS, make_peft_adapter, merge_adapter

    base = tmp_path / "base"
    _qwen3_moe_dir(base, mlp_only_layers=[1])
    base_cfg = json.loads((base / "config.json").read_text())
    prompts = [[5, 17, 33, 90, 12, 7, 8, 100, 4], [9, 9, 30, 41, 77]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4, num_threads=1)
    adapters = {"attn": dict(targets=("q_proj", "k_proj", "v_proj", "o_proj")),
                "dense": dict(targets=LORA_TARGETS, layers=[1])}
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, (name, kw) in enumerate(adapters.items()):
        adapter, merged = tmp_path / name, tmp_path / f"{name}-merged"
        weights = make_peft_adapter(adapter, base_cfg, rank=4, alpha=8.0, std=0.2, seed=i,
                                    **kw)
        merge_adapter(base, merged, weights, 8.0 / 4)
        ref = transformers.Qwen3MoeForCausalLM.from_pretrained(merged).eval()
        want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        got = llm.generate(prompts, params,
                           lora_request=LoRARequest(name, i + 1, str(adapter)))
        assert [o.outputs[0].token_ids for o in got] == want
        assert want != plain  # (the adapter changes the output)

    arch = config_from_hf(base)
    for module in ("mlp.experts.0.gate_proj", "mlp.gate", "mlp.gate_proj"):
        bad = tmp_path / module.replace(".", "_")
        bad.mkdir()
        key = f"base_model.model.model.layers.0.{module}"
        save_file({f"{key}.lora_A.weight": torch.zeros(4, 64),
                   f"{key}.lora_B.weight": torch.zeros(64, 4)},
                  str(bad / "adapter_model.safetensors"))
        (bad / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
             "target_modules": [module.rsplit(".", 1)[-1]]}))
        with pytest.raises(ConfigError, match="adapts a mixture-of-experts MLP"):
            load_adapter(bad, "bad", 2, arch, max_rank=4)


def test_cuda_graphs_stay_off_for_moe_layers_that_sync_with_the_host():
    """Only float experts on the Triton kernels are capturable; a model with quantized
    (grouped, host-synchronising) experts decodes eagerly instead of failing its capture."""
    from types import SimpleNamespace

    from tandem.engine.cuda_graphs import build_decode_graphs

    spec = MoESpec(E, K, H, I)
    assert FusedMoE(spec, backend="triton").capturable
    assert not FusedMoE(spec).capturable  # the torch path reads each expert's count
    quantized = FusedMoE(spec, backend="triton")
    with torch.device("meta"):
        quantized.quantize(get_linear_method("int8", device=CPU, group_size=None),
                           torch.float32)
    assert not quantized.capturable
    config = SimpleNamespace(enforce_eager=False, cuda_graph_sizes=[1], max_num_seqs=1)
    model = SimpleNamespace(cuda_graph_safe=False)
    backend = SimpleNamespace(supports_cuda_graphs=True, name="triton")
    assert build_decode_graphs(config, model, backend, [], 64, torch.device("cuda")) is None


def test_triton_engine_runs_moe_layers_through_the_fused_kernels(tmp_path):
    """With the Triton attention backend (under the interpreter here, as on a GPU) the MoE
    layers run `fused_moe` and the engine's greedy tokens are transformers'."""
    pytest.importorskip("triton")
    from tandem import LLM, SamplingParams

    model = _qwen3_moe_dir(tmp_path)
    prompt = [5, 17, 33, 90, 12, 7, 8, 100, 4]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(tmp_path), dtype="float32", attention_backend="triton", cpu_linear="torch",
              num_kv_blocks=16, enforce_eager=True, num_threads=1)
    moe = llm.engine.model.layers[0].mlp
    assert moe.backend == "triton" and moe.capturable and llm.engine.model.cuda_graph_safe
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0,
                                                ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want


def test_gptq_moe_checkpoint_serves_its_experts_codes(tmp_path):
    """A Qwen3-MoE checkpoint in AutoGPTQ's 4-bit layout (every attention and expert linear;
    the router float, as GPTQ MoE checkpoints keep it) loads its codes onto int4 experts and
    generates the tokens, and prompt logprobs, of a float checkpoint of the dequantized
    weights."""
    import json

    from safetensors.torch import load_file, save_file

    from tandem import LLM, SamplingParams
    from tests.engine.test_prequantized import gptq_pack, int_linear

    model = _qwen3_moe_dir(tmp_path / "float")
    gen = torch.Generator().manual_seed(1)
    state = load_file(str(tmp_path / "float" / "model.safetensors"))
    quant, floats = {}, {}
    for name, t in state.items():
        if name.endswith("proj.weight"):  # q/k/v/o and the experts' gate/up/down
            prefix = name.removesuffix(".weight")
            lin = int_linear(gen, t.shape[0], t.shape[1], 32, 4, sym=True)
            qweight, qzeros = gptq_pack(lin.q.T.contiguous(), lin.z.T.contiguous(), 4)
            quant.update({prefix + ".qweight": qweight, prefix + ".qzeros": qzeros,
                          prefix + ".scales": lin.s.T.contiguous(),
                          prefix + ".g_idx": lin.g_idx.to(torch.int32)})
            floats[name] = lin.dequant()
        else:
            quant[name] = floats[name] = t
    assert any(".mlp.experts.3.down_proj.qweight" in n for n in quant)
    cfg = json.loads((tmp_path / "float" / "config.json").read_text())
    for sub, tensors, qc in (("q", quant, {"quant_method": "gptq", "bits": 4,
                                           "group_size": 32, "desc_act": False, "sym": True}),
                             ("f", floats, None)):
        d = tmp_path / sub
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg | ({"quantization_config": qc}
                                                         if qc else {})))
        for f in (tmp_path / "float").glob("tok*"):
            (d / f.name).write_bytes(f.read_bytes())
    del model
    prompts = [[5, 17, 33, 90, 12, 7, 8, 100, 4], [9, 9, 30, 41, 77, 3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    got, want = (LLM(str(tmp_path / s), dtype="float32", num_threads=1) for s in "qf")
    moe = got.engine.model.layers[1].mlp
    assert {m.down_proj.method.name for m in moe.experts} == {"int4"}
    for g, w in zip(got.generate(prompts, params), want.generate(prompts, params),
                    strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)
