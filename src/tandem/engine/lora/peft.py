"""PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`, validated
against the base model, as `LoRAAdapter` (host float32 tensors, the scale folded into B).

Supported: `peft_type` LORA, `r`, `lora_alpha`, `use_rslora` (scale alpha / sqrt(r) instead
of alpha / r), `rank_pattern` / `alpha_pattern` (per-module overrides), `target_modules` as
a list of module names, a regular expression over full module names (PEFT's rule) or
"all-linear", `layers_to_transform`, `fan_in_fan_out`. Targets are the decoder's linears:
q/k/v/o_proj and gate/up/down_proj; for families whose checkpoints fuse them (Phi-3's
`qkv_proj`, `gate_up_proj`) the fused modules, each split on load into its parts (the same A,
its rows of B). Refused with a clear error: DoRA (`use_dora`), trained
biases (`bias` other than "none"), `modules_to_save` (full copies of modules), embeddings or
LM-head adapters, a rank above `max_lora_rank` or below 1 (`rank_pattern` too), and any
tensor whose shape does not match the base model (checked from the safetensors header,
before any data is read). Files are opened once each, confined (`paths.open_confined`), and
read through that descriptor (no pickle). `LoRAAdapter.digest` names the effective weights.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import re
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.lora.paths import CONFIG_FILE, WEIGHTS_FILE, AdapterDir, open_confined
from tandem.engine.lora.safetensors_io import TensorEntry, json_object, read_header
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.registry import family

# target module -> (fused module of the decoder layer, its group)
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "self_attn"), "k_proj": ("qkv_proj", "self_attn"),
    "v_proj": ("qkv_proj", "self_attn"), "o_proj": ("o_proj", "self_attn"),
    "gate_proj": ("gate_up_proj", "mlp"), "up_proj": ("gate_up_proj", "mlp"),
    "down_proj": ("down_proj", "mlp"),
}
# modules fused in the checkpoints (and adapters) of some families (Phi-3) -> their group
# and parts: split on load into the targets above, each part with the same A and its rows
# of B (a loaded adapter only ever holds TARGETS)
FUSED_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj"))}
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"([a-z_]+)\.lora_([AB])(?:\.default)?\.weight$")


def target_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """Target module -> (out_features, in_features) of the base model's linear."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h)}


def _group(target: str, fused: Container[str]) -> str | None:
    """The decoder-layer group ("self_attn" / "mlp") of a target (fused ones only when in
    `fused`), None for an unsupported module."""
    if target in TARGETS:
        return TARGETS[target][1]
    return FUSED_TARGETS[target][0] if target in FUSED_TARGETS and target in fused else None


