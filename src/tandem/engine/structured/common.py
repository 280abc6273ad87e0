"""Helpers the grammar backends share: the never-allowed token mask, grammar syntax sniffing,
choice escaping."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from tandem.engine.structured.bitmask import bitmask_words

OBJECT_SCHEMA = '{"type":"object"}'  # what `json_object` compiles as
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def special_token_ids(backend_tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special added tokens (chat markers and the like)."""
    return {i for i, t in backend_tokenizer.get_added_tokens_decoder().items() if t.special}


def forbidden_row(vocab_size: int, tokenizer_vocab: int, forbidden: set[int]) -> torch.Tensor:
    """int32 [words] with 0 bits at `forbidden` ids and at ids >= tokenizer_vocab (padded
    logits rows), 1 elsewhere: AND it into a filled row."""
    allowed = torch.ones(bitmask_words(vocab_size) * 32, dtype=torch.bool)
    allowed[tokenizer_vocab:] = False
    if forbidden:
        allowed[torch.tensor(sorted(forbidden), dtype=torch.long)] = False
    return pack_bits(allowed)


def only_row(vocab_size: int, ids: tuple[int, ...]) -> torch.Tensor:
    """int32 [words] with only `ids` allowed."""
    allowed = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.bool)
    allowed[torch.tensor(ids, dtype=torch.long)] = True
    return pack_bits(allowed)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [32 * words] -> int32 [words] (bit j of word i = entry 32 * i + j)."""
    bits = allowed.reshape(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    words = bits.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def is_gbnf(grammar: str) -> bool:
    """True for GBNF / xgrammar EBNF (`name ::= ...` rules), False for Lark (`name: ...`)."""
    return bool(_GBNF_RULE.search(grammar))


def choice_literal(text: str) -> str:
    """A double-quoted grammar literal matching `text` exactly (JSON string escapes, which
    both GBNF and Lark literals accept)."""
    return json.dumps(text, ensure_ascii=False)
