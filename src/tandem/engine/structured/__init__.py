"""Grammar-constrained decoding: backends (xgrammar, llguidance) behind one interface, an
asynchronous compile cache, and token bitmask helpers. See `base` for the contract; the
constraint itself is `tandem.protocol.structured_outputs.StructuredOutputs`.

Importing the package (or `base`) loads neither torch nor a grammar library (the engine's
configuration, which the torch-free CLI parsers read, names the backends): the names below
come from their modules on first access."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tandem.engine.structured.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    available_backends,
    default_backend,
    get_backend,
    register_backend,
)
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError

if TYPE_CHECKING:
    from tandem.engine.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_words
    from tandem.engine.structured.compiler import CompileQueueFull, GrammarCompiler

_LAZY = {"allocate_bitmask": "bitmask", "apply_bitmask": "bitmask", "bitmask_words": "bitmask",
         "CompileQueueFull": "compiler", "GrammarCompiler": "compiler"}

__all__ = ["CompileQueueFull", "CompiledGrammar", "GrammarBackend", "GrammarCompiler",
           "GrammarMatcher", "StructuredOutputs", "StructuredOutputsError", "allocate_bitmask",
           "apply_bitmask", "available_backends", "bitmask_words", "default_backend",
           "get_backend", "register_backend"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
