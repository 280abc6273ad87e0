"""The model registry and the config-level contracts of the families (no model is run
here; test_architectures.py runs every family against transformers): an unsupported
architecture is an error naming it and listing the supported ones, config.json keys old and
new parse into the same config, every RoPE type's frequencies equal transformers'
`ROPE_INIT_FUNCTIONS`, and fused checkpoint tensors that do not fit are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem.engine.errors import ConfigError
from tandem.engine.model import registry
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.hf_loader import config_from_hf, config_to_hf, read_hf
from tandem.engine.model.rope import RotaryEmbedding, inv_freq

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256}


def _config(tmp_path: Path, **cfg) -> ModelArchConfig:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return config_from_hf(tmp_path)


def test_unsupported_architecture_names_it_and_lists_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError) as err:
        config_from_hf(tmp_path)
    msg = str(err.value)
    assert "unsupported architecture ['GPT2LMHeadModel']" in msg
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Phi3ForCausalLM"):
        assert name in msg.split("supported: ")[1]
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt2'; supported: llama"):
        ModelArchConfig(architecture="gpt2", vocab_size=8, hidden_size=8,
                        intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=8)


def test_families_are_chosen_by_architectures_then_model_type(tmp_path: Path) -> None:
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3"} <= set(
        registry.supported_architectures())
    assert _config(tmp_path, architectures=["Qwen3ForCausalLM"]).architecture == "qwen3"
    assert _config(tmp_path, model_type="phi3").architecture == "phi3"
    assert registry.model_class(_config(tmp_path, model_type="phi3")).__name__ == (
        "Phi3ForCausalLM")


def test_family_settings_from_config_json(tmp_path: Path) -> None:
    qwen3 = _config(tmp_path, architectures=["Qwen3ForCausalLM"], head_dim=40)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.attention_bias) == (True, 40, False)
    qwen2 = _config(tmp_path, architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                    sliding_window=32, max_window_layers=1)
    assert qwen2.attention_bias
    assert qwen2.layer_windows == (None, 32)  # sliding from max_window_layers on
    assert _config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32,
                   use_sliding_window=False).layer_windows == (None, None)
    mistral = _config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=16)
    assert mistral.layer_windows == (16, 16)
    phi4 = _config(tmp_path, architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.75,
                   sliding_window=262144)  # (Phi-4-mini's: past the context, so none)
    assert (phi4.rotary_dim, phi4.head_dim, phi4.layer_windows) == (12, 16, (None, None))


def test_legacy_and_transformers5_rope_keys_parse_alike(tmp_path: Path) -> None:
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    legacy = _config(tmp_path, architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                     rope_scaling={"type": "llama3", **llama3})
    new = _config(tmp_path, architectures=["LlamaForCausalLM"], rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, **llama3})
    assert legacy == new and legacy.rope_scaling == new.rope_scaling == {
        "rope_type": "llama3", **llama3}
    assert legacy.rope_theta == 500000.0
    # Phi-3 calls longrope "su"; its original context is a top-level key
    phi = _config(tmp_path, architectures=["Phi3ForCausalLM"],
                  original_max_position_embeddings=64,
                  rope_scaling={"type": "su", "short_factor": [1.0] * 8,
                                "long_factor": [2.0] * 8})
    assert phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 64
    with pytest.raises(ConfigError, match="unsupported rope_scaling type 'ntk-magic'"):
        _config(tmp_path, architectures=["LlamaForCausalLM"],
                rope_scaling={"rope_type": "ntk-magic", "factor": 2.0})


ROPES = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", list(ROPES))
def test_rope_frequencies_match_transformers(name: str, partial: float) -> None:
    kind = name.split("-")[0]
    params = {"rope_type": kind, "rope_theta": 20000.0, **ROPES[name],
              "partial_rotary_factor": partial}
    hf = transformers.LlamaConfig(**BASE, head_dim=32, rope_parameters=params)
    ref, ref_attn = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    dims = int(32 * partial)
    got, attn = inv_freq(dims, 20000.0, {"rope_type": kind, **ROPES[name]}, 256)
    assert torch.allclose(got, ref.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn, rel=1e-12)


def test_longrope_short_then_long_factors_match_transformers() -> None:
    short = [1.0 + i / 10 for i in range(6)]
    long = [3.0 + i for i in range(6)]
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
              "long_factor": long, "partial_rotary_factor": 0.75}
    hf = transformers.Phi3Config(**BASE, original_max_position_embeddings=64,
                                 partial_rotary_factor=0.75, rope_parameters=params)
    ref_short, attn = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    ref_long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=65)
    assert attn == pytest.approx((1 + torch.log(torch.tensor(4.0)).item()
                                  / torch.log(torch.tensor(64.0)).item()) ** 0.5)
    cfg = ModelArchConfig(architecture="phi3", vocab_size=128, hidden_size=64,
                          intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=16, max_position_embeddings=256, partial_rotary_factor=0.75,
                          rope_scaling={"rope_type": "longrope", "short_factor": short,
                                        "long_factor": long,
                                        "original_max_position_embeddings": 64})
    rope = RotaryEmbedding(cfg, 100)
    assert rope.cos.shape == (100, 12)
    for pos, inv in ((63, ref_short), (64, ref_long), (99, ref_long)):
        angles = pos * inv.float()
        want = torch.cat((angles, angles)).cos() * attn
        assert torch.allclose(rope.cos[pos], want, rtol=1e-5, atol=1e-6)


def _phi3_dir(tmp_path: Path, qkv_rows: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "architectures": ["Phi3ForCausalLM"], "num_hidden_layers": 1,
         "tie_word_embeddings": True}))
    t = {"model.embed_tokens.weight": torch.zeros(128, 64), "model.norm.weight": torch.ones(64),
         "model.layers.0.input_layernorm.weight": torch.ones(64),
         "model.layers.0.post_attention_layernorm.weight": torch.ones(64),
         "model.layers.0.self_attn.qkv_proj.weight": torch.arange(qkv_rows * 64.0).view(-1, 64),
         "model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 64),
         "model.layers.0.mlp.gate_up_proj.weight": torch.zeros(192, 64),
         "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 96)}
    save_file(t, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_phi3_fused_checkpoint_tensors_are_read_as_standard_rows(tmp_path: Path) -> None:
    opened = read_hf(_phi3_dir(tmp_path, 128), torch.float32)
    count, got = opened[1], dict(opened[2])  # (config, count, tensors, ...)
    assert count == len(got) == 11  # q/k/v and gate/up: 2 fused tensors -> 5
    fused = torch.arange(128 * 64.0).view(-1, 64)
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], fused[:64])
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], fused[64:96])
    assert torch.equal(got["model.layers.0.self_attn.v_proj.weight"], fused[96:])
    assert got["model.layers.0.mlp.up_proj.weight"].shape == (96, 64)


def test_phi3_fused_tensor_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"qkv_proj.weight has shape \(120, 64\), config "
                                          r"implies 128 rows \(q_proj, k_proj, v_proj\)"):
        read_hf(_phi3_dir(tmp_path, 120), torch.float32)


def test_export_refuses_families_it_cannot_write(tmp_path: Path) -> None:
    cfg = _config(tmp_path, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ConfigError, match="exporting a qwen3 model .* not supported"):
        config_to_hf(cfg, torch.float32)
    assert config_to_hf(_config(tmp_path, architectures=["Qwen2ForCausalLM"]),
                        torch.float32)["architectures"] == ["Qwen2ForCausalLM"]


def test_fused_lora_targets_only_for_families_with_fused_checkpoints(tmp_path: Path) -> None:
    """Phi-3 adapters name `qkv_proj` / `gate_up_proj`; a loaded adapter holds their
    q/k/v and gate/up parts (same A, B's rows). A Llama has no such module."""
    from tandem.engine.lora.peft import load_adapter
    from tests.engine.utils import make_peft_adapter

    base = {**BASE, "num_hidden_layers": 1}
    weights = make_peft_adapter(tmp_path, base, rank=2, targets=("qkv_proj", "gate_up_proj"))
    (tmp_path / "base").mkdir()
    phi3 = _config(tmp_path / "base", architectures=["Phi3ForCausalLM"], num_hidden_layers=1)
    adapter = load_adapter(tmp_path, "a", 1, phi3, max_rank=4)
    a, b = weights[(0, "qkv_proj")]
    scale = 16.0 / 2
    assert sorted(adapter.weights) == [(0, t) for t in ("gate_proj", "k_proj", "q_proj",
                                                        "up_proj", "v_proj")]
    for target, rows in (("q_proj", slice(0, 64)), ("k_proj", slice(64, 96)),
                         ("v_proj", slice(96, 128))):
        got_a, got_b = adapter.weights[(0, target)]
        assert torch.equal(got_a, a) and torch.allclose(got_b, b[rows] * scale)
    llama = _config(tmp_path / "base", architectures=["LlamaForCausalLM"], num_hidden_layers=1)
    with pytest.raises(ConfigError, match=r"_proj.lora_A.weight' targets an unsupported "
                                          r"module \(supported for llama: q_proj, k_proj"):
        load_adapter(tmp_path, "a", 1, llama, max_rank=4)


def test_family_order_does_not_depend_on_which_module_was_imported_first(monkeypatch) -> None:
    """The supported list (and so the unsupported-architecture message) is the same whether
    a test imported `gemma3` before `qwen3` or not."""
    from tandem.engine.model import registry

    canonical = list(registry.families())
    shuffled = dict(reversed(list(registry._FAMILIES.items())))
    monkeypatch.setattr(registry, "_FAMILIES", shuffled)
    assert list(registry.families()) == canonical
    assert canonical[:5] == ["llama", "mistral", "qwen2", "qwen3", "phi3"]
