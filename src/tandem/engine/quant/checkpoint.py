"""Pre-quantized Hugging Face checkpoints: `quantization_config` and its method's name.

A checkpoint's `config.json` `quantization_config` (or AutoGPTQ's older
`quantize_config.json` / `quant_config.json` beside it) is read into a `CheckpointQuant`;
`quant/prequant.py` turns its tensors into the engine's compressed weights without a float
round trip. Methods (vLLM's names):
- "gptq": AutoGPTQ / GPTQModel / optimum, 4- or 8-bit, group size or per channel (-1),
  act-order (`desc_act`, a `g_idx` permutation), `sym`; `checkpoint_format` "gptq" (zero
  points stored minus one) or "gptq_v2".
- "awq": AutoAWQ's GEMM layout, 4-bit with zero points.
- "fp8": float8_e4m3fn weights with a per-tensor or per-channel scale (vLLM's and
  llm-compressor's FP8), or block-wise (`weight_block_size` [bn, bk]: DeepSeek-V3's and the
  Qwen3 -FP8 checkpoints' `weight_scale_inv`, one float32 scale per bn x bk block).
- "compressed-tensors": `float-quantized` FP8 weights (strategy tensor, channel or block
  with its `block_structure`) or
  `pack-quantized` 4- / 8-bit integer weights (group or channel, with or without zero
  points, act-order `weight_g_idx`), one weight scheme per checkpoint; its `ignore`d modules
  are float in the checkpoint and stay float.

`resolve_quantization` reconciles `--quantization` with the checkpoint: unset serves the
checkpoint's method; the same name (or a vLLM alias such as gptq_marlin) serves it too; any
other is a ConfigError, as is a checkpoint method asked of a float checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.engine.errors import ConfigError

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig

CHECKPOINT_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
# vLLM's kernel-specific names for the same checkpoints
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# methods that only read a pre-quantized checkpoint ("fp8" also quantizes float weights)
CHECKPOINT_ONLY = ("gptq", "awq", "compressed-tensors")
# the group sizes the INT4 kernels take; a checkpoint group that is a multiple of one of
# them is served with its scales repeated (exactly), per-channel likewise
KERNEL_GROUPS = (128, 64, 32)


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's weight quantization. `kind` "int": `bits`-bit integer codes with a
    float scale per `group_size` input columns (None: per output channel), zero points
    unless `symmetric`; "fp8": e4m3 codes with a per-tensor or per-channel scale, or one
    per `block` (rows, input columns) when block-wise. `layout`: how the tensors are stored
    ("gptq", "gptq_v2", "awq", "pack" for compressed-tensors' pack-quantized, "fp8")."""

    method: str
    kind: str
    bits: int
    group_size: int | None
    symmetric: bool
    layout: str
    block: tuple[int, int] | None = None


def canonical_name(name: str | None) -> str | None:
    """`name` with vLLM's aliases resolved (gptq_marlin -> gptq, awq_marlin -> awq)."""
    return ALIASES.get(name, name) if name is not None else None


def _int(cfg: Mapping[str, Any], keys: tuple[str, ...], default: Any, where: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
            return value
    return default


def _group(value: int | None, where: str) -> int | None:
    if value is None or value == -1:
        return None
    if value < 1:
        raise ConfigError(f"{where}: group_size must be positive or -1, got {value}")
    return value


def _gptq(qc: Mapping[str, Any], where: str) -> CheckpointQuant:
    bits = _int(qc, ("bits",), 4, where)
    if bits not in (4, 8):
        raise ConfigError(f"{where}: GPTQ with {bits}-bit weights is not supported (4 and 8 "
                          "are)")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq "
                          "and gptq_v2 are)")
    return CheckpointQuant("gptq", "int", bits, _group(_int(qc, ("group_size",), 128, where),
                                                       where),
                           bool(qc.get("sym", True)), fmt)


