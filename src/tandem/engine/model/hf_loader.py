"""Hugging Face checkpoint directories: config.json <-> `ModelArchConfig` (through the family
registry), safetensors weights (sharded with an index or not), read one tensor at a time.

Also owns the parameter naming contract shared by every loader (`expected_weight_shapes`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tandem.engine.errors import ConfigError
from tandem.engine.model import registry
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.decoder import weight_shapes
from tandem.engine.model.hf_config import as_ids
from tandem.engine.model.registry import Part
from tandem.engine.model.rope import check_rope
from tandem.engine.quant.apply import SourceFormat
from tandem.engine.quant.base import WeightRows
from tandem.engine.quant.prequant import open_prequantized

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that are derived buffers, never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# families `config_to_hf` can write (the export path of `tandem convert`)
_EXPORTABLE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM"}


def __getattr__(name: str) -> Any:
    """`HF_ARCHITECTURES` (HF class -> family) and `HF_MODEL_TYPES` (model_type -> family),
    read from the registry."""
    if name == "HF_ARCHITECTURES":
        return registry.hf_architectures()
    if name == "HF_MODEL_TYPES":
        return registry.hf_model_types()
    raise AttributeError(name)


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a model with `config` has, by HF name (standard names: after the
    family's normaliser), with its torch shape: the embedding, the layers, the final norm,
    the LM head (unless tied)."""
    shapes = weight_shapes(registry.model_class(config), config)
    head = ("model.embed_tokens.weight",)
    tail = ("model.norm.weight", "lm_head.weight")
    ordered = {n: shapes[n] for n in head}
    ordered.update((n, s) for n, s in shapes.items() if n not in head + tail)
    ordered.update((n, shapes[n]) for n in tail if n in shapes)
    return ordered


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


def config_from_hf(model_dir: Path) -> ModelArchConfig:
    """Parse `model_dir/config.json` (+ generation_config.json eos ids) into a
    ModelArchConfig through the family registered for its `architectures`."""
    where = f"{model_dir}/config.json"
    cfg = _read_json(model_dir / "config.json")
    fam = registry.family_for_hf(cfg, where)
    try:
        config = fam.parse(cfg)
        eos = list(config.eos_token_ids)
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            eos += as_ids(_read_json(gen_path).get("eos_token_id"))
        config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(eos)))
        check_rope(config)
        return config
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: bad or missing field: {e!r}") from e


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
) -> tuple[ModelArchConfig, int, Iterator[tuple[str, torch.Tensor | WeightRows]],
           dict[str, SourceFormat]]:
    """Validate an HF directory; return (config, tensor count, lazy (name, tensor) iterator,
    the formats of the tensors that come out compressed).

    Tensors are cast to `dtype` and come under standard names (the family's normaliser
    splits fused checkpoint tensors into row views); `lm_head.weight` is skipped when
    embeddings are tied. A pre-quantized checkpoint (`quantization_config`) yields its
    quantized linears as `GroupedWeight` / `Fp8Weight` (`quant/prequant.py`).
    """
    config = config_from_hf(model_dir)
    split = registry.family(config.architecture).split
    files = _tensor_files(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[tuple[str, list[Part] | None]]] = {}
    for name, file in files.items():
        if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings
                                                and name == "lm_head.weight"):
            continue
        by_file.setdefault(file, []).append((name, split(config, name) if split else None))
    prequant = open_prequantized(model_dir, {n: f for f, es in by_file.items() for n, _ in es},
                                 expected_weight_shapes(config),
                                 (lambda n: split(config, n)) if split else None)
    if prequant is not None:
        check_weight_names(config, prequant.shapes, str(model_dir))
        return config, len(prequant.shapes), prequant.tensors(dtype), prequant.formats
    for file, entries in by_file.items():
        if not file.is_file():
            raise ConfigError(f"{model_dir}: shard {file.name} listed in the index is missing")
        with safe_open(file, framework="pt") as f:
            for name, parts in entries:
                shape = tuple(f.get_slice(name).get_shape())
                if parts is None:
                    shapes[name] = shape
                    continue
                _check_split(name, shape, parts, str(model_dir))
                for part in parts:
                    shapes[part.name] = shape if part.start is None else (
                        (part.rows, *shape[1:]))
    check_weight_names(config, shapes, str(model_dir))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file, entries in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name, parts in entries:
                    if parts == []:  # a tensor the family skips (never read)
                        continue
                    tensor = f.get_tensor(name).to(dtype).contiguous()
                    if parts is None:
                        yield name, tensor
                        continue
                    for part in parts:  # row views of the fused tensor
                        yield part.name, (tensor if part.start is None
                                          else tensor[part.start:part.start + part.rows])
                    del tensor

    return config, len(shapes), tensors(), {}


def _check_split(name: str, shape: tuple[int, ...], parts: list[Part], source: str) -> None:
    """A fused tensor's row parts must cover its rows exactly."""
    rows = [p for p in parts if p.start is not None]
    if not rows:
        return
    want = sum(p.rows for p in rows)
    if not shape or shape[0] != want:
        raise ConfigError(f"{source}: tensor {name} has shape {shape}, config implies "
                          f"{want} rows ({', '.join(p.name.rsplit('.', 2)[-2] for p in rows)})")


def config_to_hf(config: ModelArchConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json dict that transformers (4.x and 5.x) and other engines accept."""
    if config.rope_freq_factors is not None:
        raise ConfigError("per-dimension rope frequency factors (a GGUF rope_freqs.weight) "
                          "have no HF config form; export from the original HF checkpoint")
    arch = config.architecture
    if arch not in _EXPORTABLE or config.layer_types is not None:
        raise ConfigError(f"exporting a {arch} model to a Hugging Face directory is not "
                          f"supported (only {', '.join(_EXPORTABLE)} with uniform layers)")
    out: dict[str, Any] = {
        "architectures": [_EXPORTABLE[arch]],
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
