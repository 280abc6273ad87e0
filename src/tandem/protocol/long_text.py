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

Only tokenizers whose normalizer is empty and whose pre-tokenizer is byte-level (regex
split and/or digits, then ByteLevel) qualify, and none of their added tokens may contain a
space; `chunkable` checks this once per tokenizer.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from tokenizers import Tokenizer as _Backend
from tokenizers import models

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


class ChunkedEncoder:
    """`encode(text)` without special tokens, through cached parallel chunks."""

    def __init__(self, backend: _Backend, chunk_chars: int = 4096,
                 cache_chars: int = 8 << 20) -> None:
        self.backend = backend
        self.chunk_chars = chunk_chars
        self.cache_chars = cache_chars  # bound on the cached chunks' total length
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # the router tokenizes long bodies in worker threads
        self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        bounds = [0, *cut_points(text, self.chunk_chars), len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        found: dict[int, list[int]] = {}
        with self._lock:
            for i, piece in enumerate(pieces):
                ids = self._cache.get(piece)
                if ids is not None:
                    self._cache.move_to_end(piece)
                    found[i] = ids
            self.hits += len(found)
            self.misses += len(pieces) - len(found)
        todo = [i for i in range(len(pieces)) if i not in found]
        if todo:
            encoded = self.backend.encode_batch([pieces[i] for i in todo],
                                                add_special_tokens=False)
            with self._lock:
                for i, enc in zip(todo, encoded, strict=True):
                    found[i] = enc.ids
                    self._remember(pieces[i], enc.ids)
        out: list[int] = []
        for i in range(len(pieces)):
            out.extend(found[i])
        return out

    def _remember(self, piece: str, ids: list[int]) -> None:
        if len(piece) > self.cache_chars or piece in self._cache:
            return
        self._cache[piece] = ids
        self._cached_chars += len(piece)
        while self._cached_chars > self.cache_chars:
            old, _ = self._cache.popitem(last=False)
            self._cached_chars -= len(old)
