"""Long prompts tokenized in parallel chunks with a chunk cache, token-for-token identical to
one whole-text `encode`.

Byte-level BPE never merges across pre-tokens, so a text may be cut wherever every
pre-tokenizer of the families Tandem loads (GPT-2, Llama 3, Qwen, GPT-4o, Tekken regexes,
optionally after individual-digit splitting) must end one pre-token and start the next:
at a space with a letter on each side. The letter run on the left can only be matched by a
letter-run alternative, which stops at the space; the space plus the letters on the right
start the next match. So `encode(a + b) == encode(a) + encode(b)` for such cuts.

Cuts are deterministic (the first safe space at or after every `chunk_chars`), so two
prompts sharing a long prefix share their leading chunks, and a bounded LRU of chunk text ->
ids makes a repeated long prefix (RAG documents, long system prompts, growing multi-turn
chats) almost free. Uncached chunks go to `encode_batch`, which runs them on all cores.

Added tokens (`<|im_start|>`, `<|im_end|>`, ...) cut every text too: `tokenizers` extracts
them before normalizing and pre-tokenizing, and runs the pipeline on each stretch between
them separately, so the stretches can be encoded (and cached) one by one. The split repeats
its two passes exactly: tokens with `normalized=False` first, then the normalized ones, each
leftmost-longest. A chat prompt thus becomes its template's fixed pieces plus one stretch
per message, and a system prompt or an earlier turn is tokenized once, not per request
(measured on the bundled model: a ~100-token two-message chat prompt went from ~340 us to
~130 us with the system message cached). A stretch never seen whole (a new user turn) is
looked up again word by word, cut at every safe space, so only its new words reach the
tokenizer (at the safe spaces of `split_words`, which also cut after ASCII digits and
punctuation and before digits: "Order 12000: my" is three words; where the pre-tokenizer
isolates every digit first, `digits_isolated`, each ASCII digit is a word of its own, so a
new number is cached digits. A new ~140-character user turn costs ~22 us instead of ~75.)
Added tokens that strip neighbouring spaces or match only as single words move the
boundaries; such tokenizers are not split.

Only tokenizers whose normalizer is empty and whose pre-tokenizer is byte-level (regex
split and/or digits, then ByteLevel) qualify, and none of their added tokens may contain a
space; `chunkable` checks this once per tokenizer.
"""

from __future__ import annotations

import json
import re
import string
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Encoding, models
from tokenizers import Tokenizer as _Backend

# uncached text up to this many characters is encoded on the calling thread, piece by piece
SERIAL_CHARS = 512
_PRE_OK = frozenset({"ByteLevel", "Split", "Digits", "Sequence"})


def chunkable(backend: _Backend) -> bool:
    """True when cutting at letter-space-letter positions cannot change the tokens (reads
    the backend's parts directly: ~0.2 ms, where serializing the whole tokenizer took 140)."""
    if backend.normalizer is not None or not isinstance(backend.model, models.BPE):
        return False
    if backend.pre_tokenizer is None:
        return False
    pre = json.loads(backend.pre_tokenizer.__getstate__())
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or any(s.get("type") not in _PRE_OK - {"Sequence"} for s in steps):
        return False
    if not any(s.get("type") == "ByteLevel" for s in steps):
        return False
    if any(s.get("type") == "ByteLevel" and s.get("add_prefix_space") for s in steps):
        return False
    return not any(" " in t.content for t in backend.get_added_tokens_decoder().values())


def digits_isolated(backend: _Backend) -> bool:
    """True when the pre-tokenizer's first step isolates every digit (`Digits` with
    `individual_digits`): no pre-token then spans an ASCII digit and its neighbours, so a
    text may also be cut before and after each ASCII digit (`ChunkedEncoder`'s words)."""
    if backend.pre_tokenizer is None:
        return False
    pre = json.loads(backend.pre_tokenizer.__getstate__())
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return bool(steps) and steps[0].get("type") == "Digits" and bool(
        steps[0].get("individual_digits"))


_DIGIT = re.compile(r"([0-9])")


def cut_points(text: str, chunk_chars: int) -> list[int]:
    """Positions p of spaces with letters at p-1 and p+1, the first at or after each
    multiple of progress by `chunk_chars` (so shared prefixes cut alike)."""
    cuts: list[int] = []
    n, start = len(text), chunk_chars
    while start < n - 1:
        p = text.find(" ", start)
        while p != -1 and p + 1 < n and not (text[p - 1].isalpha() and text[p + 1].isalpha()):
            p = text.find(" ", p + 1)
        if p == -1 or p + 1 >= n:
            break
        cuts.append(p)
        start = p + chunk_chars
    return cuts


