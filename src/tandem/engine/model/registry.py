"""The model families, keyed by the `architectures` of a Hugging Face config.json.

Each family module (`model/llama.py`, `model/qwen3.py`, ...) calls `register` at import with
a `Family`: its HF class names, a config parser (config.json dict -> `ModelArchConfig`), its
model class (a `DecoderForCausalLM`) and, where its checkpoint names differ from the
standard ones, a normaliser (`split`: e.g. Phi-3's fused `qkv_proj` into q/k/v rows), so
tensor parallelism, quantization and LoRA only ever see the standard names. Family modules
are imported on first use (`_FAMILY_MODULES`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.errors import ConfigError

if TYPE_CHECKING:
    from tandem.engine.model.config import ModelArchConfig
    from tandem.engine.model.decoder import DecoderForCausalLM

# modules under tandem.engine.model that register families (one that does not exist is
# skipped: families are added by adding their module)
_FAMILY_MODULES = ("llama", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe")


@dataclass(frozen=True)
class Part:
    """Where (part of) a checkpoint tensor goes: under `name`, its rows [start, start +
    rows) along dim 0 (start None: the whole tensor, renamed)."""

    name: str
    start: int | None = None
    rows: int | None = None


# (config, checkpoint tensor name) -> its parts under standard names; None: as it is
Splitter = Callable[["ModelArchConfig", str], "list[Part] | None"]


@dataclass(frozen=True)
class Family:
    """One family: `name` is `ModelArchConfig.architecture`."""

    name: str
    hf_classes: tuple[str, ...]  # config.json `architectures` entries
    model_types: tuple[str, ...]  # config.json `model_type` (when `architectures` is absent)
    parse: Callable[[dict[str, Any]], ModelArchConfig]  # config.json -> config (no eos ids
    # from generation_config.json: the loader adds them)
    model_class: type[DecoderForCausalLM]
    split: Splitter | None = None
    # modules fused in its checkpoints (and in PEFT adapters trained on them), which `split`
    # turns into the standard ones ("qkv_proj", "gate_up_proj")
    fused_modules: tuple[str, ...] = ()


_FAMILIES: dict[str, Family] = {}
_SEQ: dict[str, int] = {}  # family name -> when it first registered (a module's own order)
_loaded = False


def register(family: Family) -> None:
    """Add `family` (a family module calls this at import). Names must be unique."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"model family {family.name!r} registered twice")
    taken = {c for f in _FAMILIES.values() if f.name != family.name for c in f.hf_classes}
    if taken & set(family.hf_classes):
        raise ValueError(f"HF classes {sorted(taken & set(family.hf_classes))} registered twice")
    _FAMILIES[family.name] = family
    _SEQ.setdefault(family.name, len(_SEQ))


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _FAMILY_MODULES:
        full = f"tandem.engine.model.{module}"
        try:
            importlib.import_module(full)
        except ModuleNotFoundError as e:
            if e.name != full:
                raise


def families() -> dict[str, Family]:
    """Every registered family by name: the built-in ones in `_FAMILY_MODULES` order (and
    each module's own order), whatever was imported first, then any others as registered."""
    _load()
    prefix = f"{__package__}."

    def rank(f: Family) -> tuple[int, int]:
        module = f.model_class.__module__.removeprefix(prefix)
        place = (_FAMILY_MODULES.index(module) if module in _FAMILY_MODULES
                 else len(_FAMILY_MODULES))
        return place, _SEQ[f.name]

    return {f.name: f for f in sorted(_FAMILIES.values(), key=rank)}


def supported_architectures() -> tuple[str, ...]:
    """The family names (`ModelArchConfig.architecture` values)."""
    return tuple(families())


def hf_architectures() -> dict[str, str]:
    """HF class name (config.json `architectures`) -> family name."""
    return {c: f.name for f in families().values() for c in f.hf_classes}


def hf_model_types() -> dict[str, str]:
    """config.json `model_type` -> family name."""
    return {t: f.name for f in families().values() for t in f.model_types}


def family(name: str) -> Family:
    """The family of `ModelArchConfig.architecture` `name` (ConfigError if none)."""
    found = families().get(name)
    if found is None:
        raise ConfigError(f"unsupported architecture {name!r}; supported: "
                          f"{', '.join(supported_architectures())}")
    return found


def family_for_hf(cfg: dict[str, Any], where: str) -> Family:
    """The family of a config.json dict: its first registered `architectures` entry, else
    its `model_type`. ConfigError naming what it declares and listing what is supported."""
    archs = cfg.get("architectures") or []
    by_class, by_type = hf_architectures(), hf_model_types()
    name = next((by_class[a] for a in archs if a in by_class), None)
    if name is None:
        name = by_type.get(str(cfg.get("model_type")))
    if name is None:
        raise ConfigError(f"{where}: unsupported architecture {archs or cfg.get('model_type')!r}"
                          f"; supported: {', '.join(by_class)}")
    return _FAMILIES[name]


def model_class(cfg: ModelArchConfig) -> type[DecoderForCausalLM]:
    """The model class that builds `cfg`."""
    return family(cfg.architecture).model_class


def build_model(cfg: ModelArchConfig, backend: Any, max_positions: int | None = None,
                ops: Any = None) -> DecoderForCausalLM:
    """`model_class(cfg)(cfg, backend, max_positions, ops)` (on the current device)."""
    return model_class(cfg)(cfg, backend, max_positions=max_positions, ops=ops)
