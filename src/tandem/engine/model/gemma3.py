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

The multimodal checkpoints (`Gemma3ForConditionalGeneration`: Gemma 3 4B, 12B, 27B) are
served as text models: their `text_config` (sparse on the hub: transformers' defaults fill
it) and their language model's weights (`language_model.model.*`), the vision tower and
projector skipped unread (`split_multimodal`). Images are not supported.
"""

from __future__ import annotations

import logging
from typing import Any

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.hf_config import as_ids, common_fields, rope_params
from tandem.engine.model.layers import soft_cap
from tandem.engine.model.registry import Family, Part, register

logger = logging.getLogger(__name__)

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig defaults
# the rest of its defaults (hub text_configs of the multimodal checkpoints list few fields)
TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
    bos_token_id=2, eos_token_id=1, tie_word_embeddings=True, query_pre_attn_scalar=256,
    sliding_window=4096)
# multimodal checkpoint names: the language model's prefixes -> the standard ones; the rest
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


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
            logits = soft_cap(logits, cap)
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


def split_multimodal(cfg: ModelArchConfig, name: str) -> list[Part] | None:
    """A multimodal checkpoint's language-model tensor under its standard name; [] (skipped)
    for the vision tower, the projector and a tied LM head; None (as it is) otherwise."""
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            renamed = new + name[len(old):]
            if renamed == "lm_head.weight" and cfg.tie_word_embeddings:
                return []
            return [Part(renamed)]
    if name.startswith(_VISION_PREFIXES):
        return []
    return None


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json fields over transformers' defaults: a multimodal
    config's `text_config` (its top-level eos ids and embedding tie added), else `cfg`."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return {**TEXT_DEFAULTS, **cfg}
    out = {**TEXT_DEFAULTS, **text}
    out["eos_token_id"] = [*as_ids(out["eos_token_id"]), *as_ids(cfg.get("eos_token_id"))]
    if "tie_word_embeddings" in cfg:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return out


def parse_gemma3(cfg: dict[str, Any]) -> ModelArchConfig:
    cfg = _text_config(cfg)
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("gemma3: bidirectional attention (embedding models) is not "
                          "supported")
    if cfg.get("attn_logit_softcapping") is not None:
        logger.warning("gemma3: attn_logit_softcapping %s is ignored (as transformers and "
                       "vLLM ignore it for Gemma 3)", cfg["attn_logit_softcapping"])
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
        attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        attention_bias=bool(cfg.get("attention_bias", False)),
        local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        final_logit_softcap=_cap(cfg.get("final_logit_softcapping")))


register(Family("gemma3", ("Gemma3ForCausalLM", "Gemma3TextForCausalLM",
                           "Gemma3ForConditionalGeneration"), ("gemma3_text", "gemma3"),
                parse_gemma3, Gemma3ForCausalLM, split=split_multimodal))
