"""Mixtral (8x7B, 8x22B): the Mistral decoder with a sparse MoE MLP in every layer: a router
over `num_local_experts`, the top `num_experts_per_tok`, their softmax weights renormalised
to sum 1 (softmax over all experts, top k, divided by their sum), each expert a SwiGLU MLP
of `intermediate_size`.

Checkpoint names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1 / w3 / w2` =
gate / up / down) are renamed as they are read (`rename_experts`) to the standard MoE names
of `model/moe.py` (`mlp.gate`, `mlp.experts.{e}.gate_proj / up_proj / down_proj`), so
tensor parallelism and quantization see one layout for every MoE family.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.hf_config import common_fields, layer_types
from tandem.engine.model.moe import MoEDecoderForCausalLM
from tandem.engine.model.registry import Family, Part, register

_RENAME = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(MoEDecoderForCausalLM):
    """Every layer's MLP is a `FusedMoE` with Mixtral's routing (renormalised top-k)."""


def rename_experts(cfg: ModelArchConfig, name: str) -> list[Part] | None:
    """`...block_sparse_moe.gate.weight` -> `...mlp.gate.weight`,
    `...block_sparse_moe.experts.{e}.w1.weight` -> `...mlp.experts.{e}.gate_proj.weight`
    (w3: up_proj, w2: down_proj); other names as they are."""
    if ".block_sparse_moe." not in name:
        return None
    new = name.replace(".block_sparse_moe.", ".mlp.")
    head, _, last = new.rpartition(".")
    base, _, module = head.rpartition(".")
    if module in _RENAME and ".experts." in base:
        new = f"{base}.{_RENAME[module]}.{last}"
    return [Part(new)]


def parse_mixtral(cfg: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields(cfg)
    kinds, window = layer_types(cfg, fields["num_layers"], window_layers=False)
    return ModelArchConfig(architecture="mixtral", **fields, layer_types=kinds,
                           sliding_window=window,
                           num_experts=int(cfg["num_local_experts"]),
                           num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                           moe_intermediate_size=int(cfg["intermediate_size"]),
                           norm_topk_prob=True)


register(Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), parse_mixtral,
                MixtralForCausalLM, split=rename_experts))
