"""Chunked long-text encoding equals one whole-text encode, token for token."""

from __future__ import annotations

import random

import pytest

from tandem.protocol.bundled import find_bundled_gguf
from tandem.protocol.long_text import ChunkedEncoder, chunkable, cut_points, split_words
from tandem.protocol.tokenizer import Tokenizer

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


def test_a_new_message_reuses_known_words(tok):
    enc = ChunkedEncoder(tok.backend)
    a = "Where is my parcel with the blue book, ordered on Monday?"
    b = "Where is my order with the red book, shipped on Friday?"
    assert split_words(b) == ["Where", " is", " my", " order", " with", " the", " red",
                              " book,", " shipped", " on", " Friday?"]
    assert enc.encode(a) == tok.backend.encode(a, add_special_tokens=False).ids
    assert enc.word_hits == 0
    assert enc.encode(b) == tok.backend.encode(b, add_special_tokens=False).ids
    # Where, is, my, with, the, book, and on: only the rest was encoded
    assert enc.word_hits == 7
    hits = enc.hits
    assert enc.encode(b) == tok.backend.encode(b, add_special_tokens=False).ids
    assert enc.hits == hits + 1  # the whole message is cached now


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
    assert len(doc) > 3 * tok._chunked.chunk_chars
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


def _byte_level_bpe():
    """A tiny byte-level BPE (every byte a token, a few merges) with overlapping added tokens,
    normalized and not."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("<", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bpe = Backend(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken("<a>", normalized=False),
                            AddedToken("<ab>", normalized=False),
                            AddedToken("b>c", normalized=True)])
    bpe.add_tokens([AddedToken("the<", normalized=True), AddedToken("[x]", normalized=False)])
    return bpe


@pytest.mark.parametrize("seed", range(20))
def test_the_added_token_split_matches_the_library(seed):
    """Overlapping added tokens, normalized or not: the two-pass leftmost-longest split
    gives exactly the library's tokens."""
    bpe = _byte_level_bpe()
    assert chunkable(bpe)
    rng = random.Random(seed)
    bits = ["<a>", "<ab>", "b>c", "the<", "[x]", "<", "a", "b", ">", "c", "the", " the", " ", "x",
            "[", "]", "1", "22", "\n"]
    enc = ChunkedEncoder(bpe, chunk_chars=rng.choice([2, 5, 4096]))
    for _ in range(30):
        text = "".join(rng.choice(bits) for _ in range(rng.randrange(1, 40)))
        assert enc.encode(text) == bpe.encode(text, add_special_tokens=False).ids, text
        assert enc.encode(text) == bpe.encode(text, add_special_tokens=False).ids, text


def test_chat_prompts_reuse_the_cached_messages(tok):
    system = "You are a careful assistant. " * 20
    for user in ("What is 2 + 2?", "Name a river in France.", "Spell 'naïve' backwards."):
        text = tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": user}],
                                       add_generation_prompt=True)
        before = tok._chunked.hits
        got = tok.encode(text, add_special_tokens=False)
        assert got == tok.backend.encode(text, add_special_tokens=False).ids
        hits = tok._chunked.hits - before
    assert hits >= 2  # the system message and the template's fixed pieces came from the cache


def test_tokens_that_strip_spaces_turn_the_split_off():
    from tokenizers import AddedToken

    from tandem.protocol.long_text import added_token_splitter

    bpe = _byte_level_bpe()
    assert added_token_splitter(bpe) is not None
    bpe.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert added_token_splitter(bpe) is None
    text = "a <mask> the<a>b"
    assert ChunkedEncoder(bpe).encode(text) == bpe.encode(text, add_special_tokens=False).ids


WORDS = ["Order", "order", "12000:", "3.5", "1,000", "42", "x", "naïve", "日本", "½", "²", "١٢",
         "«quoted»", "(see", "below)", "it's", "don't", "e.g.", "--", "'", '"', "...", "?", "!",
         "a\u0301", "Ⅷ", "İ", "foo_bar", "#1", "$5", "50%", "\u00a0", "。", "—", "🚀", "\t"]