def _split_fused(target: str, a: torch.Tensor, b: torch.Tensor, arch: ModelArchConfig
                 ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A fused target's (A, B) as its parts' (target, A, rows of B); others as they are."""
    if target not in FUSED_TARGETS:
        return [(target, a, b)]
    shapes = target_shapes(arch)
    out, start = [], 0
    for part in FUSED_TARGETS[target][1]:
        rows = shapes[part][0]
        out.append((part, a, b[start:start + rows]))
        start += rows
    return out


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, target) -> (A [r, in], B [out, r] * scale), float32 on
    the host."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    sha256: str = ""  # of adapter_model.safetensors as read
    digest: str = ""  # `adapter_digest` of the weights: the adapter's identity in block hashes
    root: str | None = None  # the root it was confined to when read (None: trusted)

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
        return short in TARGETS or short in FUSED_TARGETS
    if isinstance(spec, str):
        return re.fullmatch(spec, module) is not None
    return short in spec or module in spec


def read_config(path: Path, root: str | None = None) -> dict[str, Any]:
    """`adapter_config.json` of adapter directory `path` (inside `root`; None: "/"), read
    through one confined descriptor (`paths.open_confined`)."""
    file = path / CONFIG_FILE
    with _open(path, CONFIG_FILE, root) as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes")
    return json_object(raw, str(file))


def _open(path: Path, name: str, root: str | None) -> io.BufferedReader:
    fd = open_confined(AdapterDir(Path(path), root or os.sep), name)
    return os.fdopen(fd, "rb")


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
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict):
            raise ConfigError(f"{where}: {key} must be an object of module name -> value")
        for module, value in pattern.items():
            if key == "rank_pattern" and (isinstance(value, bool) or not isinstance(
                    value, int) or value < 1):
                raise ConfigError(f"{where}: rank_pattern[{module!r}] must be a positive "
                                  f"integer, got {value!r}")
            if key == "alpha_pattern" and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value)):
                raise ConfigError(f"{where}: alpha_pattern[{module!r}] must be a finite "
                                  f"number, got {value!r}")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool)) \
            and not (isinstance(layers, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise ConfigError(f"{where}: layers_to_transform must be a layer index or a list "
                          "of them")


def load_adapter(path: Path, name: str, int_id: int, arch: ModelArchConfig,
                 max_rank: int, expected_sha256: str | None = None,
                 root: str | None = None) -> LoRAAdapter:
    """Read and validate the PEFT adapter in directory `path` (already confined to `root`:
    see `paths.resolve_adapter`; None: "/") for a base model of architecture `arch`.

    Each file is opened once (`paths.open_confined`) and read through that descriptor.
    Every tensor's name, dtype, shape and extent are checked from the safetensors header
    before any tensor data is read; the sha256 pin is checked over the very bytes loaded.
    ConfigError on any problem."""
    path = Path(path)
    cfg = read_config(path, root)
    _check_config(cfg, path)
    weights_file = path / WEIGHTS_FILE
    with _open(path, WEIGHTS_FILE, root) as f:
        size = os.fstat(f.fileno()).st_size
        head, entries = read_header(f, size, weights_file)
        plan = _plan(entries, cfg, arch, max_rank, weights_file, path)
        data = bytearray(size - len(head))
        if f.readinto(data) != len(data) or f.read(1):
            raise ConfigError(f"{weights_file} changed while it was read")
    digest = hashlib.sha256(head)
    digest.update(data)
    sha = digest.hexdigest()
    if expected_sha256 is not None and sha != expected_sha256.lower():
        raise ConfigError(f"{weights_file}: sha256 {sha} does not match the pinned "
                          f"{expected_sha256.lower()}")
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top = 0
    for (layer, target), (a_entry, b_entry, r) in sorted(plan.items()):
        module = f"model.layers.{layer}.{_group(target, FUSED_TARGETS)}.{target}"
        a, b = a_entry.tensor(data), b_entry.tensor(data)
        if cfg.get("fan_in_fan_out"):
            a, b = a.T, b.T
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ConfigError(f"{weights_file}: {module} has non-finite weights")
        alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module,
                                     cfg.get("lora_alpha", cfg["r"])))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        for part, a_part, b_part in _split_fused(target, a, b * scale, arch):
            if (layer, part) in out:
                raise ConfigError(f"{weights_file}: layer {layer}'s {part} is adapted twice "
                                  f"(by {target} and on its own)")
            out[(layer, part)] = (a_part.contiguous(), b_part.contiguous())
        top = max(top, r)
    return LoRAAdapter(name, int_id, str(path), top, out, sha, adapter_digest(out), root)


def adapter_digest(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Hex SHA-256 of an adapter's effective weights: every (layer, target) in order with
    its A and scaled B (float32, shapes and bytes). Equal exactly when the adapter's updates
    are: the same files loaded again give the same digest, any change to the weights or to
    what scales or places them (alpha, rank, patterns, rsLoRA, targets, layers) another."""
    h = hashlib.sha256(b"tandem-lora-digest-v1")
    for (layer, target), (a, b) in sorted(weights.items()):
        h.update(f"{layer}\0{target}\0{tuple(a.shape)}\0{tuple(b.shape)}\0".encode())
        h.update(a.float().contiguous().numpy())
        h.update(b.float().contiguous().numpy())
    return h.hexdigest()


def _plan(entries: dict[str, TensorEntry], cfg: dict[str, Any], arch: ModelArchConfig,
          max_rank: int, weights_file: Path, path: Path
          ) -> dict[tuple[int, str], tuple[TensorEntry, TensorEntry, int]]:
    """(layer, target) -> (A entry, B entry, rank), every header entry checked against the
    base model and the config before any tensor data is read."""
    shapes = target_shapes(arch)
    spec = cfg["target_modules"]
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    ranks = cfg.get("rank_pattern") or {}
    fused = family(arch.architecture).fused_modules
    pairs: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for key, entry in entries.items():
        m = _KEY.match(key)
        if ".experts." in key or (m is not None and m.group(2) == "mlp"
                                  and arch.is_moe_layer(int(m.group(1)))):
            raise ConfigError(f"{weights_file}: {key[:256]!r} adapts a mixture-of-experts "
                              "MLP (its router or experts), which LoRA does not support; "
                              "adapt the attention projections (q_proj, k_proj, v_proj, "
                              "o_proj)")
        if m is None:
            raise ConfigError(f"{weights_file}: unexpected tensor {key[:256]!r} (only LoRA "
                              "A/B matrices of decoder layers are supported)")
        layer, target, ab = int(m.group(1)), m.group(3), m.group(4)
        if _group(target, fused) != m.group(2):
            supported = [*TARGETS, *fused]
            raise ConfigError(f"{weights_file}: {key!r} targets an unsupported module "
                              f"(supported for {arch.architecture}: {', '.join(supported)})")
        if layer >= arch.num_layers:
            raise ConfigError(f"{weights_file}: {key!r} names layer {layer}; the base model "
                              f"has {arch.num_layers}")
        slot = pairs.setdefault((layer, target), {})
        if ab in slot:
            raise ConfigError(f"{weights_file}: {key!r} appears twice")
        slot[ab] = entry
    if not pairs:
        raise ConfigError(f"{weights_file} holds no LoRA weights")
    plan = {}
    for (layer, target), ab in sorted(pairs.items()):
        module = f"model.layers.{layer}.{_group(target, fused)}.{target}"
        if "A" not in ab or "B" not in ab:
            raise ConfigError(f"{weights_file}: {module} has lora_A without lora_B or the "
                              "reverse")
        if not _targets(spec, module) or (layers is not None and layer not in layers):
            raise ConfigError(f"{weights_file}: {module} has weights but is not in the "
                              "adapter's target_modules / layers_to_transform")
        r = _pattern_value(ranks, module, cfg["r"])
        if r > max_rank:
            raise ConfigError(f"{path}: rank {r} exceeds max_lora_rank {max_rank}")
        n_out, n_in = shapes[target]
        want_a, want_b = (r, n_in), (n_out, r)
        if cfg.get("fan_in_fan_out"):
            want_a, want_b = want_a[::-1], want_b[::-1]
        a, b = ab["A"], ab["B"]
        if a.shape != want_a or b.shape != want_b:
            raise ConfigError(f"{weights_file}: {module} has lora_A {a.shape} and lora_B "
                              f"{b.shape}; the base model needs {want_a} and {want_b}")
        plan[(layer, target)] = (a, b, r)
    return plan
