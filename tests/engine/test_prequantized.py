"""Pre-quantized checkpoints (GPTQ, AWQ, FP8, compressed-tensors) written here in each
format's documented layout (packed by the reference packers' rules: AutoGPTQ's
`QuantLinear.pack`, AutoAWQ's `WQLinear_GEMM.from_linear`, compressed-tensors'
`pack_to_int32`), from random codes, zero points and scales, on a tiny Llama: they load
without a float round trip (each layer computes with exactly the format's dequantization,
w = (q - z) * s, up to a zero point's product rounded once to float16) and generate what
the engine generates from a float checkpoint of those dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.llm import LLM
from tandem.engine.model.loader import open_model
from tandem.engine.model_build import build_shard
from tandem.engine.parallel.tp import TPPlan, shard_weights
from tandem.engine.quant.apply import plan_quantization, row_scaled_weights
from tandem.engine.quant.base import QuantLinear
from tandem.engine.quant.checkpoint import resolve_quantization
from tandem.engine.sampling_params import SamplingParams
from tests.engine.prequant_ckpt import (
    FLOAT_LINEAR,
    FORMATS,
    FUSED,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    SHAPES,
    act_order_g_idx,
    gptq_pack,
    int_linear,
    write_checkpoint,
)
from tests.engine.utils import TINY_VOCAB, write_tiny_tokenizer

CPU = torch.device("cpu")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(config dict, the float tensors that stay float, the tokenizer's directory)."""
    import transformers

    tok = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(tok, TINY_VOCAB)
    cfg = transformers.LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    keep = {n: t.detach().float().contiguous() for n, t in model.state_dict().items()
            if not any(n.endswith(f"{lin}.weight") for lin in SHAPES) and n != "lm_head.weight"}
    with torch.no_grad():
        for n, t in keep.items():
            if n.endswith("norm.weight"):
                t.uniform_(0.8, 1.2)
    return cfg.to_dict(), keep, tok


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, base):
    """Each format's (quantized dir, float reference dir, reference weights), made once."""
    made: dict[str, tuple[Path, Path, dict]] = {}

    def get(fmt: str) -> tuple[Path, Path, dict]:
        if fmt not in made:
            made[fmt] = FORMATS[fmt](tmp_path_factory.mktemp(fmt), base)
        return made[fmt]

    return get


EXACT = {"gptq4-sym", "gptq4-act-order", "gptq8-per-channel", "ct-int4-act-order",
         "fp8-tensor", "fp8-channel", "ct-fp8-channel", "fp8-block", "ct-fp8-block"}


def _method(fmt: str) -> str:
    return "fp8" if "fp8" in fmt else "int8" if "gptq8" in fmt else "int4"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_layer_computes_with_the_formats_dequantization(checkpoints, fmt):
    """Every quantized layer holds the format's codes as they are: its dequantized weight is
    w = (q - z) * s bit for bit (symmetric and FP8 formats) or up to the zero point's z * s
    rounded once to float16 (asymmetric), and its output is x @ w.T; the ignored layer
    stays float."""
    qdir, _, ref = checkpoints(fmt)
    cfg = EngineConfig(model=str(qdir), device="cpu", dtype="float32")
    model = build_shard(cfg, qdir, CPU, torch.float32).model
    x = torch.randn(3, INTER, generator=torch.Generator().manual_seed(1))
    for i in range(LAYERS):
        for fused, parts in FUSED.items():
            layer = model.get_submodule(f"layers.{i}.{fused}")
            want = torch.cat([ref[f"model.layers.{i}.{p}"] for p in parts])
            if f"model.layers.{i}.{parts[0]}" == FLOAT_LINEAR:  # float (CPU-packed)
                assert not isinstance(layer, QuantLinear) or layer.method.name == "packed"
                got = (layer.method.dequantize(layer) if isinstance(layer, QuantLinear)
                       else layer.weight)
                assert torch.equal(got, want)
                continue
            assert isinstance(layer, QuantLinear), (fmt, i, fused)
            assert layer.method.name == _method(fmt)
            assert getattr(layer.method, "act_order", False) == ("act-order" in fmt)
            got = layer.method.dequantize(layer)
            if fmt in EXACT:
                assert torch.equal(got, want), (fmt, i, fused)
            else:  # |z * s| <= 15 * 0.024, rounded to float16: within 2^-11 of it
                assert (got - want).abs().max() <= 15 * 0.024 * 2**-11, (fmt, i, fused)
                assert (got - want).abs().max() > 0  # (the mins are rounded)
            xi = x[:, :layer.in_features]
            torch.testing.assert_close(layer(xi), xi @ got.T, rtol=1e-4, atol=1e-4)


