"""Mistral calls (vLLM's `mistral`): `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`
(tokenizer v3 and older, a JSON array) or `[TOOL_CALLS]f[ARGS]{...}` (v11 and newer, one
marker per call), with plain text before them. Ids are 9 alphanumeric characters, which
Mistral's chat templates require."""

from __future__ import annotations

import random
import string

from tandem.serving.tool_parsers.base import (
    MAX_HELD_WHITESPACE,
    MAX_NAME_CHARS,
    ArgsObject,
    CallObject,
    Content,
    IdFactory,
    StreamingToolParser,
    ToolParser,
    _Out,
    _partial_suffix,
    register_tool_parser,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits
_NAME_CHARS = frozenset(_ID_CHARS + "_-.")


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


class MistralStream(StreamingToolParser):
    def __init__(self, make_id: IdFactory = mistral_tool_call_id) -> None:
        super().__init__(make_id)
        self.content = Content([BOT])
        # content | after_bot | array | array_sep | object | name | args
        self.state = "content"
        self.held = ""  # text since the marker while it is not yet a call
        self.call: CallObject | ArgsObject | None = None
        self.in_array = False  # the marker's calls are a JSON array
        self.array_calls = 0  # calls of that array done

    def _fail(self, out: _Out) -> None:
        """What followed the marker is not a call: it is content (after calls of the same
        array, only the broken part)."""
        call = self.call
        raw = call.raw() if isinstance(call, CallObject) and not call.emitted else ""
        if self.array_calls == 0 and (call is None or not call.emitted):
            out.text(self.content.before + BOT + self.held + raw)
        else:
            out.text(raw)
        self.state, self.held, self.call = "content", "", None
        self.in_array, self.array_calls = False, 0

    def _hold(self, ch: str, out: _Out) -> None:
        """Whitespace (or the array's `[`) before a marker's first call, bounded."""
        self.held += ch
        if len(self.held) > MAX_HELD_WHITESPACE:
            self._fail(out)

    def _run(self, text: str, out: _Out) -> None:
        i = 0
        while i < len(text):
            s = self.state
            if s == "content":
                marker, i = self.content.scan(text, i, out)
                if marker is not None:
                    self.state, self.held = "after_bot", ""
                continue
            ch = text[i]
            if s in ("after_bot", "array", "array_sep") and ch.isspace():
                i += 1
                if not self.array_calls:  # (content again if no call follows)
                    self._hold(ch, out)
            elif s == "after_bot":
                if ch == "[":
                    i += 1
                    self.state, self.in_array = "array", True
                    self._hold(ch, out)
                elif ch == "{":
                    self._object()
                elif ch in _NAME_CHARS:
                    self.state = "name"
                else:
                    self._fail(out)
            elif s == "array":
                if ch == "{":
                    self._object()
                else:
                    self._fail(out)
            elif s == "array_sep":
                i += 1
                if ch == ",":
                    self.state = "array"
                elif ch == "]":
                    self._done()
                else:
                    self._done()  # junk after an array's calls: dropped
                    self.content.lstrip = False
            elif s == "name":
                i = self._name(text, i, out)
            elif s in ("object", "args"):
                assert self.call is not None
                i = self.call.feed(text, i, out)
                if self.call.status == "error":
                    self._fail(out)
                elif self.call.status == "done":
                    self.call = None
                    if self.in_array:
                        self.state, self.array_calls = "array_sep", self.array_calls + 1
                    else:
                        self._done()

    def _object(self) -> None:
        self.state = "object"
        self.call = CallObject(self.num_calls, self.make_id)

    def _done(self) -> None:
        self.state, self.held = "content", ""
        self.in_array, self.array_calls = False, 0
        self.content.lstrip = True

    def _name(self, text: str, i: int, out: _Out) -> int:
        buf = self.held + text[i:]
        start = len(self.held)
        p = buf.find(ARGS)
        name = (buf[:p] if p >= 0 else buf[:len(buf) - _partial_suffix(buf, [ARGS])]).strip()
        if (not all(c in _NAME_CHARS for c in name)
                or len(buf) > MAX_NAME_CHARS + MAX_HELD_WHITESPACE
                or (p >= 0 and not name)):
            self.held = buf if p < 0 else buf[:p + len(ARGS)]
            self._fail(out)
            return len(text) if p < 0 else i + p + len(ARGS) - start
        if p < 0:
            self.held = buf
            return len(text)
        self.state, self.held = "args", buf[:p + len(ARGS)]  # content if no call follows
        self.call = ArgsObject(self.num_calls, name, self.make_id)
        return i + p + len(ARGS) - start

    def _end(self, out: _Out) -> None:
        if self.state == "content":
            self.content.flush(out)
        elif self.state != "array_sep":
            call = self.call
            if call is None or not call.emitted:
                self._fail(out)
        self.state = "content"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def streaming(self, make_id: IdFactory = mistral_tool_call_id) -> StreamingToolParser:
        return MistralStream(make_id)

    def extract(self, text: str, make_id: IdFactory = mistral_tool_call_id):
        return super().extract(text, make_id)
