"""Gemma 3 text (`Gemma3ForCausalLM`, config `gemma3_text`): the shared decoder with Gemma's
parts switched on through its config.

- layers alternate: `layer_types` lists "sliding_attention" / "full_attention" per layer, or
  (older configs) every `sliding_window_pattern`-th layer (default 6) is global; sliding
  layers attend within `sliding_window` and rotate with their own RoPE (`rope_local_base_freq`,
  10,000, unscaled), global ones with `rope_theta` (1,000,000) and `rope_scaling`
  (transformers 5 nests both under `rope_parameters`, keyed by layer type);
- RMSNorm scales by `(1 + w)` in float32 (weights stored zero-centred), q and k get a
  per-head one, and each layer has four norms (input, post-attention, pre- and
  post-feedforward);
- embeddings times `sqrt(hidden_size)` in the model dtype; `gelu_pytorch_tanh` MLP;
  attention scale `query_pre_attn_scalar ** -0.5`; tied embeddings by default;
- `final_logit_softcapping` (None in Gemma 3's configs) caps the logits when set;
  `attn_logit_softcapping` is ignored, as transformers' and vLLM's Gemma 3 ignore it (Gemma
  2 capped its attention scores; Gemma 3 replaced that with the q/k norms).

The multimodal `Gemma3ForConditionalGeneration` checkpoints are not served.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.hf_config import common_fields, rope_params
from tandem.engine.model.registry import Family, register

logger = logging.getLogger(__name__)

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig defaults


class Gemma3ForCausalLM(DecoderForCausalLM):
    """The shared decoder; logits soft-capped as cap * tanh(logits / cap) when the config
    has a `final_logit_softcap`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        cap = self.config.final_logit_softcap
        if cap is None:
            return out
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        if logits is not None:  # (tensor-parallel ranks other than 0 get no logits)
            logits = torch.tanh(logits / cap) * cap
        return (logits, hidden) if isinstance(out, tuple) else logits


def _rope(cfg: dict[str, Any]) -> tuple[tuple[float, dict[str, Any] | None],
                                        tuple[float, dict[str, Any] | None]]:
    """((global theta, scaling), (local theta, scaling)), as transformers'
    `Gemma3TextConfig.convert_rope_params_to_dict` reads them: nested `rope_parameters`
    per layer type, else `rope_theta` + `rope_scaling` for the global layers and
    `rope_local_base_freq` (unscaled) for the sliding ones."""
    params = cfg.get("rope_parameters")
    nested = isinstance(params, dict) and any(
        isinstance(params.get(k), dict) for k in (FULL_ATTENTION, SLIDING_ATTENTION))
    if nested:
        glob = dict(params.get(FULL_ATTENTION) or {})
        local = dict(params.get(SLIDING_ATTENTION) or {})
    else:
        glob, local = dict(params or {}), {}
    if cfg.get("rope_scaling"):
        glob.update(cfg["rope_scaling"])
    glob.setdefault("rope_theta", cfg.get("rope_theta", GLOBAL_THETA))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", LOCAL_THETA))
    parsed = []
    for part in (glob, local):
        theta, scaling, _ = rope_params({"rope_parameters": part, **{
            k: cfg[k] for k in ("original_max_position_embeddings",) if k in cfg}})
        parsed.append((theta, scaling))
    return parsed[0], parsed[1]


def _layer_kinds(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """Per layer "sliding_attention" / "full_attention": `layer_types`, else every
    `sliding_window_pattern`-th layer global. Kept even when all slide (their local RoPE)."""
    kinds = cfg.get("layer_types")
    if kinds is not None:
        return [str(k) for k in kinds][:num_layers]
    pattern = int(cfg.get("sliding_window_pattern") or 6)
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
            for i in range(num_layers)]


def _cap(value: Any) -> float | None:
    if value is None:
        return None
    if float(value) <= 0:
        raise ConfigError(f"soft caps must be positive, got {value}")
    return float(value)


def parse_gemma3(cfg: dict[str, Any]) -> ModelArchConfig:
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("gemma3: bidirectional attention (embedding models) is not "
                          "supported")
    if cfg.get("attn_logit_softcapping") is not None:
        logger.warning("gemma3: attn_logit_softcapping %s is ignored (as transformers and "
                       "vLLM ignore it for Gemma 3)", cfg["attn_logit_softcapping"])
    cfg = {"tie_word_embeddings": True, "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", **cfg}
    fields = common_fields(cfg)
    (theta, scaling), (local_theta, local_scaling) = _rope(cfg)
    fields.update(rope_theta=theta, rope_scaling=scaling)
    fields["hidden_act"] = str(cfg.get("hidden_activation") or cfg.get("hidden_act"))
    kinds = _layer_kinds(cfg, fields["num_layers"])
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    if SLIDING_ATTENTION not in kinds:  # all global: one RoPE, no window
        kinds, window = None, None
    elif window is None:
        raise ConfigError("gemma3: sliding_attention layers need a sliding_window")
    return ModelArchConfig(
        architecture="gemma3", **fields, layer_types=None if kinds is None else tuple(kinds),
        sliding_window=window,
        qk_norm=True, norm_unit_offset=True, sandwich_norms=True,
        embedding_multiplier=fields["hidden_size"] ** 0.5,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        attention_bias=bool(cfg.get("attention_bias", False)),
        local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        final_logit_softcap=_cap(cfg.get("final_logit_softcapping")))


register(Family("gemma3", ("Gemma3ForCausalLM", "Gemma3TextForCausalLM"), ("gemma3_text",),
                parse_gemma3, Gemma3ForCausalLM))