# a space between a left and a right character of these kinds ends one pre-token and starts
# the next in every family above: nothing a non-space character starts continues past a
# space (letter, digit and punctuation runs all stop there, and a space followed by a
# non-space is never part of the match before it), and the space, with the letters or
# digits after it, starts a match of its own. Beyond letters, only ASCII digits and
# punctuation, whose classes (\p{N}, [^\s\p{L}\p{N}]) no family or Unicode version disputes.
_LEFT = frozenset(string.ascii_letters + string.digits + string.punctuation)
_RIGHT = frozenset(string.ascii_letters + string.digits)


def split_words(text: str) -> list[str]:
    """`text` cut at every safe single space: a letter, ASCII digit or ASCII punctuation
    before it, a letter or ASCII digit after it (each word keeps its leading space).
    Encoding the words one by one gives the whole text's tokens (the argument above), and
    common words repeat across prompts that share no longer piece."""
    parts = text.split(" ")
    out: list[str] = []
    cur = parts[0]
    left, right = _LEFT, _RIGHT
    for seg in parts[1:]:
        if (cur and seg and (cur[-1] in left or cur[-1].isalpha())
                and (seg[0] in right or seg[0].isalpha())):
            out.append(cur)
            cur = " " + seg
        else:
            cur += " " + seg
    out.append(cur)
    return out


def added_token_splitter(backend: _Backend) -> AddedTokenSplitter | None:
    """The backend's added-token split, or None when it cannot be reproduced exactly (a token
    with lstrip / rstrip / single_word, or `encode_special_tokens` set)."""
    if getattr(backend, "encode_special_tokens", False):
        return None
    added = backend.get_added_tokens_decoder()
    if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return None
    ids = {t.content: i for i, t in sorted(added.items())}
    passes = [[t.content for t in added.values() if not t.normalized],
              [t.content for t in added.values() if t.normalized]]
    return AddedTokenSplitter(ids, [p for p in passes if p])


class AddedTokenSplitter:
    """Text -> stretches of plain text and added-token ids, as `tokenizers` cuts it."""

    def __init__(self, ids: dict[str, int], passes: list[list[str]]) -> None:
        self.ids = ids
        # longest first: at one position the first alternative that matches is the longest
        self.patterns = [re.compile("|".join(re.escape(t) for t in sorted(p, key=len,
                                                                           reverse=True)))
                         for p in passes]

    def split(self, text: str) -> list[str | int]:
        parts: list[str | int] = [text]
        for pattern in self.patterns:
            out: list[str | int] = []
            for part in parts:
                if isinstance(part, int):
                    out.append(part)
                    continue
                start = 0
                for m in pattern.finditer(part):
                    if m.start() > start:
                        out.append(part[start:m.start()])
                    out.append(self.ids[m.group()])
                    start = m.end()
                if start < len(part):
                    out.append(part[start:])
            parts = out
        return parts


@dataclass
class EncodePlan:
    """`ChunkedEncoder.plan` of one text: its pieces (text or an added token's id), the ids
    found per piece (() where still unknown), each missed piece's words (by piece index),
    the words known already, and the distinct texts left to encode, in order."""

    pieces: list[str | int]
    found: list[Sequence[int]]
    words_of: dict[int, list[str]]
    known: dict[str, Sequence[int]]
    todo: list[str]

    @property
    def todo_chars(self) -> int:
        return sum(map(len, self.todo))


