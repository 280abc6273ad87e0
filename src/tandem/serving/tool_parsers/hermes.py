"""Hermes-style calls, as Qwen2.5, Qwen3, Hermes 2/3 and many others emit them:
`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number of them, with plain
text around (vLLM's `hermes`)."""

from __future__ import annotations

from tandem.serving.tool_parsers.base import (
    CallObject,
    Content,
    IdFactory,
    StreamingToolParser,
    ToolParser,
    _Out,
    _partial_suffix,
    random_tool_call_id,
    register_tool_parser,
)

START, END = "<tool_call>", "</tool_call>"


class HermesStream(StreamingToolParser):
    def __init__(self, make_id: IdFactory = random_tool_call_id) -> None:
        super().__init__(make_id)
        self.content = Content([START])
        self.state = "content"  # content | call | tail (after the object, up to END)
        self.call: CallObject | None = None
        self.tail = ""  # a possible start of END, held

    def _run(self, text: str, out: _Out) -> None:
        i = 0
        while i < len(text):
            if self.state == "content":
                marker, i = self.content.scan(text, i, out)
                if marker is not None:
                    self.state = "call"
                    self.call = CallObject(self.num_calls, self.make_id)
            elif self.state == "call":
                assert self.call is not None
                i = self.call.feed(text, i, out)
                if self.call.status == "done":
                    self.state = "tail"
                elif self.call.status == "error":
                    if not self.call.emitted:  # never a call: its text is content
                        out.text(self.content.before + START + self.call.raw())
                    self.state, self.call = "content", None
            else:
                buf = self.tail + text[i:]
                p = buf.find(END)
                if p >= 0:
                    i += p + len(END) - len(self.tail)
                    self.tail, self.state = "", "content"
                    self.content.lstrip = True
                else:
                    self.tail = buf[len(buf) - _partial_suffix(buf, [END]):]
                    i = len(text)

    def _end(self, out: _Out) -> None:
        if self.state == "call" and self.call is not None and not self.call.emitted:
            # an unfinished call's start: content
            out.text(self.content.before + START + self.call.raw())
        elif self.state == "content":
            self.content.flush(out)
        self.state = "content"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    # some models' tags are special tokens (Hermes 2 Pro); vLLM keeps special tokens too
    needs_special_tokens = True

    def streaming(self, make_id: IdFactory = random_tool_call_id) -> StreamingToolParser:
        return HermesStream(make_id)
