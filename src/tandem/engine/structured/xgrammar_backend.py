"""The xgrammar backend (https://github.com/mlc-ai/xgrammar).

`json` compiles with `compile_json_schema` (strict mode: no properties or items beyond the
schema's; any whitespace between tokens unless `disable_any_whitespace`, then the compact
separators `,` and `:`), `json_object` as the schema
`{"type": "object"}`, `regex` with `compile_regex`, `choice` as an EBNF alternation of the
quoted strings, `grammar` with `compile_grammar` when it is GBNF / EBNF (`root ::= ...`) and
with `compile_lark` otherwise (Lark, whose start rule is `start`). The tokenizer's special
added tokens (other than the stop tokens) are never allowed. Importing this module imports
xgrammar, which needs `transformers`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from tandem.engine.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from tandem.engine.structured.common import (
    OBJECT_SCHEMA,
    choice_literal,
    forbidden_row,
    is_gbnf,
    only_row,
    special_token_ids,
)
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError


class XGrammarMatcher(GrammarMatcher):
    """A matcher over one `xgr.GrammarMatcher` (see GrammarMatcher for the contract)."""

    _g: XGrammarCompiled

    def __init__(self, grammar: XGrammarCompiled) -> None:
        super().__init__(grammar)
        self._m = xgr.GrammarMatcher(grammar.grammar, override_stop_tokens=list(
            grammar.backend.stop_token_ids))

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        forbidden, limit = self._g.backend.never, self._g.backend.tokenizer_vocab_size
        done = 0
        for t in tokens:
            t = int(t)
            if t in forbidden or not 0 <= t < limit or not self._m.accept_token(t):
                if done:
                    self._m.rollback(done)
                return False
            done += 1
        self._n += done
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        forbidden, limit = self._g.backend.never, self._g.backend.tokenizer_vocab_size
        done = 0
        for t in tokens:
            t = int(t)
            if t in forbidden or not 0 <= t < limit or not self._m.accept_token(t):
                break
            done += 1
        if done:
            self._m.rollback(done)
        return done

    def _rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        backend = self._g.backend
        if self._m.is_terminated():
            bitmask[row].copy_(backend.stop_row)
            return
        self._m.fill_next_token_bitmask(bitmask, row)
        bitmask[row].bitwise_and_(backend.forbidden_row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def can_terminate(self) -> bool:
        return not self._m.is_terminated() and self._m.is_completed()


class XGrammarCompiled(CompiledGrammar):
    """`grammar`: the `xgr.CompiledGrammar`."""

    backend: XGrammarBackend
    matcher_class = XGrammarMatcher


class XGrammarBackend(GrammarBackend):
    """xgrammar over the tokenizer's decoded vocabulary, masks `vocab_size` ids wide."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int | None = None) -> None:
        super().__init__(tokenizer, vocab_size)
        encoded: list[str] = [""] * vocab_size
        for text, i in self.backend_tokenizer.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = text
        try:
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(self.backend_tokenizer.to_str())
            self.info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                          stop_token_ids=list(self.stop_token_ids),
                                          add_prefix_space=meta["add_prefix_space"])
        except Exception as exc:
            raise StructuredOutputsError(
                f"structured outputs are unavailable: xgrammar cannot use the model's "
                f"tokenizer ({_message(exc)})") from None
        self.never = special_token_ids(self.backend_tokenizer) - set(self.stop_token_ids)
        self.forbidden_row = forbidden_row(vocab_size, self.tokenizer_vocab_size, self.never)
        self.stop_row = only_row(vocab_size, self.stop_token_ids)
        threads = max_threads or min(8, os.cpu_count() or 1)
        # Tandem's GrammarCompiler caches compiled grammars; xgrammar's own cache stays off
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads,
                                             cache_enabled=False)

    def compile(self, spec: StructuredOutputs) -> XGrammarCompiled:
        spec.validate()
        c = self._compiler
        # compact separators without whitespace, as llguidance's
        ws = {"any_whitespace": not spec.disable_any_whitespace, "separators": (",", ":")}
        try:
            if spec.json is not None:
                out = c.compile_json_schema(spec.json, strict_mode=True, **ws)
            elif spec.json_object:
                out = c.compile_json_schema(OBJECT_SCHEMA, **ws)
            elif spec.regex is not None:
                out = c.compile_regex(spec.regex)
            elif spec.choice is not None:
                out = c.compile_grammar(
                    "root ::= " + " | ".join(choice_literal(s) for s in spec.choice))
            else:
                assert spec.grammar is not None
                out = (c.compile_grammar(spec.grammar) if is_gbnf(spec.grammar)
                       else c.compile_lark(spec.grammar))
        except StructuredOutputsError:
            raise
        except Exception as exc:  # the library raises RuntimeError / ValueError / TypeError
            raise StructuredOutputsError(
                f"cannot compile the {spec.kind} constraint: {_message(exc)}") from None
        return XGrammarCompiled(self, spec, out)


def _message(exc: BaseException) -> str:
    """The library's message without its `[time] file.cc:line: ` prefix."""
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    return rest.strip() if sep and ".cc:" in head else text