class ChunkedEncoder:
    """`encode(text)` without special tokens: split at added tokens, stretches longer than
    `chunk_chars` cut at safe spaces, every piece looked up in a bounded LRU (keyed by its
    text); a missed piece up to `word_chars` long is cut into words, which are looked up in
    the same LRU; whatever is still unknown is encoded together (up to `SERIAL_CHARS` on the
    calling thread: a new user turn's few new words cost less than a thread-pool round trip,
    ~20 us of ~120 per ~100-token chat prompt on the bundled model)."""

    def __init__(self, backend: _Backend, chunk_chars: int = 4096,
                 cache_chars: int = 8 << 20, word_chars: int = 2048) -> None:
        self.backend = backend
        self.chunk_chars = chunk_chars
        # a missed piece up to this long is looked up again word by word (`split_words`)
        self.word_chars = word_chars
        self.word_hits = 0
        self.cache_chars = cache_chars  # bound on the cached pieces' total length
        self.splitter = added_token_splitter(backend)
        # ASCII digits cut words too (`digits_isolated`): a new number is cached digits
        self.digit_cuts = digits_isolated(backend)
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # the router tokenizes long bodies in worker threads
        self.hits = self.misses = 0

    def pieces(self, text: str) -> list[str | int]:
        """Plain-text pieces and added-token ids, in order."""
        parts = self.splitter.split(text) if self.splitter is not None else [text]
        out: list[str | int] = []
        for part in parts:
            if isinstance(part, str) and len(part) > self.chunk_chars:
                bounds = [0, *cut_points(part, self.chunk_chars), len(part)]
                out.extend(part[a:b] for a, b in zip(bounds, bounds[1:], strict=False))
            else:
                out.append(part)
        return out

    def encode(self, text: str) -> list[int]:
        plan = self.plan(text)
        return self.complete(plan, self.encode_batch(plan.todo) if plan.todo else [])

    def plan(self, text: str) -> EncodePlan:
        """`text` looked up in the cache: what is known, and the distinct texts still to
        encode (`EncodePlan.todo`). `encode` is `complete(plan, encode_batch(plan.todo))`;
        the split lets a caller run `encode_batch` (the tokenizer's own code, which drops
        the GIL) on another thread while everything in Python stays on its own."""
        pieces = self.pieces(text)
        found: list[Sequence[int]] = []  # per piece; () for a missed one until it is known
        missed: list[int] = []
        words_of: dict[int, list[str]] = {}  # a missed piece's words, unless all were known
        known: dict[str, Sequence[int]] = {}
        todo: dict[str, None] = {}  # distinct texts to encode, in order
        cache = self._cache
        get, touch = cache.get, cache.move_to_end
        with self._lock:
            hits = 0
            for piece in pieces:
                if piece.__class__ is int:
                    found.append((piece,))  # type: ignore[arg-type]
                    continue
                ids = get(piece)  # type: ignore[arg-type]
                if ids is None:
                    missed.append(len(found))
                    found.append(())
                else:
                    touch(piece)  # type: ignore[arg-type]
                    found.append(ids)
                    hits += 1
            self.hits += hits
            self.misses += len(missed)
            hits = 0
            for i in missed:  # second level: the missed piece's words may be known
                piece = pieces[i]  # type: ignore[assignment]
                words = self.words(piece)  # type: ignore[arg-type]
                several = len(words) > 1
                if several:  # every word known (the common case): the ids at once
                    ids = []
                    for w in words:
                        got = get(w)
                        if got is None:
                            break
                        touch(w)
                        ids += got
                    else:
                        found[i] = ids
                        hits += len(words)
                        self._remember(piece, ids)  # type: ignore[arg-type]
                        continue
                words_of[i] = words
                for w in words:
                    if w in known or w in todo:
                        continue
                    ids = get(w) if several else None
                    if ids is None:
                        todo[w] = None
                    else:
                        touch(w)
                        known[w] = ids
                        hits += 1
            self.word_hits += hits
        return EncodePlan(pieces, found, words_of, known, list(todo))

    def complete(self, plan: EncodePlan, encoded: Sequence[Encoding | list[int]]
                 ) -> list[int]:
        """The ids of `plan`'s text, given `encoded`: `encode_batch(plan.todo)` (or their
        ids)."""
        found, known = plan.found, plan.known
        if plan.todo:
            with self._lock:
                for w, enc in zip(plan.todo, encoded, strict=True):
                    known[w] = ids = enc if type(enc) is list else enc.ids
                    self._remember(w, ids)
        if plan.words_of:
            with self._lock:
                for i, words in plan.words_of.items():
                    if len(words) == 1:
                        found[i] = known[words[0]]
                        continue
                    found[i] = ids = [t for w in words for t in known[w]]
                    self._remember(plan.pieces[i], ids)  # type: ignore[arg-type]
        out: list[int] = []
        for ids in found:
            out += ids
        return out

    def words(self, piece: str) -> list[str]:
        """`piece` cut at every safe place (`split_words`, and at digits where
        `digit_cuts`); uncut when longer than `word_chars`."""
        if len(piece) > self.word_chars:
            return [piece]
        if self.digit_cuts:
            return [w for part in _DIGIT.split(piece) if part
                    for w in (split_words(part) if len(part) > 1 else (part,))]
        return split_words(piece)

    def encode_batch(self, texts: list[str]) -> list[Encoding]:
        """Each text encoded without special tokens (`complete` reads their ids): the
        tokenizer's own code only, with the GIL dropped while it runs (beyond
        `SERIAL_CHARS`), so it may run on a worker thread beside an event loop and hold the
        GIL only for a moment."""
        if sum(map(len, texts)) <= SERIAL_CHARS:  # a few new words: no thread pool round trip
            return [self.backend.encode(t, add_special_tokens=False) for t in texts]
        # encode_batch_fast (tokenizers >= 0.21) skips offset tracking: ~35 % less time on
        # the bundled model, same ids
        fast = getattr(self.backend, "encode_batch_fast", None)
        if fast is not None:
            return fast(texts, add_special_tokens=False)
        return self.backend.encode_batch(texts, add_special_tokens=False)

    def _remember(self, piece: str, ids: list[int]) -> None:
        if len(piece) > self.cache_chars or piece in self._cache:
            return
        self._cache[piece] = tuple(ids)  # a tuple of ints: the cyclic GC stops tracking it
        self._cached_chars += len(piece)
        while self._cached_chars > self.cache_chars:
            old, _ = self._cache.popitem(last=False)
            self._cached_chars -= len(old)
