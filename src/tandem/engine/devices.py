"""Which device and dtype an engine runs on: `resolve_device`, `resolve_dtype`.

Nothing falls back silently: "auto" picks the first CUDA device when torch sees one and the
CPU otherwise (and says which in the log); an explicit CUDA device that cannot be used is a
`ConfigError` naming the reason (a CPU-only torch build, no visible device, an index out of
range).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from tandem.engine.config import check_device_name
from tandem.engine.cpu_isa import cpu_isa
from tandem.engine.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_type(name: str) -> str:
    """The device type `name` asks for ("auto" resolved), without checking it is usable."""
    check_device_name(name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name.split(":")[0]


def _visible() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def _no_device_reason() -> str:
    """Why torch sees no CUDA device (its own words where it has them)."""
    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/AssertionError
        return str(exc).strip().splitlines()[0]
    return "torch.cuda.device_count() is 0"


def resolve_device(name: str) -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> a usable `torch.device` (cuda = cuda:0).

    Raises ConfigError for a malformed name or a CUDA device this process cannot use.
    """
    check_device_name(name)
    if name == "auto":
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        logger.info("device auto: %s", device if device.type == "cuda"
                    else "cpu (torch sees no CUDA device)")
        return device
    if name == "cpu":
        return torch.device("cpu")
    index = int(name.partition(":")[2] or 0)
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        raise ConfigError(
            f"device {name!r} needs CUDA, but this torch build ({torch.__version__}) is "
            "CPU-only; install a CUDA build of torch (e.g. the tandem CUDA image) or use "
            "--device cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"device {name!r}: no CUDA device is visible to this process ({_visible()}; "
            f"{_no_device_reason()}); check the GPU request, the driver and "
            "CUDA_VISIBLE_DEVICES, or use --device cpu")
    if index >= count:
        raise ConfigError(
            f"device {name!r}: index {index} is out of range, {count} CUDA device(s) "
            f"visible ({_visible()}); indices count the visible devices from 0")
    return torch.device("cuda", index)


def checkpoint_dtype(model: Path | None) -> str | None:
    """The dtype a Hugging Face checkpoint directory declares in its config.json
    (`torch_dtype`, or `dtype` in newer files), or None (GGUF files, no config, no dtype)."""
    config = None if model is None else model / "config.json"
    if config is None or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    value = data.get("torch_dtype") or data.get("dtype") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def resolve_dtype(name: str, device: torch.device, model: Path | None = None) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA (float16 where the GPU lacks bfloat16); on the CPU
    bfloat16 for a checkpoint stored in bfloat16 (`model`'s config.json) where the CPU
    multiplies bfloat16 in hardware (`cpu_isa` level avx512_bf16 or above), else float32
    (GGUF files such as the bundled model included); else the named dtype ("float32",
    "bfloat16", "float16")."""
    if name == "auto":
        if device.type != "cuda":
            if (checkpoint_dtype(model) == "bfloat16"
                    and cpu_isa().at_least("avx512_bf16")):
                return torch.bfloat16
            return torch.float32
        if torch.cuda.get_device_capability(device) >= (8, 0):  # Ampere and later
            return torch.bfloat16
        logger.warning("dtype auto: %s (compute capability < 8.0) has no bfloat16 "
                       "support; using float16", device)
        return torch.float16
    if name not in DTYPES:
        raise ConfigError(f"dtype must be 'auto' or one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]
