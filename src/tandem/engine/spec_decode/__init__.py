"""Speculative decoding: proposers guess tokens, the target verifies them in one pass."""

from __future__ import annotations

import importlib

from tandem.engine.spec_decode.base import (
    PROPOSERS,
    Proposal,
    Proposer,
    ProposerContext,
    build_proposer,
    register_proposer,
)
from tandem.engine.spec_decode.config import SpeculativeConfig

BUILTIN = ("ngram", "draft", "eagle")  # modules of this package, each registering itself


def load_builtin_proposers() -> None:
    """Import the built-in proposers (they register on import); torch-heavy ones lazily."""
    for name in BUILTIN:
        try:
            importlib.import_module(f"tandem.engine.spec_decode.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tandem.engine.spec_decode.{name}":
                raise


__all__ = ["PROPOSERS", "Proposal", "Proposer", "ProposerContext", "SpeculativeConfig",
           "build_proposer", "load_builtin_proposers", "register_proposer"]