def _awq(qc: Mapping[str, Any], where: str) -> CheckpointQuant:
    bits = _int(qc, ("bits", "w_bit"), 4, where)
    if bits != 4:
        raise ConfigError(f"{where}: AWQ with {bits}-bit weights is not supported (4 is)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"{where}: AWQ version {version!r} is not supported (the GEMM "
                          "layout is)")
    if not qc.get("zero_point", True):
        raise ConfigError(f"{where}: AWQ without zero points is not supported")
    group = _group(_int(qc, ("group_size", "q_group_size"), 128, where), where)
    return CheckpointQuant("awq", "int", 4, group, False, "awq")


def _block(value: Any, key: str, where: str) -> tuple[int, int]:
    """A block shape [rows, columns] (a list, or compressed-tensors' older "RxC" string)."""
    if isinstance(value, str) and "x" in value:
        value = value.split("x")
    try:
        block = tuple(int(v) for v in value)
        ok = len(block) == 2 and all(b > 0 for b in block) and not any(
            isinstance(v, (bool, float)) for v in value)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{where}: {key} must be two positive integers [rows, columns], "
                          f"got {value!r}")
    return block  # type: ignore[return-value]


def _fp8(qc: Mapping[str, Any], where: str) -> CheckpointQuant:
    if not str(qc.get("fmt", "e4m3")).startswith("e4m3"):
        raise ConfigError(f"{where}: FP8 format {qc.get('fmt')!r} is not supported (e4m3 is)")
    block = qc.get("weight_block_size")
    block = None if block is None else _block(block, "weight_block_size", where)
    return CheckpointQuant("fp8", "fp8", 8, None, True, "fp8", block)


def _compressed_tensors(qc: Mapping[str, Any], where: str) -> CheckpointQuant:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}: compressed-tensors without config_groups")
    schemes = set()
    for name, group in groups.items():
        w = (group or {}).get("weights")
        if not w:
            raise ConfigError(f"{where}: compressed-tensors group {name!r} quantizes no "
                              "weights (activation-only schemes are not supported)")
        fmt = group.get("format") or qc.get("format")
        acts = group.get("input_activations")
        block = w.get("block_structure")
        schemes.add((fmt, w.get("type", "int"), w.get("num_bits"), w.get("strategy"),
                     w.get("group_size"), bool(w.get("symmetric", True)),
                     None if not acts else acts.get("type", "int"),
                     None if block is None else _block(block, "block_structure", where)))
    if len(schemes) != 1:
        raise ConfigError(f"{where}: compressed-tensors with {len(schemes)} different weight "
                          "schemes is not supported (one scheme for every quantized layer is)")
    fmt, kind, bits, strategy, group, sym, acts, block = schemes.pop()
    if kind == "float":
        if fmt not in ("float-quantized", "naive-quantized") or bits != 8:
            raise ConfigError(f"{where}: compressed-tensors {bits}-bit float weights in "
                              f"format {fmt!r} are not supported (8-bit float-quantized is)")
        if strategy not in ("tensor", "channel", "block"):
            raise ConfigError(f"{where}: compressed-tensors FP8 strategy {strategy!r} is not "
                              "supported (tensor, channel and block are)")
        if strategy == "block" and block is None:
            raise ConfigError(f"{where}: compressed-tensors FP8 strategy 'block' without a "
                              "block_structure")
        return CheckpointQuant("compressed-tensors", "fp8", 8, None, True, "fp8",
                               block if strategy == "block" else None)
    if fmt != "pack-quantized" or acts is not None:
        raise ConfigError(f"{where}: compressed-tensors format {fmt!r} with "
                          f"{acts or 'no'} activation quantization is not supported "
                          "(float-quantized FP8 and weight-only pack-quantized int are)")
    if bits not in (4, 8):
        raise ConfigError(f"{where}: compressed-tensors {bits}-bit int weights are not "
                          "supported (4 and 8 are)")
    if strategy == "channel":
        group = None
    elif strategy == "group" and isinstance(group, int) and group > 0:
        pass
    else:
        raise ConfigError(f"{where}: compressed-tensors int strategy {strategy!r} (group_size "
                          f"{group!r}) is not supported (group and channel are)")
    return CheckpointQuant("compressed-tensors", "int", bits, group, sym, "pack")


_PARSERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}


def parse_quant_config(qc: Mapping[str, Any], where: str) -> CheckpointQuant:
    """A `quantization_config` dict -> CheckpointQuant (ConfigError naming what is not
    supported)."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq" and qc.get("checkpoint_format") == "marlin":
        raise ConfigError(f"{where}: GPTQ checkpoint_format 'marlin' is not supported")
    method = canonical_name(method)
    if method not in _PARSERS:
        raise ConfigError(f"{where}: quantization_config quant_method {method!r} is not "
                          f"supported; supported: {', '.join(CHECKPOINT_METHODS)}")
    return _PARSERS[method](qc, where)


def read_quant_config(model_dir: Path) -> CheckpointQuant | None:
    """The checkpoint's quantization (config.json's `quantization_config`, else AutoGPTQ's
    quantize_config.json / quant_config.json), or None for a float checkpoint."""
    where = f"{model_dir}/config.json"
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {where}: {e}") from e
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if qc is None:
        for name in ("quantize_config.json", "quant_config.json"):
            path = model_dir / name
            if path.is_file():
                where = str(path)
                try:
                    qc = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError) as e:
                    raise ConfigError(f"cannot read {path}: {e}") from e
                qc = dict(qc)
                qc.setdefault("quant_method", "gptq")
                break
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{where}: quantization_config must be an object")
    return parse_quant_config(qc, where)


def kernel_group(group: int, bits: int, where: str) -> int:
    """The group size a checkpoint group `group` is served with: the largest of
    KERNEL_GROUPS dividing it (its scales repeated); 8-bit codes keep any group."""
    for g in KERNEL_GROUPS:
        if group % g == 0:
            return g
    if bits == 8:
        return group
    raise ConfigError(f"{where}: 4-bit group size {group} is not served: the INT4 kernels take "
                      f"groups of {', '.join(map(str, sorted(KERNEL_GROUPS)))} (or a multiple)")


def resolve_quantization(flag: str | None, checkpoint: str | None, source: str) -> str | None:
    """The quantization to serve: `flag` (EngineConfig.quantization) against `checkpoint`
    (the checkpoint's method, None for float weights). Unset serves the checkpoint's method
    (vLLM's detection); a conflicting flag, or a checkpoint-only method (gptq, awq,
    compressed-tensors) for a float checkpoint, is a ConfigError."""
    flag = canonical_name(flag)
    if checkpoint is None:
        if flag in CHECKPOINT_ONLY:
            raise ConfigError(f"quantization {flag!r} serves a {flag} checkpoint, but "
                              f"{source or 'the model'} has no quantization_config (its "
                              "weights are float); use int8, int4 or fp8 to quantize them at "
                              "load")
        return flag
    if flag is None or flag == checkpoint:
        return checkpoint
    raise ConfigError(f"{source or 'the model'} is a {checkpoint} checkpoint "
                      f"(quantization_config), but quantization {flag!r} was asked; leave "
                      f"--quantization unset or pass {checkpoint}")


def checkpoint_method(model: str | None) -> str | None:
    """The quantization method of the Hugging Face checkpoint directory `model` (its
    quantization_config), or None: float weights, a GGUF file, the bundled model."""
    path = Path(model) if model else None
    if path is None or not (path / "config.json").is_file():
        return None
    quant = read_quant_config(path)
    return None if quant is None else quant.method


def with_checkpoint_quantization(config: EngineConfig) -> EngineConfig:
    """`config` with `quantization` set to what is served (`resolve_quantization` against
    its local model directory): a pre-quantized checkpoint's method when unset, so the
    engine's state and /ready report it. ConfigError for a conflict."""
    served = resolve_quantization(config.quantization, checkpoint_method(config.model),
                                  config.model or "")
    if served == config.quantization:
        return config
    return dataclasses.replace(config, quantization=served)
