"""The Llama family: Llama (2, 3.x: `llama3` / `linear` / `dynamic` / `yarn` rope scaling),
Mistral (every layer in a sliding window) and Qwen2 / Qwen2.5 (q/k/v biases, sliding layers
past `max_window_layers` under `use_sliding_window`).

`LlamaForCausalLM` is the plain `DecoderForCausalLM`; the shared blocks are re-exported here
for code that imports them from this module.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.hf_config import common_fields, layer_types
from tandem.engine.model.layers import MLP, Attention, DecoderLayer, RMSNorm, RowTarget
from tandem.engine.model.registry import Family, register
from tandem.engine.model.rope import RotaryEmbedding, inv_freq

__all__ = ["MLP", "Attention", "DecoderLayer", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding",
           "RowTarget"]


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama, Mistral and Qwen2: the shared decoder as it is."""


def _inv_freq(cfg: ModelArchConfig) -> torch.Tensor:
    """The global RoPE's inverse frequencies (GGUF per-dimension factors applied)."""
    inv, _ = inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                      cfg.max_position_embeddings)
    if cfg.rope_freq_factors is not None:  # llama.cpp: theta_i / factor_i
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    return inv


def parse_llama(cfg: dict[str, Any]) -> ModelArchConfig:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConfigError("llama attention_bias=true (o_proj bias) is not supported")
    return ModelArchConfig(architecture="llama", **common_fields(cfg))


def parse_mistral(cfg: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields(cfg)
    kinds, window = layer_types(cfg, fields["num_layers"], window_layers=False)
    return ModelArchConfig(architecture="mistral", **fields, layer_types=kinds,
                           sliding_window=window,
                           attention_bias=bool(cfg.get("attention_bias", False)))


def parse_qwen2(cfg: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields(cfg)
    kinds, window = layer_types(cfg, fields["num_layers"])
    return ModelArchConfig(architecture="qwen2", **fields, layer_types=kinds,
                           sliding_window=window, attention_bias=True)


register(Family("llama", ("LlamaForCausalLM",), ("llama",), parse_llama, LlamaForCausalLM))
register(Family("mistral", ("MistralForCausalLM",), ("mistral",), parse_mistral,
                LlamaForCausalLM))
register(Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), parse_qwen2, LlamaForCausalLM))