E2E = ["gptq4-asym", "gptq4-act-order", "awq", "ct-fp8-channel", "fp8-block"]


@pytest.mark.parametrize("fmt", E2E)
def test_greedy_tokens_and_prompt_logprobs_match_the_float_checkpoint(checkpoints, fmt):
    """The engine on the quantized checkpoint (its method detected from
    quantization_config) generates the float checkpoint's greedy tokens, its prompt
    logprobs within float rounding, in one batch; a prompt sharing a cached prefix
    (prefix hits) generates the same tokens again."""
    qdir, fdir, _ = checkpoints(fmt)
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, TINY_VOCAB, (32,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()
               for n in (5, 11)] + [torch.randint(3, TINY_VOCAB, (20,), generator=gen).tolist()]
    params = SamplingParams(max_tokens=8, prompt_logprobs=1, **GREEDY)

    def run(path: Path):
        llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                  max_model_len=256)
        scored = llm.generate(prompts, params)
        again = llm.generate(prompts[1], SamplingParams(max_tokens=8, **GREEDY))[0]
        return llm, scored, again

    qllm, got, again = run(qdir)
    _, ref, _ = run(fdir)
    # exact formats: float32 rounding; asymmetric ones: each min z * s rounded to float16
    tol = 1e-4 if fmt in EXACT else 5e-3
    assert qllm.engine.config.quantization == (  # detected: reported by /ready
        "compressed-tensors" if fmt.startswith("ct") else fmt[:4] if fmt[:4] in ("gptq", "awq")
        else "fp8")
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert set(a) == set(b)
            assert all(a[t] == pytest.approx(b[t], abs=tol) for t in a)
    assert again.num_cached_tokens == 32  # the shared prefix's two blocks
    assert again.outputs[0].token_ids == ref[1].outputs[0].token_ids


def _build(path: Path, **engine_args):
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", **engine_args)
    return build_shard(cfg, path, CPU, torch.float32).model


def test_the_flag_may_name_the_checkpoints_method_or_a_vllm_alias(checkpoints):
    """--quantization gptq / gptq_marlin on a GPTQ checkpoint, fp8 on an FP8 one: its own
    codes, exactly (fp8 does not re-quantize them)."""
    assert EngineConfig(quantization="gptq_marlin").quantization == "gptq"
    assert EngineConfig(quantization="awq_marlin").quantization == "awq"
    qdir, _, ref = checkpoints("gptq4-sym")
    want = torch.cat([ref[f"model.layers.0.{p}"] for p in FUSED["self_attn.qkv_proj"]])
    for flag in ("gptq", "gptq_marlin"):
        layer = _build(qdir, quantization=flag).layers[0].self_attn.qkv_proj
        assert torch.equal(layer.method.dequantize(layer), want)
    qdir, _, ref = checkpoints("fp8-channel")
    layer = _build(qdir, quantization="fp8").layers[0].mlp.down_proj
    assert torch.equal(layer.method.dequantize(layer), ref["model.layers.0.mlp.down_proj"])


