"""Phi-3 / Phi-3.5 / Phi-4-mini: fused `qkv_proj` and `gate_up_proj` in the checkpoint,
`longrope` RoPE scaling (short factors inside `original_max_position_embeddings`, long ones
past it) and partial rotary dims (`partial_rotary_factor`, Phi-4-mini's 0.75).

The checkpoint's fused tensors are split into the standard q/k/v and gate/up names as they
are read (`split_fused`), so tensor parallelism, quantization and LoRA see a Llama layout.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.hf_config import common_fields, layer_types
from tandem.engine.model.registry import Family, Part, register


class Phi3ForCausalLM(DecoderForCausalLM):
    """The shared decoder; only the checkpoint's names differ (`split_fused`)."""


def split_fused(cfg: ModelArchConfig, name: str) -> list[Part] | None:
    """`...self_attn.qkv_proj.weight` -> q/k/v rows, `...mlp.gate_up_proj.weight` -> gate
    and up rows; other names as they are."""
    prefix, _, last = name.rpartition(".")
    base, _, module = prefix.rpartition(".")
    if module == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [Part(f"{base}.q_proj.{last}", 0, q), Part(f"{base}.k_proj.{last}", q, kv),
                Part(f"{base}.v_proj.{last}", q + kv, kv)]
    if module == "gate_up_proj":
        i = cfg.intermediate_size
        return [Part(f"{base}.gate_proj.{last}", 0, i), Part(f"{base}.up_proj.{last}", i, i)]
    return None


def parse_phi3(cfg: dict[str, Any]) -> ModelArchConfig:
    cfg = dict(cfg)
    for key in ("rope_scaling", "rope_parameters"):  # Phi-3 calls longrope "su" or "yarn"
        rs = cfg.get(key)
        if isinstance(rs, dict) and (rs.get("rope_type") or rs.get("type")) in ("su", "yarn"):
            cfg[key] = {**{k: v for k, v in rs.items() if k != "type"}, "rope_type": "longrope"}
    fields = common_fields(cfg)
    kinds, window = layer_types(cfg, fields["num_layers"], window_layers=False)
    return ModelArchConfig(architecture="phi3", **fields, layer_types=kinds,
                           sliding_window=window)


register(Family("phi3", ("Phi3ForCausalLM",), ("phi3",), parse_phi3, Phi3ForCausalLM,
                split=split_fused, fused_modules=("qkv_proj", "gate_up_proj")))
