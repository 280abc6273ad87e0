"""The shape of a stream's plain events, for the output filter's fast path.

Most of a streamed chat answer is events that differ only in their content: the same id,
model, created time and choice, one piece of text. `Template` is such an event's bytes cut
around its content string (`prefix`, `suffix`); `Template.run` reads the content of a run
of other events in one loop without parsing them, while their bytes are the template's with
another JSON string in between. That is exact: the prefix ends where the template's content
string begins, outside any other token, so the same bytes around one string token parse to
the template's document with that string as the content (JSON's grammar), and a middle that
is not exactly one string token is refused. `template_of` cuts a template from an event
already parsed, and checks the cut by parsing it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

CONTENT_KEY = b'"content":'


@dataclass(frozen=True)
class Template:
    """A plain event's bytes (from `data: ` on, without the blank line) around its content
    string; `key`: the scanner its text goes to (the choice index, "content")."""

    prefix: bytes
    suffix: bytes
    key: tuple[Any, str]

    def run(self, events: list[bytes], start: int, stop: int) -> tuple[str, int] | None:
        """The events from `events[start]` on (before `stop`) that are this template with
        another string: (their texts joined, the index after them); None when
        `events[start]` is not one. Each middle is parsed alone: a middle of several tokens,
        or of a broken one, ends the run."""
        p, s = self.prefix, self.suffix
        np, ns = len(p), len(s)
        texts, i = [], start
        while i < stop:
            raw = events[i]
            if (len(raw) < np + ns + 2 or raw[np] != 0x22 or not raw.startswith(p)
                    or not raw.endswith(s)):
                break
            try:
                text = orjson.loads(raw[np:len(raw) - ns])
            except orjson.JSONDecodeError:
                break
            if type(text) is not str:
                break
            texts.append(text)
            i += 1
        return ("".join(texts), i) if texts else None


def _string_end(raw: bytes, start: int) -> int:
    """The index just past the JSON string that opens at `raw[start]` (a quote); -1 if it
    does not close."""
    i = start + 1
    while (i := raw.find(b'"', i)) >= 0:
        backslashes = 0
        while raw[i - 1 - backslashes] == 0x5C:  # the quote is escaped by an odd run
            backslashes += 1
        if backslashes % 2 == 0:
            return i + 1
        i += 1
    return -1


def template_of(raw: bytes, doc: dict, text: str, key: tuple[Any, str]) -> Template | None:
    """The template of `raw` (`data: {...}`, parsed as `doc`, a plain event whose content is
    `text`), or None where its bytes do not show the content string unambiguously."""
    at = raw.find(CONTENT_KEY)
    if at < 0 or raw.find(CONTENT_KEY, at + 1) >= 0:
        return None
    start = at + len(CONTENT_KEY)
    while start < len(raw) and raw[start] in b" \t":
        start += 1
    if start >= len(raw) or raw[start] != 0x22:
        return None
    end = _string_end(raw, start)
    if end < 0:
        return None
    prefix, suffix = raw[:start], raw[end:]
    try:  # the cut checked: the bytes around the string parse back to the same event
        same = (orjson.loads(raw[start:end]) == text
                and orjson.loads((prefix + orjson.dumps(text) + suffix)[6:]) == doc)
    except orjson.JSONDecodeError:
        return None
    return Template(prefix, suffix, key) if same and raw.startswith(b"data: ") else None
