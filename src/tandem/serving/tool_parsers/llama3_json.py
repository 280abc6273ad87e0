"""Llama 3.1 / 3.2 / 4 JSON calls (vLLM's `llama3_json`): the output is one or more
`{"name": "f", "parameters": {...}}` objects (`"arguments"` accepted too), separated by `;`,
optionally after `<|python_tag|>`; an output that does not start with a call is content,
as is whatever follows the calls."""

from __future__ import annotations

from tandem.serving.tool_parsers.base import (
    MAX_HELD_WHITESPACE,
    CallObject,
    IdFactory,
    StreamingToolParser,
    ToolParser,
    _Out,
    random_tool_call_id,
    register_tool_parser,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(StreamingToolParser):
    def __init__(self, make_id: IdFactory = random_tool_call_id) -> None:
        super().__init__(make_id)
        # start (deciding) | call | sep (after a call: `;` or the end) | content
        self.state = "start"
        self.held = ""  # start: leading whitespace and a possible python tag
        self.call: CallObject | None = None

    def _run(self, text: str, out: _Out) -> None:
        i = 0
        while i < len(text):
            if self.state == "content":
                out.text(text[i:])
                return
            if self.state == "start":
                i = self._start(text, i, out)
            elif self.state == "call":
                assert self.call is not None
                i = self.call.feed(text, i, out)
                if self.call.status == "done":
                    self.state = "sep"
                elif self.call.status == "error":
                    if not self.call.emitted:
                        out.text(self.held + self.call.raw())
                    self.held, self.state = "", "content"
            else:  # sep
                ch = text[i]
                if ch.isspace():
                    i += 1
                elif ch == ";":
                    i += 1
                    self.state, self.held = "call", ""
                    self.call = CallObject(self.num_calls, self.make_id)
                else:
                    self.state = "content"

    def _start(self, text: str, i: int, out: _Out) -> int:
        while i < len(text):
            self.held += text[i]
            i += 1
            body = self.held.lstrip()
            if not body:
                if len(self.held) > MAX_HELD_WHITESPACE:
                    break
                continue
            if body.startswith(PYTHON_TAG):  # (held: content again if no call follows)
                self._begin_call()
                return i
            if PYTHON_TAG.startswith(body):
                continue
            if body == "{":  # the call object's own first character: hand it over
                self.held = self.held[:-1]
                self._begin_call()
                return i - 1
            break
        if i == len(text) and (not self.held.strip() or PYTHON_TAG.startswith(
                self.held.lstrip())) and len(self.held) <= MAX_HELD_WHITESPACE:
            return i
        out.text(self.held)  # not a call: plain content from here on
        self.held, self.state = "", "content"
        return i

    def _begin_call(self) -> None:
        self.state = "call"
        self.call = CallObject(self.num_calls, self.make_id)

    def _end(self, out: _Out) -> None:
        if self.state == "start":
            out.text(self.held)
        elif self.state == "call" and self.call is not None and not self.call.emitted:
            out.text(self.held + self.call.raw())
        self.held = ""


@register_tool_parser("llama3_json", "llama4_json")
class Llama3JsonToolParser(ToolParser):
    needs_special_tokens = True  # <|python_tag|> is a special token

    def streaming(self, make_id: IdFactory = random_tool_call_id) -> StreamingToolParser:
        return Llama3JsonStream(make_id)
