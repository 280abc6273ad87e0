"""The llguidance backend (https://github.com/guidance-ai/llguidance).

`json` compiles with `LLMatcher.grammar_from_json_schema` (whitespace between tokens unless
`disable_any_whitespace`; unknown schema keywords are refused; an object schema with
`properties` and no `additionalProperties` gets `additionalProperties: false`, as xgrammar's
strict mode and OpenAI's strict schemas have it), `json_object` as the schema
`{"type": "object"}`, `regex` with `grammar_from_regex`, `choice` as a Lark alternation of the
quoted strings, `grammar` as Lark when it is Lark (`start: ...`) and converted from GBNF /
EBNF (`root ::= ...`) by llguidance's own converter otherwise; a grammar it cannot convert is
a StructuredOutputsError. A compiled grammar is a template matcher (construction compiles it,
with the GIL released); each request's matcher is a deep copy. The tokenizer's special tokens
are never allowed, the stop tokens only where the grammar can end. Needs no `transformers`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import torch

from tandem.engine.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from tandem.engine.structured.common import (
    OBJECT_SCHEMA,
    choice_literal,
    forbidden_row,
    is_gbnf,
    only_row,
)
from tandem.protocol.structured_outputs import (
    DATA_KEYWORDS,
    StructuredOutputs,
    StructuredOutputsError,
)


def strict_objects(node: Any, data: bool = False) -> Any:
    """`node` (a parsed schema) with `additionalProperties: false` added to every schema
    object that lists `properties` and says nothing about additional ones (in place)."""
    if isinstance(node, dict):
        if not data and isinstance(node.get("properties"), dict) \
                and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key, child in node.items():
            # the values under "properties" / "$defs" are schemas even where a key is "enum"
            named = key in ("properties", "$defs", "definitions", "patternProperties")
            if isinstance(child, dict) and named and not data:
                for sub in child.values():
                    strict_objects(sub)
            else:
                strict_objects(child, data or key in DATA_KEYWORDS)
    elif isinstance(node, list):
        for child in node:
            strict_objects(child, data)
    return node


class LLGuidanceMatcher(GrammarMatcher):
    """A matcher over one `llguidance.LLMatcher` (see GrammarMatcher for the contract). The
    library's matcher enters a permanent error state on a rejected token, so every token is
    validated before it is consumed."""

    _g: LLGuidanceCompiled

    def __init__(self, grammar: LLGuidanceCompiled) -> None:
        super().__init__(grammar)
        self._m = grammar.grammar.deep_copy()
        self._terminated = False

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        tokens = [int(t) for t in tokens]
        if self._terminated:
            return not tokens
        body, end = self._split(tokens)
        if end is not None and (end not in self._g.backend.stop_set
                                or len(body) != len(tokens) - 1):
            return False  # an id outside the vocabulary, or tokens after a stop token
        if body and self._m.validate_tokens(body) < len(body):
            return False
        if body and not self._m.consume_tokens(body):  # validated: cannot happen
            raise RuntimeError(f"llguidance rejected validated tokens: {self._m.get_error()}")
        if end is not None and not self._m.is_accepting():
            if body:
                self._m.rollback(len(body))
            return False
        self._n += len(tokens)
        # the stop token is recorded here, not consumed by llguidance (rollback stays exact)
        self._terminated = end is not None
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        if self._terminated or not tokens:
            return 0
        body, end = self._split([int(t) for t in tokens])
        n = self._m.validate_tokens(body) if body else 0
        if n < len(body) or end not in self._g.backend.stop_set:
            return n
        if body:
            self._m.consume_tokens(body)
        ok = self._m.is_accepting()
        if body:
            self._m.rollback(len(body))
        return n + 1 if ok else n

    def _split(self, tokens: list[int]) -> tuple[list[int], int | None]:
        """(the tokens before the first stop token or id outside the tokenizer's vocabulary,
        that token or None). Outside ids are never allowed (the library would raise)."""
        stops, limit = self._g.backend.stop_set, self._g.backend.tokenizer_vocab_size
        for i, t in enumerate(tokens):
            if t in stops or not 0 <= t < limit:
                return tokens[:i], t
        return tokens, None

    def _rollback(self, num_tokens: int) -> None:
        inner = num_tokens - 1 if self._terminated else num_tokens
        if inner and not self._m.rollback(inner):
            raise RuntimeError(f"llguidance cannot roll back: {self._m.get_error()}")
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        backend = self._g.backend
        target = bitmask[row]
        if self._terminated:
            target.copy_(backend.stop_row)
            return
        assert target.is_contiguous() and target.dtype == torch.int32 and target.device.type \
            == "cpu", "the bitmask must be a contiguous int32 CPU tensor"
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), backend.mask_bytes)
        if backend.pad_tail:
            target.bitwise_and_(backend.forbidden_row)

    def is_terminated(self) -> bool:
        return self._terminated

    def can_terminate(self) -> bool:
        return not self._terminated and self._m.is_accepting()


class LLGuidanceCompiled(CompiledGrammar):
    """`grammar`: the template `llg.LLMatcher` each request's matcher deep-copies."""

    backend: LLGuidanceBackend
    matcher_class = LLGuidanceMatcher


class LLGuidanceBackend(GrammarBackend):
    """llguidance over the tokenizer's own `tokenizer.json`, masks `vocab_size` ids wide."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        try:
            self.tokenizer = llg.LLTokenizer(self.backend_tokenizer.to_str(),
                                             n_vocab=self.tokenizer_vocab_size,
                                             eos_token=list(self.stop_token_ids))
        except Exception as exc:
            raise StructuredOutputsError(
                f"structured outputs are unavailable: llguidance cannot use the model's "
                f"tokenizer ({exc})") from None
        self.stop_set = frozenset(self.stop_token_ids)
        # the library fills the words of the tokenizer's ids; padded logits ids are cleared
        self.mask_bytes = ((self.tokenizer_vocab_size + 31) // 32) * 4
        self.pad_tail = vocab_size > self.tokenizer_vocab_size
        self.forbidden_row = forbidden_row(vocab_size, self.tokenizer_vocab_size, set())
        self.stop_row = only_row(vocab_size, self.stop_token_ids)

    def grammar_text(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar (JSON) of a validated spec; StructuredOutputsError if the
        schema is not an object or the GBNF cannot be converted."""
        any_ws = not spec.disable_any_whitespace
        try:
            if spec.json is not None or spec.json_object:
                schema = strict_objects(json.loads(spec.json)) if spec.json else OBJECT_SCHEMA
                return llg.LLMatcher.grammar_from_json_schema(
                    schema, overrides={"whitespace_flexible": any_ws})
            if spec.regex is not None:
                return llg.LLMatcher.grammar_from_regex(spec.regex)
            if spec.choice is not None:
                return llg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(choice_literal(s) for s in spec.choice))
            assert spec.grammar is not None
            return llg.grammar_from("gbnf" if is_gbnf(spec.grammar) else "lark", spec.grammar)
        except Exception as exc:
            raise StructuredOutputsError(
                f"cannot compile the {spec.kind} constraint: {exc}") from None

    def compile(self, spec: StructuredOutputs) -> LLGuidanceCompiled:
        spec.validate()
        grammar = self.grammar_text(spec)
        try:
            template = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        except Exception as exc:  # misuse only: grammar errors put the matcher in error state
            raise StructuredOutputsError(
                f"cannot compile the {spec.kind} constraint: {exc}") from None
        if template.is_error():
            raise StructuredOutputsError(
                f"cannot compile the {spec.kind} constraint: {template.get_error()}")
        return LLGuidanceCompiled(self, spec, template)
