"""PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`, validated
against the base model, as `LoRAAdapter` (host float32 tensors, the scale folded into B).

Supported: `peft_type` LORA, `r`, `lora_alpha`, `use_rslora` (scale alpha / sqrt(r) instead
of alpha / r), `rank_pattern` / `alpha_pattern` (per-module overrides), `target_modules` as
a list of module names, a regular expression over full module names (PEFT's rule) or
"all-linear", `layers_to_transform`, `fan_in_fan_out`. Targets are the decoder's linears:
q/k/v/o_proj and gate/up/down_proj. Refused with a clear error: DoRA (`use_dora`), trained
biases (`bias` other than "none"), `modules_to_save` (full copies of modules), embeddings or
LM-head adapters, a rank above `max_lora_rank`, and any tensor whose shape does not match
the base model. Weights are read with safetensors (no pickle).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tandem.engine.errors import ConfigError
from tandem.engine.lora.paths import CONFIG_FILE, WEIGHTS_FILE
from tandem.engine.model.config import ModelArchConfig
from tandem.protocol.file_digest import file_sha256

# target module -> (fused module of the decoder layer, its group)
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "self_attn"), "k_proj": ("qkv_proj", "self_attn"),
    "v_proj": ("qkv_proj", "self_attn"), "o_proj": ("o_proj", "self_attn"),
    "gate_proj": ("gate_up_proj", "mlp"), "up_proj": ("gate_up_proj", "mlp"),
    "down_proj": ("down_proj", "mlp"),
}
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"([a-z_]+)\.lora_([AB])(?:\.default)?\.weight$")


def target_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """Target module -> (out_features, in_features) of the base model's linear."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, target) -> (A [r, in], B [out, r] * scale), float32 on
    the host."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    sha256: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())

    def merged_delta(self, layer: int, target: str) -> torch.Tensor | None:
        """B @ A * scale [out, in] of one module (the merged-weights reference), or None."""
        w = self.weights.get((layer, target))
        return None if w is None else w[1] @ w[0]


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: a key matching the end of the module's name."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf".*\.{key}", module):
            return value
    return default


def _targets(spec: Any, module: str) -> bool:
    short = module.rsplit(".", 1)[-1]
    if spec == "all-linear":
        return short in TARGETS
    if isinstance(spec, str):
        return re.fullmatch(spec, module) is not None
    return short in spec or module in spec


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return cfg


def _check_config(cfg: dict[str, Any], where: Path) -> None:
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ConfigError(f"{where}: peft_type {kind!r} is not a LoRA adapter")
    if cfg.get("use_dora"):
        raise ConfigError(f"{where}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise ConfigError(f"{where}: adapters with trained biases (bias={cfg['bias']!r}) "
                          "are not supported")
    if cfg.get("modules_to_save"):
        raise ConfigError(f"{where}: modules_to_save {cfg['modules_to_save']!r} is not "
                          "supported (only LoRA matrices are applied)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"{where}: r must be a positive integer")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(
            alpha):
        raise ConfigError(f"{where}: lora_alpha must be a number")
    spec = cfg.get("target_modules")
    if not (isinstance(spec, str) or (isinstance(spec, list) and spec and all(
            isinstance(t, str) for t in spec))):
        raise ConfigError(f"{where}: target_modules must be a list of module names or a "
                          "regular expression")


def load_adapter(path: Path, name: str, int_id: int, arch: ModelArchConfig,
                 max_rank: int, expected_sha256: str | None = None) -> LoRAAdapter:
    """Read and validate the PEFT adapter in directory `path` (already confined: see
    `paths.resolve_adapter_dir`) for a base model of architecture `arch`."""
    cfg = read_config(path)
    _check_config(cfg, path)
    weights_file = path / WEIGHTS_FILE
    digest = file_sha256(weights_file)
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise ConfigError(f"{weights_file}: sha256 {digest} does not match the pinned "
                          f"{expected_sha256.lower()}")
    shapes = target_shapes(arch)
    spec = cfg["target_modules"]
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _KEY.match(key)
                if m is None:
                    raise ConfigError(f"{weights_file}: unexpected tensor {key!r} (only "
                                      "LoRA A/B matrices of decoder layers are supported)")
                layer, target, ab = int(m.group(1)), m.group(3), m.group(4)
                if target not in TARGETS or TARGETS[target][1] != m.group(2):
                    raise ConfigError(f"{weights_file}: {key!r} targets an unsupported "
                                      f"module (supported: {', '.join(TARGETS)})")
                if layer >= arch.num_layers:
                    raise ConfigError(f"{weights_file}: {key!r} names layer {layer}; the "
                                      f"base model has {arch.num_layers}")
                slot = pairs.setdefault((layer, target), {})
                if ab in slot:
                    raise ConfigError(f"{weights_file}: {key!r} appears twice")
                slot[ab] = f.get_tensor(key)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # header / read errors
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{weights_file}: not a readable safetensors file: {e}") from None
    if not pairs:
        raise ConfigError(f"{weights_file} holds no LoRA weights")
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top = 0
    for (layer, target), ab in sorted(pairs.items()):
        module = f"model.layers.{layer}.{TARGETS[target][1]}.{target}"
        if "A" not in ab or "B" not in ab:
            raise ConfigError(f"{weights_file}: {module} has lora_A without lora_B or the "
                              "reverse")
        if not _targets(spec, module) or (layers is not None and layer not in layers):
            raise ConfigError(f"{weights_file}: {module} has weights but is not in the "
                              "adapter's target_modules / layers_to_transform")
        a, b = ab["A"].float(), ab["B"].float()
        if cfg.get("fan_in_fan_out"):
            a, b = a.T, b.T
        r = _pattern_value(ranks, module, cfg["r"])
        n_out, n_in = shapes[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (r, n_in) or b.shape != (n_out, r):
            raise ConfigError(f"{weights_file}: {module} has lora_A {tuple(a.shape)} and "
                              f"lora_B {tuple(b.shape)}; the base model needs ({r}, {n_in}) "
                              f"and ({n_out}, {r})")
        if r > max_rank:
            raise ConfigError(f"{path}: rank {r} exceeds max_lora_rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ConfigError(f"{weights_file}: {module} has non-finite weights")
        alpha = float(_pattern_value(alphas, module, cfg.get("lora_alpha", cfg["r"])))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out[(layer, target)] = (a.contiguous(), (b * scale).contiguous())
        top = max(top, r)
    return LoRAAdapter(name, int_id, str(path), top, out, digest)
