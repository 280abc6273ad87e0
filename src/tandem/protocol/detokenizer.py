"""Incremental (streaming) detokenization with vLLM-style prefix/read offsets.

Contract: for any output ids pushed in any chunking, `"".join(pushes) + flush()` equals
`tokenizer.decode(output_ids, skip_special_tokens)`, and no delta ends in a partial UTF-8
character. Each push decodes only a short window (the last emitted tokens plus the new
ones), so the cost per token does not grow with the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class SupportsDecode(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas for one request.

    `prompt_ids` are accepted for API parity with vLLM but are not used as decoding context:
    output text is defined as the decode of the output ids alone (byte-level decoders are
    context-free, so this only differs where the prompt ends mid-character).
    """

    __slots__ = ("_tokenizer", "_skip", "_window", "_read", "_text", "prompt_len",
                 "num_output_tokens")

    def __init__(self, tokenizer: SupportsDecode, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.prompt_len = len(prompt_ids)
        self.num_output_tokens = 0
        # `_window` holds the ids from the prefix offset on and `_read` is the read offset in
        # it; `_text` is the part of decode(_window) already emitted (or, right after the
        # offsets move, decode(_window[:_read])).
        self._window: list[int] = []
        self._read = 0
        self._text = ""

    def _decode(self) -> str:
        return self._tokenizer.decode(self._window, skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append output ids; return the newly finalized text. Text ending in U+FFFD (an
        incomplete character) is held back; characters before it are emitted."""
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        self.num_output_tokens += len(new_ids)
        text = self._decode()
        if not text.startswith(self._text):  # a context-sensitive decoder rewrote the past
            return ""
        if text.endswith(_REPLACEMENT):  # offsets stay; emit the complete characters only
            stable = text.rstrip(_REPLACEMENT)
            delta = stable[len(self._text):]
            self._text = max(self._text, stable, key=len)
            return delta
        delta = text[len(self._text):]
        # Clean token boundary: prefix offset := read offset, read offset := end.
        if self._read:
            del self._window[:self._read]
            text = self._decode()
        self._read = len(self._window)
        self._text = text
        return delta

    def flush(self) -> str:
        """End of stream: return whatever is still held back (possibly ending in U+FFFD)."""
        delta = self._decode()[len(self._text):]
        self._window.clear()
        self._read = 0
        self._text = ""
        return delta