def test_word_cache_gives_the_library_tokens_over_random_chat_prompts(tok):
    """Seeded: 3,000 random chat prompts (digits, ASCII and other punctuation, marks, non-ASCII
    numbers next to spaces) through one encoder whose small cache keeps evicting: every
    prompt's ids are exactly the library's, and the cache stays within its bound."""
    rng = random.Random(7)
    enc = ChunkedEncoder(tok.backend, cache_chars=4000)
    system = "You are a helpful assistant. Answer briefly, in plain English."
    for _ in range(3000):
        user = "".join(rng.choice(WORDS) + rng.choice([" ", " ", " ", "", "  ", ", ", "\n"])
                       for _ in range(rng.randrange(1, 30)))
        text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                "<|im_start|>assistant\n")
        assert enc.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids, text
        assert enc._cached_chars == sum(map(len, enc._cache)) <= 4000
    assert enc.word_hits > 1000 and enc.hits > 9000  # words and template pieces reused


def test_a_new_number_comes_from_cached_digits(tok):
    """The bundled tokenizer isolates digits first: a new order number reaches the
    tokenizer as digits already cached, so nothing is encoded anew."""
    enc = ChunkedEncoder(tok.backend)
    assert enc.digit_cuts
    first, second = "Order 12345: where is it?", "Order 54321: where is it, then?"
    assert enc.encode(first) == tok.backend.encode(first, add_special_tokens=False).ids
    sent: list[str] = []
    batch = enc.encode_batch
    enc.encode_batch = lambda texts: sent.extend(texts) or batch(texts)
    assert enc.encode(second) == tok.backend.encode(second, add_special_tokens=False).ids
    assert sent == [" it,", " then?"]  # the only new words


def test_digits_are_cut_only_where_the_pre_tokenizer_isolates_them():
    """A byte-level BPE that merges digits ("12", " 1") without a `Digits` step: no digit
    cuts, and the tokens match the library; digit cuts there would not."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from tandem.protocol.long_text import digits_isolated

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("1", "2"), ("Ġ", "1"), ("Ġ1", "2"), ("2", "3")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bpe = Backend(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert chunkable(bpe) and not digits_isolated(bpe)
    texts = ["a 123 b", "x12 y 1223", "12 12 23", "no 1 2 3 here 123123"]
    plain, forced = ChunkedEncoder(bpe), ChunkedEncoder(bpe)
    forced.digit_cuts = True
    assert all(plain.encode(t) == bpe.encode(t, add_special_tokens=False).ids for t in texts)
    assert any(forced.encode(t) != bpe.encode(t, add_special_tokens=False).ids for t in texts)


def test_encode_async_gives_encode_and_runs_only_the_tokenizer_off_the_loop(tok):
    """Seeded random texts, short and past `OFFLOAD_CHARS` new characters, with and without
    special tokens: `Tokenizer.encode_async` gives `encode`'s ids; the uncached texts are
    encoded on a worker thread exactly when more than `offload_chars` of them are new, and
    the cache lookups stay on the loop's thread."""
    import asyncio
    import threading

    rng = random.Random(3)
    fresh = Tokenizer.load(find_bundled_gguf())  # a cache of its own
    chunked = fresh._chunked
    assert chunked is not None
    calls: list[tuple[int, int]] = []  # (thread, new characters) per encode_batch
    plans: list[int] = []  # the thread of every plan
    batch, plan = chunked.encode_batch, chunked.plan
    chunked.encode_batch = lambda texts: (calls.append(
        (threading.get_ident(), sum(map(len, texts)))) or batch(texts))
    chunked.plan = lambda text: plans.append(threading.get_ident()) or plan(text)

    async def run() -> None:
        loop_thread = threading.get_ident()
        for i in range(60):
            text = _random_text(rng, rng.choice([3, 40, 400, 1500]))
            special = bool(i % 2)
            del calls[:]
            got = await fresh.encode_async(text, add_special_tokens=special, offload_chars=256)
            assert got == tok.encode(text, add_special_tokens=special), text
            assert all(t == loop_thread for t in plans)
            for thread, chars in calls:
                assert (thread != loop_thread) == (chars > 256), (chars, text)
                paths[thread != loop_thread] += 1

    paths = {True: 0, False: 0}  # encode_batch calls off the loop's thread, and on it
    asyncio.run(run())
    assert paths[True] >= 5 and paths[False] >= 5, paths  # the seed takes both, often


def test_encode_async_offloads_a_tokenizer_that_is_not_chunked():
    """A tokenizer `long_text` cannot split (not byte-level) is encoded whole: on a worker
    thread past `offload_chars`, with the same ids as `encode`."""
    import asyncio

    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    t = Tokenizer(backend)
    assert t._chunked is None
    text = " ".join(random.Random(1).choice("abc") for _ in range(3000))
    assert asyncio.run(t.encode_async(text, offload_chars=100)) == t.encode(text)
    assert asyncio.run(t.encode_async("a b", offload_chars=100)) == t.encode("a b")
