"""The grammar-backend interface and its registry (modelled on vLLM's v1/structured_output).

A `GrammarBackend` is built once per engine from the tokenizer and the model's logits width
(`vocab_size`, which may exceed the tokenizer's: padded ids are always masked). Its
`compile(spec)` turns a validated `StructuredOutputs` into a `CompiledGrammar` (slow,
thread-safe, shareable by every request with the same `spec.key()`), whose `matcher()` gives
each request (each sample, for n > 1) its own `GrammarMatcher`.

Every failure to compile is a `StructuredOutputsError` with the library's message, never
another exception type. The stop tokens (the tokenizer's EOS ids) are allowed exactly when
the grammar can end; accepting one terminates the matcher.

Backends register by name (`register_backend`); "xgrammar" and "llguidance" are built in and
imported only when first asked for, so importing this package loads neither library.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError

if TYPE_CHECKING:
    import torch

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarMatcher", "StructuredOutputsError",
           "available_backends", "default_backend", "get_backend", "register_backend",
           "tokenizer_parts"]

# Measured on the 2-core CPU with SmolLM2's 49k vocabulary (bench/grammar_backends.py,
# bench/results/grammar-backends-2026-12-05.json): llguidance compiles a schema ~9x faster
# (median 0.8 ms vs 6.9 ms, p90 3.7 vs 12.7 ms: a cold grammar's time to first token) and
# masks ~3x slower (27 vs 8 us per row at batch 16: 0.4 ms of a ~74 ms batch-16 decode step,
# filled while the forward runs); xgrammar 0.2.9 also refuses valid JSON escapes inside
# length-bounded strings (2 of 24 random schemas' instances), and needs transformers.
# Compile time and correctness decide: llguidance.
DEFAULT_BACKEND = "llguidance"
_BUILTIN = {"xgrammar": "tandem.engine.structured.xgrammar_backend:XGrammarBackend",
            "llguidance": "tandem.engine.structured.llguidance_backend:LLGuidanceBackend"}
# llguidance is a dependency; xgrammar is optional (it needs transformers, and triton on Linux)
_PACKAGES = {"xgrammar": "xgrammar>=0.2.9,<0.3", "llguidance": "llguidance>=1.9.1,<2"}
_REGISTRY: dict[str, type[GrammarBackend]] = {}
_LOCK = threading.Lock()


class GrammarMatcher(ABC):
    """The grammar state of one sequence. Not thread-safe: one owner at a time.

    `accept_tokens` is all-or-nothing: it advances over every token and returns True, or, if
    any token is not allowed (or the matcher has terminated), leaves the state exactly as it
    was before the call and returns False. Accepting a stop token terminates the matcher; a
    terminated matcher accepts nothing more (`rollback` past the stop token revives it)."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self._g = grammar
        self._n = 0  # tokens accepted, net of rollbacks

    @abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance over `tokens` (all or none, see the class doc)."""

    @abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here, without advancing (for
        speculative drafts: the matcher is unchanged afterwards)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (0 <= num_tokens <= num_accepted, else
        ValueError)."""
        if not 0 <= num_tokens <= self._n:
            raise ValueError(f"cannot roll back {num_tokens} of {self._n} accepted tokens")
        if num_tokens:
            self._rollback(num_tokens)
            self._n -= num_tokens

    @abstractmethod
    def _rollback(self, num_tokens: int) -> None:
        """The library's rollback of 1 <= `num_tokens` <= num_accepted tokens (`_n` is not
        yet reduced)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 [rows, ceil(vocab_size /
        32)] on CPU, bit j of word i = token 32 * i + j; 1 = allowed). Ids past the
        tokenizer's vocabulary are 0; stop tokens are 1 exactly when the grammar can end; a
        terminated matcher allows only the stop tokens. The state does not change."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """True when the text so far is a complete match (a stop token is allowed now)."""

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (the stop token included), net of rollbacks."""
        return self._n


class CompiledGrammar:
    """A compiled constraint: immutable, shared by all requests with the same spec key.
    `grammar` is the library's compiled form; a backend's subclass names its matcher
    class (built from this object)."""

    matcher_class: type[GrammarMatcher]

    def __init__(self, backend: GrammarBackend, spec: StructuredOutputs, grammar: Any) -> None:
        self.backend, self.spec, self.grammar = backend, spec, grammar

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        return self.matcher_class(self)


class GrammarBackend(ABC):
    """One grammar library bound to one tokenizer and logits width."""

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: a `tandem.protocol.tokenizer.Tokenizer`, an HF fast tokenizer or a
        `tokenizers.Tokenizer` (see `tokenizer_parts`); `vocab_size`: the model's logits
        width (>= the tokenizer's vocabulary; the extra ids are never allowed). Raises
        StructuredOutputsError ("structured outputs are unavailable: ...") for a tokenizer
        the library cannot use, or one without EOS."""
        self.backend_tokenizer, self.stop_token_ids = tokenizer_parts(tokenizer)
        self.tokenizer_vocab_size = self.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size < self.tokenizer_vocab_size:
            raise StructuredOutputsError(
                f"structured outputs are unavailable: the model's vocab_size {vocab_size} is "
                f"smaller than its tokenizer's vocabulary ({self.tokenizer_vocab_size} ids)")
        if not self.stop_token_ids:
            raise StructuredOutputsError("structured outputs are unavailable: the tokenizer "
                                         "has no EOS token, so a grammar could never end")
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile a constraint (slow; thread-safe). Validates it first; raises
        StructuredOutputsError for anything that cannot be compiled, never another type."""


def tokenizer_parts(tokenizer: Any) -> tuple[Any, tuple[int, ...]]:
    """(`tokenizers.Tokenizer`, stop token ids) of a Tandem tokenizer (its `backend` and
    `eos_token_ids`), an HF fast tokenizer (`backend_tokenizer`, `eos_token_id`) or a bare
    `tokenizers.Tokenizer` (no stop tokens known: the caller must refuse it)."""
    from tandem.protocol.tokenizer import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.backend, tuple(tokenizer.eos_token_ids)
    if hasattr(tokenizer, "backend_tokenizer"):
        eos = getattr(tokenizer, "eos_token_id", None)
        return tokenizer.backend_tokenizer, (() if eos is None else (int(eos),))
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "to_str"):
        return tokenizer, ()
    raise TypeError(f"unsupported tokenizer type {type(tokenizer).__name__}")


def register_backend(name: str, cls: type[GrammarBackend]) -> None:
    """Make `cls` available as `get_backend(name)` (replacing any earlier one)."""
    with _LOCK:
        _REGISTRY[name] = cls


def available_backends() -> tuple[str, ...]:
    """Every registered or built-in backend name, sorted."""
    return tuple(sorted(set(_REGISTRY) | set(_BUILTIN)))


def default_backend() -> str:
    """The backend used unless configured otherwise (the faster one here, measured)."""
    return DEFAULT_BACKEND


def get_backend(name: str) -> type[GrammarBackend]:
    """The backend class registered as `name` (built-ins are imported on first use);
    ValueError naming the choices for an unknown name; StructuredOutputsError naming the
    package to install for a built-in whose library (or a library it needs) is missing."""
    with _LOCK:
        cls = _REGISTRY.get(name)
    if cls is not None:
        return cls
    target = _BUILTIN.get(name)
    if target is None:
        raise ValueError(f"unknown structured outputs backend {name!r} (choose from "
                         f"{', '.join(available_backends())})")
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise StructuredOutputsError(
            f"the structured outputs backend {name!r} is not installed ({exc}): "
            f"pip install '{_PACKAGES[name]}'") from None
    register_backend(name, cls)
    return cls
