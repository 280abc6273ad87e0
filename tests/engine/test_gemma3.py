"""Gemma 3 text beyond the shared architecture tests (test_architectures.py): its config.json
read as transformers reads it in each form checkpoints use, the optional logit soft cap, and
the text model of a multimodal checkpoint, against transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tandem import LLM
from tandem.engine.errors import ConfigError
from tandem.engine.model.gemma3 import parse_gemma3
from tandem.engine.model.rope import inv_freq
from tests.engine.test_architectures import (
    BLOCK,
    SHAPE,
    _check_prompt_logprobs,
    _params,
    _prompts,
    _reference,
)
from tests.engine.utils import TINY_VOCAB, write_tiny_tokenizer

BASE = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=512,
            hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=1024, sliding_window=16)
SLIDING, FULL = "sliding_attention", "full_attention"
FORMS = {
    # hub checkpoints: every 3rd layer global, local RoPE base, scaling on the global layers
    "legacy": dict(rope_theta=500000.0, rope_local_base_freq=5000.0, sliding_window_pattern=3,
                   rope_scaling={"rope_type": "linear", "factor": 8.0},
                   query_pre_attn_scalar=48),
    # transformers 5: layer_types and rope_parameters per layer type
    "nested": dict(layer_types=[SLIDING, FULL] * 4, query_pre_attn_scalar=256,
                   rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 7000.0},
                                    FULL: {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 256,
                                           "rope_theta": 1e6}}),
    # the defaults: sliding_window_pattern 6, thetas 1e6 / 1e4, no scaling
    "defaults": dict(),
    "all-global": dict(layer_types=[FULL] * 8),
    "all-sliding": dict(layer_types=[SLIDING] * 8),
}


def _hf_rope(hf: transformers.Gemma3TextConfig, kind: str) -> tuple[torch.Tensor, float]:
    """transformers' (inverse frequencies, attention factor) of layer kind `kind`."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rope = Gemma3RotaryEmbedding(hf)
    return getattr(rope, f"{kind}_inv_freq"), getattr(rope, f"{kind}_attention_scaling")


@pytest.mark.parametrize("form", list(FORMS))
def test_config_reads_as_transformers_does(form: str) -> None:
    raw = {**BASE, **FORMS[form]}
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items()
                                          if k not in ("architectures", "model_type")})
    arch = parse_gemma3(raw)
    assert arch.architecture == "gemma3"
    windows = [hf.sliding_window if kind == SLIDING else None for kind in hf.layer_types]
    assert list(arch.layer_windows) == windows
    assert arch.softmax_scale == hf.query_pre_attn_scalar ** -0.5
    assert arch.embedding_multiplier == hf.hidden_size ** 0.5
    assert (arch.tie_word_embeddings, arch.hidden_act, arch.rms_norm_eps) == (
        True, "gelu_pytorch_tanh", hf.rms_norm_eps)
    assert arch.qk_norm and arch.norm_unit_offset and arch.sandwich_norms
    assert arch.attn_logit_softcap is None and arch.final_logit_softcap is None
    for i, kind in enumerate(hf.layer_types):  # each layer rotates with its kind's RoPE
        local = arch.uses_local_rope(i)
        assert local == (kind == SLIDING)
        theta, scaling = ((arch.local_rope_theta, arch.local_rope_scaling) if local
                          else (arch.rope_theta, arch.rope_scaling))
        ours, factor = inv_freq(arch.rotary_dim, theta, scaling, arch.max_position_embeddings)
        ref, ref_factor = _hf_rope(hf, kind)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
        assert factor == pytest.approx(ref_factor, rel=1e-12)


