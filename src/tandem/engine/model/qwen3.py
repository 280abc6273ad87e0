"""Qwen3 (dense): per-head RMSNorm of q and k before RoPE, no q/k/v bias (unless the
config says so), a head_dim independent of hidden / heads, and Qwen2's sliding layers."""

from __future__ import annotations

from typing import Any

from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.hf_config import common_fields, layer_types
from tandem.engine.model.registry import Family, register


class Qwen3ForCausalLM(DecoderForCausalLM):
    """The shared decoder with q/k norms (`ModelArchConfig.qk_norm`)."""


def parse_qwen3(cfg: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields(cfg)
    kinds, window = layer_types(cfg, fields["num_layers"])
    return ModelArchConfig(architecture="qwen3", **fields, layer_types=kinds,
                           sliding_window=window, qk_norm=True,
                           attention_bias=bool(cfg.get("attention_bias", False)))


register(Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), parse_qwen3, Qwen3ForCausalLM))