def test_a_conflicting_flag_and_a_checkpoint_method_for_float_weights_are_errors(checkpoints):
    qdir, fdir, _ = checkpoints("gptq4-sym")
    with pytest.raises(ConfigError, match=rf"^{qdir} is a gptq checkpoint \(quantization_config"
                                          r"\), but quantization 'int8' was asked; leave "
                                          r"--quantization unset or pass gptq$"):
        _build(qdir, quantization="int8")
    with pytest.raises(ConfigError, match=r"but quantization 'awq' was asked"):
        _build(qdir, quantization="awq_marlin")
    with pytest.raises(ConfigError, match=rf"^quantization 'gptq' serves a gptq checkpoint, but "
                                          rf"{fdir} has no quantization_config \(its weights are "
                                          r"float\); use int8, int4 or fp8"):
        _build(fdir, quantization="gptq")
    ct, _, _ = checkpoints("ct-fp8-channel")
    with pytest.raises(ConfigError, match=r"is a compressed-tensors checkpoint"):
        _build(ct, quantization="fp8")
    assert resolve_quantization("fp8", None, "m") == "fp8"  # float weights: on the fly


def _rewrite(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of checkpoint `src` with its quantization_config updated by `config` and the
    tensors in `tensors` replaced (by name, in whichever shard holds them)."""
    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        data = load_file(str(f))
        hit = {n: t for n, t in (tensors or {}).items() if n in data}
        if hit:
            save_file({**data, **hit}, str(f))
    return dst


@pytest.mark.parametrize(("fmt", "config", "tensors", "message"), [
    ("gptq4-asym", {"bits": 3}, None, "GPTQ with 3-bit weights is not supported (4 and 8 are)"),
    ("awq", {"version": "gemv"}, None, "AWQ version 'gemv' is not supported"),
    ("fp8-channel", {"weight_block_size": [128, 128]}, None,
     "model.layers.0.mlp.gate_proj.weight_scale is [256, 1] F32, the layout needs [2, 1] "
     "F16/BF16/F32 (a fp8 checkpoint, 8-bit, blocks of 128x128)"),
    ("fp8-block", {"weight_block_size": [128]}, None,
     "weight_block_size must be two positive integers [rows, columns], got [128]"),
    ("fp8-block", {"weight_block_size": None}, None,
     "weight_scale_inv is a block-wise FP8 scale, but quantization_config names no block "
     "(weight_block_size)"),
    ("fp8-block", None, {"model.layers.0.self_attn.q_proj.weight_scale_inv":
                         torch.ones(2, 2)},
     "model.layers.0.self_attn.q_proj.weight_scale_inv is [2, 2] F32, the layout needs "
     "[3, 2] F16/BF16/F32 (a fp8 checkpoint, 8-bit, blocks of 48x96)"),
    ("ct-int4-asym", {"format": "int-quantized"}, None,
     "compressed-tensors format 'int-quantized' with no activation quantization is not "
     "supported"),
    ("gptq4-asym", {"quant_method": "bitsandbytes"}, None,
     "quant_method 'bitsandbytes' is not supported; supported: gptq, awq, fp8, "
     "compressed-tensors"),
    ("gptq4-asym", None, {"model.layers.0.self_attn.q_proj.scales":
                          torch.ones(3, HIDDEN, dtype=torch.float16)},
     r"model.layers.0.self_attn.q_proj.scales is [3, 128] F16, the layout needs [4, 128] "
     "F16/BF16/F32 (a gptq checkpoint, 4-bit, group_size 32)"),
    ("awq", None, {"model.layers.1.mlp.up_proj.qzeros": torch.zeros(8, 32, dtype=torch.int32)},
     "model.layers.1.mlp.up_proj.qzeros is [8, 32] I32, the layout needs [4, 32] I32"),
    ("ct-int4-act-order", None, {"model.layers.0.mlp.gate_proj.weight_g_idx":
                                 torch.zeros(HIDDEN, dtype=torch.int32)},
     "model.layers.0.mlp.gate_proj: g_idx does not assign 64 input columns to each group"),
])
def test_a_bad_checkpoint_is_a_clear_error(checkpoints, tmp_path, fmt, config, tensors,
                                           message):
    qdir, _, _ = checkpoints(fmt)
    bad = _rewrite(qdir, tmp_path / "bad", config, tensors)
    with pytest.raises(ConfigError) as e:
        _build(bad)
    assert message in str(e.value)


@pytest.mark.parametrize("fmt", ["gptq4-asym", "fp8-channel", "ct-fp8-block"])
def test_tensor_parallel_ranks_hold_slices_of_the_checkpoints_codes(checkpoints, fmt):
    """At tensor_parallel_size 2 each rank's q rows and o_proj columns (whole groups; FP8
    rows keep their scales, block-wise FP8 its blocks' scales) dequantize to exactly its
    slice of the unsharded layer."""
    qdir, _, _ = checkpoints(fmt)
    src = open_model(qdir, torch.float32)
    items = list(src.tensors(progress=False))
    plan = plan_quantization(None, src.config, src.formats, CPU, None, None, str(qdir))
    whole_rows = row_scaled_weights(plan, src.config)
    d = src.config.head_dim
    for name, path, rows in (("model.layers.0.self_attn.o_proj.weight",
                              "layers.0.self_attn.o_proj", False),
                             ("model.layers.0.self_attn.q_proj.weight",
                              "layers.0.self_attn.qkv_proj", True)):
        method = plan.methods[path]
        weight = dict(items)[name]

        def dequant(w, method=method):
            n, k = w.shape
            layer = QuantLinear(method, k, n, False, torch.float32)
            method.load(layer, 0, w)
            method.finish(layer)
            return method.dequantize(layer)

        full = dequant(weight)
        for rank in range(2):
            tp = TPPlan.build(src.config, rank, 2)
            (_, part), = shard_weights([(name, weight)], src.config, tp, whole_rows)
            span = slice(tp.q_head_start * d, (tp.q_head_start + tp.num_heads) * d)
            want = full[span] if rows else full[:, span]
            assert torch.equal(dequant(part), want), (fmt, name, rank)


def test_blockwise_fp8_columns_that_split_a_block_are_refused_under_tp(checkpoints):
    """96-column FP8 blocks: each of 2 ranks holds 64 of o_proj's 128 input columns, which
    cuts a block; a clear error naming the layer and the block width."""
    qdir, _, _ = checkpoints("fp8-block")
    src = open_model(qdir, torch.float32)
    plan = plan_quantization(None, src.config, src.formats, CPU, None, None, str(qdir))
    name = "model.layers.0.self_attn.o_proj.weight"
    weight = dict(src.tensors(progress=False))[name]
    with pytest.raises(ConfigError, match=rf"^tensor_parallel_size 2: {name} keeps 96-column "
                                          r"blocks, but each rank holds 64 of its 128 input "
                                          r"columns \(rank 1 from column 64\)"):
        list(shard_weights([(name, weight)], src.config, TPPlan.build(src.config, 1, 2),
                           row_scaled_weights(plan, src.config)))


def test_act_order_row_parallel_layers_are_refused_under_tensor_parallelism(checkpoints):
    qdir, _, _ = checkpoints("gptq4-act-order")
    src = open_model(qdir, torch.float32)
    name = "model.layers.0.self_attn.o_proj.weight"
    weight = dict(src.tensors(progress=False))[name]
    with pytest.raises(ConfigError, match=rf"^tensor_parallel_size 2: {name} is an act-order "
                                          r"\(desc_act / g_idx\) weight"):
        list(shard_weights([(name, weight)], src.config, TPPlan.build(src.config, 1, 2)))


def test_preempted_requests_of_a_quantized_checkpoint_generate_the_same_tokens(checkpoints):
    """Under KV pressure (preemption and recompute, chunked prefill) an act-order GPTQ
    checkpoint generates what it generates unpressured."""
    qdir, _, _ = checkpoints("gptq4-act-order")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (40, 44, 48)]
    params = SamplingParams(max_tokens=12, **GREEDY)

    def run(**engine_args):
        llm = LLM(str(qdir), device="cpu", dtype="float32", block_size=4, **engine_args)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    _, ref = run(num_kv_blocks=128)
    llm, got = run(num_kv_blocks=32, max_num_batched_tokens=24)
    assert llm.engine.stats().num_preemptions > 0
    assert got == ref


def test_a_phi3_gptq_checkpoints_fused_layers_split_into_their_parts(tmp_path, base):
    """Phi-3 stores qkv_proj and gate_up_proj fused: an act-order GPTQ checkpoint's fused
    codes are split into q / k / v and gate / up rows (one g_idx each), exactly."""
    import transformers

    cfg = transformers.Phi3Config(
        vocab_size=TINY_VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(5)
    model = transformers.Phi3ForCausalLM(cfg).eval()
    fused = {"self_attn.qkv_proj": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
             "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_up_proj": (2 * INTER, HIDDEN),
             "mlp.down_proj": (HIDDEN, INTER)}
    keep = {n: t.detach().float().contiguous() for n, t in model.state_dict().items()
            if not any(n.endswith(f"{m}.weight") for m in fused)}
    gen = torch.Generator().manual_seed(2)
    qt, ref = {}, {}
    for module, (n, k) in fused.items():
        prefix = f"model.layers.0.{module}"
        lin = int_linear(gen, n, k, 32, 4, True, act_order_g_idx(gen, k, 32))
        ref[module] = lin.dequant()
        qweight, qzeros = gptq_pack(lin.q.T.contiguous(), lin.z.T.contiguous(), 4)
        qt.update({prefix + ".qweight": qweight, prefix + ".qzeros": qzeros,
                   prefix + ".scales": lin.s.T.contiguous(),
                   prefix + ".g_idx": lin.g_idx.to(torch.int32)})
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
    qdir = write_checkpoint(tmp_path / "phi3", (cfg.to_dict(), keep, base[2]), qt, qc)
    built = _build(qdir)
    for module in fused:  # the engine's fused modules hold the parts in checkpoint order
        layer = built.get_submodule(f"layers.0.{module}")
        assert layer.method.name == "int4" and layer.method.act_order
        assert torch.equal(layer.method.dequantize(layer), ref[module]), module


def _hf_tensors(model) -> dict[str, torch.Tensor]:
    """A transformers model's tensors under checkpoint names: fused MoE expert stacks
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as each expert's gate / up / down."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_a_blockwise_fp8_qwen3_checkpoint_matches_its_dequantized_weights(tmp_path, base,
                                                                          arch):
    """A Qwen3 (q/k norms, head_dim 24 apart from hidden / heads) and a Qwen3-MoE (its
    experts block-wise too, the router float) stored as their -FP8 releases are (128 x 128
    blocks, `weight_scale_inv`; here 32 x 64 so that blocks are partial): the engine's
    greedy tokens and prompt logprobs equal the float checkpoint's of the dequantized
    weights, and each layer holds the checkpoint's codes exactly."""
    import transformers

    from tests.engine.prequant_ckpt import E4M3_MAX

    shape = dict(vocab_size=TINY_VOCAB, hidden_size=80, intermediate_size=144,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=24, max_position_embeddings=256, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2)
    torch.manual_seed(9)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**shape)
        model = transformers.Qwen3ForCausalLM(cfg).eval()
    else:
        cfg = transformers.Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=48, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    bn, bk = 32, 64
    keep, qt, ft = {}, {}, {}
    for name, t in _hf_tensors(model).items():
        if name.startswith("model.layers.") and t.dim() == 2 and ".mlp.gate." not in name:
            n, k = t.shape
            blocks = torch.nn.functional.pad(t, (0, -k % bk, 0, -n % bn))
            blocks = blocks.view(-(-n // bn), bn, -1, bk)
            scale = blocks.abs().amax((1, 3)) / E4M3_MAX
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            codes = (t / full).to(torch.float8_e4m3fn)
            qt[name], qt[name.removesuffix("weight") + "weight_scale_inv"] = codes, scale
            ft[name] = (codes.double() * full.double()).float()
        elif name != "lm_head.weight":
            keep[name] = t
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": [bn, bk]}
    base_q = (cfg.to_dict(), keep, base[2])
    qdir = write_checkpoint(tmp_path / "qwen3-fp8", base_q, qt, qc)
    fdir = write_checkpoint(tmp_path / "qwen3-float", base_q, ft, None)
    built = _build(qdir)
    layer = built.layers[1].self_attn.qkv_proj
    assert layer.method.name == "fp8" and layer.method.block_k == bk
    want = torch.cat([ft[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.method.dequantize(layer), want)
    if arch == "qwen3-moe":
        w13, w2 = built.layers[0].mlp.dequantized()
        assert torch.equal(w2[3], ft["model.layers.0.mlp.experts.3.down_proj.weight"])
        assert torch.equal(w13[1], torch.cat([ft[f"model.layers.0.mlp.experts.1.{p}.weight"]
                                              for p in ("gate_proj", "up_proj")]))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (9, 23)]
    params = SamplingParams(max_tokens=6, prompt_logprobs=1, **GREEDY)
    got, ref = (LLM(str(d), device="cpu", dtype="float32", num_kv_blocks=32,
                    max_model_len=128).generate(prompts, params) for d in (qdir, fdir))
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert set(a) == set(b)
            assert all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)


def test_a_float_model_takes_a_checkpoints_codes_dequantized(checkpoints):
    """A float layer handed a checkpoint's FP8 or GPTQ codes (a layer no method holds)
    gets their dequantized weight."""
    for fmt in ("fp8-channel", "gptq4-sym"):
        qdir, fdir, ref = checkpoints(fmt)
        model = _build(fdir, cpu_linear="torch")
        model.load_weights(open_model(qdir, torch.float32).tensors(progress=False))
        qkv = model.layers[1].self_attn.qkv_proj.weight
        want = torch.cat([ref[f"model.layers.1.{p}"] for p in FUSED["self_attn.qkv_proj"]])
        assert torch.equal(qkv, want), fmt


def test_load_model_dequantizes_a_checkpoint_for_export(checkpoints, tmp_path):
    """`load_model` (tandem convert's reader) gives a pre-quantized checkpoint's weights
    dequantized, so `export_hf` writes the float checkpoint."""
    from tandem.engine.model.loader import export_hf, load_model

    qdir, _, ref = checkpoints("gptq4-act-order")
    loaded = load_model(qdir)
    assert all(isinstance(t, torch.Tensor) for t in loaded.weights.values())
    for prefix, w in ref.items():
        assert torch.equal(loaded.weights[prefix + ".weight"], w), prefix
    export_hf(loaded, tmp_path / "float")
    assert "quantization_config" not in json.loads((tmp_path / "float/config.json").read_text())


def test_the_worker_takes_vllms_quantization_names(capsys):
    """`tandem worker --quantization awq` (and gptq, compressed-tensors, the *_marlin
    aliases) parse into the engine's config; an unknown name is argparse's usage error."""
    import argparse

    from tandem.serving.worker import add_engine_args, engine_config

    parser = argparse.ArgumentParser(prog="tandem worker")
    add_engine_args(parser)
    for name, want in (("awq", "awq"), ("gptq", "gptq"), ("compressed-tensors",
                                                          "compressed-tensors"),
                       ("gptq_marlin", "gptq"), ("awq_marlin", "awq"), ("fp8", "fp8")):
        assert engine_config(parser.parse_args(["--quantization", name])).quantization == want
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--quantization", "bitsandbytes"])
    assert e.value.code == 2
    assert "argument --quantization/-q: invalid choice: 'bitsandbytes'" in capsys.readouterr().err