def test_sparse_multimodal_config_reads_as_transformers_does() -> None:
    """gemma-3-4b-it's config.json: a text_config of five fields over transformers'
    defaults, eos ids at the top level."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "eos_token_id": [1, 106], "text_config": text}
    hf = transformers.Gemma3Config(text_config=text).text_config
    arch = parse_gemma3(raw)
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers,
            arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings,
            arch.rms_norm_eps) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
        hf.max_position_embeddings, hf.rms_norm_eps)
    assert list(arch.layer_windows) == [1024 if k == SLIDING else None for k in hf.layer_types]
    assert arch.softmax_scale == hf.query_pre_attn_scalar ** -0.5
    assert (arch.rope_theta, arch.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (arch.local_rope_theta, arch.local_rope_scaling) == (1e4, None)
    assert arch.tie_word_embeddings and arch.eos_token_ids == (1, 106)


def test_config_refusals() -> None:
    with pytest.raises(ConfigError, match="bidirectional attention"):
        parse_gemma3({**BASE, "use_bidirectional_attention": True})
    with pytest.raises(ConfigError, match="need a sliding_window"):
        parse_gemma3({**BASE, "sliding_window": None})
    with pytest.raises(ConfigError, match="soft caps must be positive"):
        parse_gemma3({**BASE, "final_logit_softcapping": 0})


def test_final_logit_soft_cap_matches_transformers(tmp_path, caplog) -> None:
    """final_logit_softcapping (None in Gemma 3's own configs) set small enough to bend
    every logit caps them as transformers does; attn_logit_softcapping is ignored as
    transformers' (and vLLM's) Gemma 3 ignores it, so the native attention kernels serve."""
    torch.manual_seed(5)
    cfg = transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3}, head_dim=16, max_position_embeddings=128,
        sliding_window=5, layer_types=[SLIDING, FULL, SLIDING], pad_token_id=0,
        attn_logit_softcapping=0.5, final_logit_softcapping=3.0, attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, TINY_VOCAB)
    prompts = _prompts(3)
    greedy, logprobs = _reference(model, prompts)
    with caplog.at_level("WARNING", logger="tandem.engine.model.gemma3"):
        llm = LLM(str(tmp_path), dtype="float32", block_size=BLOCK, num_kv_blocks=64,
                  num_threads=1)
    assert "attn_logit_softcapping 0.5 is ignored" in caplog.text
    assert llm.engine.model.config.final_logit_softcap == 3.0
    assert {layer.self_attn.backend.spec.logit_softcap
            for layer in llm.engine.model.layers} == {None}
    outs = llm.generate(prompts, _params(prompt_logprobs=True))
    assert [o.outputs[0].token_ids for o in outs] == greedy
    for out, ids, ref in zip(outs, prompts, logprobs, strict=True):
        _check_prompt_logprobs(out, ids, ref)


def test_multimodal_checkpoint_serves_its_language_model(tmp_path) -> None:
    """A `Gemma3ForConditionalGeneration` checkpoint (language model under
    `language_model.model.*`, a SigLIP vision tower, a projector; top-level eos ids) serves
    text as transformers' multimodal model does on text alone; the vision tensors are
    skipped."""
    from safetensors import safe_open

    torch.manual_seed(9)
    text = transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3}, head_dim=16, max_position_embeddings=128,
        sliding_window=5, layer_types=[SLIDING, FULL, SLIDING], pad_token_id=0,
        query_pre_attn_scalar=12)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                    mm_tokens_per_image=4, image_token_index=TINY_VOCAB - 1,
                                    boi_token_index=TINY_VOCAB - 3,
                                    eoi_token_index=TINY_VOCAB - 2)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    saved = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            saved.update(dict.fromkeys(f.keys()))
    assert any(n.startswith("vision_tower.") for n in saved)
    assert any(n.startswith("language_model.model.layers.2.") for n in saved)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, 106]}))
    write_tiny_tokenizer(tmp_path, TINY_VOCAB)
    prompts = _prompts(4)
    greedy, logprobs = _reference(model, prompts)
    llm = LLM(str(tmp_path), dtype="float32", block_size=BLOCK, num_kv_blocks=64,
              num_threads=1)
    arch = llm.engine.model.config
    # the text config's eos id, then the top-level ones
    assert (arch.architecture, arch.num_layers, arch.eos_token_ids) == ("gemma3", 3,
                                                                        (2, 1, 106))
    outs = llm.generate(prompts, _params(prompt_logprobs=True))
    assert [o.outputs[0].token_ids for o in outs] == greedy
    for out, ids, ref in zip(outs, prompts, logprobs, strict=True):
        _check_prompt_logprobs(out, ids, ref)
