"""Reading a Hugging Face config.json dict: the fields every family shares, the RoPE
settings (transformers-5 `rope_parameters` or the legacy `rope_theta` / `rope_scaling` keys
real hub checkpoints carry) and per-layer attention kinds. Family parsers build on these."""

from __future__ import annotations

from typing import Any

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import FULL_ATTENTION, SLIDING_ATTENTION


def as_ids(value: Any) -> list[int]:
    """An HF token id field (int, list or None) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def rope_params(cfg: dict[str, Any], layer_type: str | None = None
                ) -> tuple[float, dict[str, Any] | None, dict[str, Any]]:
    """(rope_theta, HF rope_scaling with `rope_type` set, or None for the default RoPE, the
    raw parameters) from legacy keys or transformers-5 `rope_parameters` (per layer type
    when the config nests them that way and `layer_type` is given)."""
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items()
                   if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling:
        scaling = dict(scaling)
        kind = scaling.pop("type", None) or scaling.get("rope_type", "default")
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
        elif "original_max_position_embeddings" not in scaling and (
                "original_max_position_embeddings" in cfg):
            scaling["original_max_position_embeddings"] = int(
                cfg["original_max_position_embeddings"])
    return theta, scaling or None, params


def layer_types(cfg: dict[str, Any], num_layers: int, window_layers: bool = True
                ) -> tuple[tuple[str, ...] | None, int | None]:
    """(per-layer attention kinds or None when all layers are alike, sliding window).

    `layer_types` when the config lists them; else with `window_layers` (Qwen2 / Qwen3)
    sliding only under `use_sliding_window`, for layers >= `max_window_layers`; else (Mistral,
    Phi-3) every layer slides when `sliding_window` is set. A window that spans
    `max_position_embeddings` is full attention (Phi-4-mini's 262144)."""
    window = cfg.get("sliding_window")
    window = int(window) if window else None
    if window is not None and window >= int(cfg.get("max_position_embeddings", 2048)):
        return None, None
    kinds = cfg.get("layer_types")
    if kinds is None and window_layers:
        if not cfg.get("use_sliding_window", False) or window is None:
            return None, None
        first = int(cfg.get("max_window_layers", num_layers))
        kinds = [FULL_ATTENTION] * first + [SLIDING_ATTENTION] * (num_layers - first)
    if kinds is None:
        return None, window
    kinds = tuple(str(k) for k in kinds[:num_layers])
    if set(kinds) <= {FULL_ATTENTION}:
        return None, None
    if window is None:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is "
                          "not set")
    if set(kinds) == {SLIDING_ATTENTION}:
        return None, window
    return kinds, window


def common_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelArchConfig` keyword arguments every Llama-like config.json gives (no
    `architecture`, windows or family features)."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    theta, scaling, params = rope_params(cfg)
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=float(partial if partial is not None else 1.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(as_ids(cfg.get("eos_token_id")))),
    )
