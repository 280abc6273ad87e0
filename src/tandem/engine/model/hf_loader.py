"""Hugging Face checkpoint directories: config.json <-> `ModelArchConfig`, safetensors weights.

Also owns the parameter naming contract shared by every loader (`expected_weight_shapes`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig

logger = logging.getLogger(__name__)

# HF `architectures[0]` / `model_type` -> our architecture name, and back.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
ARCH_TO_HF_CLASS = {v: k for k, v in HF_ARCHITECTURES.items()}

# Tensors some checkpoints carry that are derived buffers, never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a model with `config` has, by HF name, with its torch shape."""
    h, hd = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weight_names(
    config: ModelArchConfig, found: dict[str, tuple[int, ...]], source: str
) -> None:
    """Raise ConfigError unless `found` (name -> shape) is exactly the expected parameter set."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        raise ConfigError(f"{source}: missing tensors {_preview(missing)}")
    if unexpected:
        raise ConfigError(
            f"{source}: tensors not supported for {config.architecture} {_preview(unexpected)}"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ConfigError(
                f"{source}: tensor {name} has shape {tuple(found[name])}, config implies {shape}"
            )


def _preview(names: list[str], limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, HF rope_scaling or None) from legacy keys or transformers-5 rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
    return theta, scaling or None


def _sliding_window(arch: str, cfg: dict[str, Any], num_layers: int) -> int | None:
    window = cfg.get("sliding_window")
    if arch == "llama" or window is None:
        return None
    if arch == "mistral":
        return int(window)
    # qwen2: sliding only when use_sliding_window, and only for layers >= max_window_layers.
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if not cfg.get("use_sliding_window", False):
            return None
        first = int(cfg.get("max_window_layers", num_layers))
        layer_types = ["full_attention"] * first + ["sliding_attention"] * (num_layers - first)
    kinds = set(layer_types[:num_layers])
    if kinds <= {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(window)
    raise ConfigError("per-layer mixed sliding-window attention is not supported")


def config_from_hf(model_dir: Path) -> ModelArchConfig:
    """Parse `model_dir/config.json` (+ generation_config.json eos ids) into a ModelArchConfig."""
    cfg = _read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        arch = HF_MODEL_TYPES.get(str(cfg.get("model_type")))
    if arch is None:
        raise ConfigError(
            f"{model_dir}/config.json: unsupported architecture "
            f"{archs or cfg.get('model_type')!r}; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        theta, scaling = _rope(cfg)
        eos = _as_ids(cfg.get("eos_token_id"))
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            eos += _as_ids(_read_json(gen_path).get("eos_token_id"))
        bias = arch == "qwen2" or bool(cfg.get("attention_bias", False))
        if arch == "llama" and bias:
            raise ConfigError("llama attention_bias=true (o_proj bias) is not supported")
        return ModelArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            sliding_window=_sliding_window(arch, cfg, layers),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{model_dir}/config.json: bad or missing field: {e!r}") from e


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files (only safetensors is supported)")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def read_hf(
    model_dir: Path, dtype: torch.dtype
) -> tuple[ModelArchConfig, int, Iterator[tuple[str, torch.Tensor]]]:
    """Validate an HF directory; return (config, tensor count, lazy (name, tensor) iterator).

    Tensors are cast to `dtype`; `lm_head.weight` is skipped when embeddings are tied.
    """
    config = config_from_hf(model_dir)
    files = _tensor_files(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings
                                                and name == "lm_head.weight"):
            continue
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        if not file.is_file():
            raise ConfigError(f"{model_dir}: shard {file.name} listed in the index is missing")
        with safe_open(file, framework="pt") as f:
            for name in names:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    check_weight_names(config, shapes, str(model_dir))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name).to(dtype).contiguous()

    return config, len(shapes), tensors()


def config_to_hf(config: ModelArchConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json dict that transformers (4.x and 5.x) and other engines accept."""
    if config.rope_freq_factors is not None:
        raise ConfigError("per-dimension rope frequency factors (a GGUF rope_freqs.weight) "
                          "have no HF config form; export from the original HF checkpoint")
    arch = config.architecture
    out: dict[str, Any] = {
        "architectures": [ARCH_TO_HF_CLASS[arch]],
        "model_type": arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _eos_json(config.eos_token_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif arch == "mistral":
        out["sliding_window"] = config.sliding_window
    else:
        out.update(use_sliding_window=config.sliding_window is not None,
                   sliding_window=config.sliding_window, max_window_layers=0)
    return out


def _eos_json(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)
