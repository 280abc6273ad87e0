"""Grammar-constrained decoding: backends (xgrammar, llguidance) behind one interface, an
asynchronous compile cache, and token bitmask helpers. See `base` for the contract; the
constraint itself is `tandem.protocol.structured_outputs.StructuredOutputs`."""

from tandem.engine.structured.base import (
                                           CompiledGrammar,
                                           GrammarBackend,
                                           GrammarMatcher,
                                           available_backends,
                                           default_backend,
                                           get_backend,
                                           register_backend,
)
from tandem.engine.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_words
from tandem.engine.structured.compiler import CompileQueueFull, GrammarCompiler
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError

__all__ = ["CompileQueueFull", "CompiledGrammar", "GrammarBackend", "GrammarCompiler",
           "GrammarMatcher", "StructuredOutputs", "StructuredOutputsError", "allocate_bitmask",
           "apply_bitmask", "available_backends", "bitmask_words", "default_backend",
           "get_backend", "register_backend"]
