"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (per-head q/k RMSNorm)
with sparse MoE MLPs: a router over `num_experts`, the top `num_experts_per_tok` of the
softmax over all experts, renormalised to sum 1 only under `norm_topk_prob`, and cast to
the activation dtype before they weight the experts' outputs; each expert a SwiGLU MLP of
`moe_intermediate_size`. Layers listed in `mlp_only_layers`, or not on the
`decoder_sparse_step` grid, keep a dense MLP of `intermediate_size`.

Checkpoint names are the standard MoE names of `model/moe.py` (`mlp.gate`,
`mlp.experts.{e}.gate_proj / up_proj / down_proj`).
"""

from __future__ import annotations

from typing import Any

from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.hf_config import common_fields, layer_types
from tandem.engine.model.moe import MoEDecoderForCausalLM
from tandem.engine.model.registry import Family, register


class Qwen3MoeForCausalLM(MoEDecoderForCausalLM):
    """The Qwen3 decoder (`qk_norm`) with a `FusedMoE` in each sparse layer."""

    weights_in_act_dtype = True  # transformers casts the routing weights first


def sparse_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers whose MLP is a mixture of experts (transformers' rule): not in
    `mlp_only_layers`, and (i + 1) a multiple of `decoder_sparse_step`."""
    dense = set(int(i) for i in cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def parse_qwen3_moe(cfg: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields(cfg)
    kinds, window = layer_types(cfg, fields["num_layers"])
    # hub configs say num_experts; transformers 5 writes it as num_local_experts
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    moe = sparse_layers(cfg, fields["num_layers"]) if experts else ()
    return ModelArchConfig(architecture="qwen3_moe", **fields, layer_types=kinds,
                           sliding_window=window, qk_norm=True,
                           attention_bias=bool(cfg.get("attention_bias", False)),
                           num_experts=experts if moe else 0,
                           num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0)
                           if moe else 0,
                           moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                           norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                           moe_layers=moe if len(moe) < fields["num_layers"] else None)


register(Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), parse_qwen3_moe,
                Qwen3MoeForCausalLM))
