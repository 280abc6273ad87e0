"""Chunked long-text encoding equals one whole-text encode, token for token."""

from __future__ import annotations

import random

import pytest

from tandem.protocol.bundled import find_bundled_gguf
from tandem.protocol.long_text import ChunkedEncoder, chunkable, cut_points
from tandem.protocol.tokenizer import LONG_TEXT_CHARS, Tokenizer

PIECES = ["the", "The", "cat", "naïve", "Ünïcödé", "日本語", "emoji🚀", "don't", "it's", "x",
          "42", "3.14159", "1,000", "-", "--", "...", "!", "?", "(", ")", "'", '"', "/", "\\",
          "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", "\n\n", "\t", " ", "  ", "   ",
          "\r\n", "über", "ça", "ß", "İ", "ﬁ", "a\u0301", "ΑΒΓ", "def", "foo_bar", "camelCase"]


def _random_text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        out.append(rng.choice(PIECES))
        out.append(" " if rng.random() < 0.6 else rng.choice(["", "\n", "  ", ", ", ". "]))
    return "".join(out)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(find_bundled_gguf())


def test_the_bundled_tokenizer_qualifies(tok):
    assert chunkable(tok.backend)


@pytest.mark.parametrize("seed", range(40))
def test_tiny_chunks_give_the_whole_text_tokens(tok, seed):
    """Chunks of a few characters put a cut at nearly every safe space."""
    rng = random.Random(seed)
    text = _random_text(rng, rng.randrange(20, 400))
    enc = ChunkedEncoder(tok.backend, chunk_chars=rng.choice([1, 3, 7, 50]))
    assert enc.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids
    assert enc.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids  # cached


def test_cuts_are_spaces_between_letters_and_shared_prefixes_cut_alike():
    text = "alpha beta, gamma 12 delta\nepsilon zeta eta"
    cuts = cut_points(text, 1)
    assert cuts and all(text[p] == " " and text[p - 1].isalpha() and text[p + 1].isalpha()
                        for p in cuts)
    longer = text + " theta iota kappa"
    assert cut_points(longer, 5)[:len(cut_points(text, 5)) - 1] == cut_points(text, 5)[:-1]


def test_long_prompts_use_chunks_and_the_cache(tok):
    rng = random.Random(3)
    doc = _random_text(rng, 6000)
    assert len(doc) > LONG_TEXT_CHARS
    for q in ("First question?", "Second, different question?"):
        text = doc + " " + q
        assert tok.encode(text, add_special_tokens=False) == \
            tok.backend.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == tok.backend.encode(text).ids  # with the model's specials
    assert tok._chunked.hits > 0  # the shared document's chunks were reused


def test_tokenizers_that_might_merge_across_spaces_are_not_chunked():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers

    bpe = Backend(models.BPE(vocab={"a": 0, "b": 1, " ": 2}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()  # SentencePiece-style: not byte-level
    assert not chunkable(bpe)
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not chunkable(bpe)  # a prefix space per chunk would change tokens
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.normalizer = normalizers.Lowercase()
    assert not chunkable(bpe)
