"""Qwen3-Coder's XML calls (vLLM's `qwen3_coder` and `qwen3_xml`):
`<tool_call><function=f><parameter=p>value</parameter>...</function></tool_call>`. A value
is converted by the parameter's type in the request's tool schema (string, integer,
number, boolean, object, array; one not in the schema stays a string), with one leading
and one trailing newline removed, as vLLM does. String values stream as they come; other
values are held until their `</parameter>` (up to MAX_HELD_CHARS)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.serving.tool_parsers.base import (
    MAX_HELD_CHARS,
    MAX_HELD_WHITESPACE,
    MAX_NAME_CHARS,
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
FN, FN_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


def _param_types(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: its JSON-schema type (a string or a list)}}."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = {k: (v.get("type") if isinstance(v, Mapping) else None)
                           for k, v in (props or {}).items()}
    return out


def _is_string_type(kind: Any) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    return kind is None or "string" in kinds or not any(isinstance(k, str) for k in kinds)


def convert_value(value: str, kind: Any) -> str:
    """A parameter's text as JSON text, by its schema type."""
    kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)]
    if value.strip().lower() == "null" and ("null" in kinds or "string" not in kinds):
        return "null"
    for k in kinds:
        if k == "integer":
            try:
                return json.dumps(int(value.strip()))
            except ValueError:
                continue
        if k == "number":
            try:
                number = float(value.strip())
            except ValueError:
                continue
            if math.isfinite(number):
                text = value.strip()
                return json.dumps(int(text) if text.lstrip("-").isdigit() else number)
        if k == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower()
        if k in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if isinstance(parsed, dict if k == "object" else list):
                return json.dumps(parsed, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


class Qwen3CoderStream(StreamingToolParser):
    def __init__(self, tools: Sequence[Mapping[str, Any]],
                 make_id: IdFactory = random_tool_call_id) -> None:
        super().__init__(make_id)
        self.types = _param_types(tools)
        self.content = Content([START])
        # content | fn (reading `<function=name>`) | params | value | tail
        self.state = "content"
        self.held = ""
        self.name = ""
        self.kinds: dict[str, Any] = {}
        self.kind: Any = None
        self.params = 0  # parameters sent in this call
        self.streaming_string = False
        self.value_started = False  # the value's leading newline was dealt with
        self.index = -1

    def _fail(self, out: _Out) -> None:
        out.text(self.content.before + START + self.held)
        self.state, self.held = "content", ""

    def _broken(self) -> None:
        """A call whose header went out cannot be taken back: the rest is content."""
        self.state, self.held = "content", ""

    def _run(self, text: str, out: _Out) -> None:
        i = 0
        while i < len(text):
            s = self.state
            if s == "content":
                marker, i = self.content.scan(text, i, out)
                if marker is not None:
                    self.state, self.held = "fn", ""
                continue
            buf = self.held + text[i:]
            base = i - len(self.held)
            if s == "fn":
                i = self._fn(buf, base, text, out)
            elif s == "params":
                i = self._params(buf, base, text, out)
            elif s == "value":
                i = self._value(buf, base, text, out)
            else:  # tail: up to END
                p = buf.find(END)
                if p < 0:
                    self.held = buf[len(buf) - _partial_suffix(buf, [END]):]
                    return
                self.state, self.held = "content", ""
                self.content.lstrip = True
                i = base + p + len(END)

    def _fn(self, buf: str, base: int, text: str, out: _Out) -> int:
        body = buf.lstrip()
        if not FN.startswith(body[:len(FN)]) or len(buf) - len(body) > MAX_HELD_WHITESPACE:
            self.held = buf
            self._fail(out)
            return len(text)
        close = body.find(">", len(FN))
        name = body[len(FN):close if close >= 0 else len(body)]
        if len(name) > MAX_NAME_CHARS or "<" in name or (close >= 0 and not name.strip()):
            self.held = buf
            self._fail(out)
            return len(text)
        if close < 0:
            self.held = buf
            return len(text)
        self.name = name.strip()
        self.kinds = self.types.get(self.name, {})
        self.index, self.params = self.num_calls, 0
        out.header(self.index, self.make_id(), self.name)
        out.args(self.index, "{")
        self.state, self.held = "params", ""
        return base + (len(buf) - len(body)) + close + 1

    def _close(self, out: _Out) -> None:
        out.args(self.index, "}")

    def _params(self, buf: str, base: int, text: str, out: _Out) -> int:
        body = buf.lstrip()
        skip = len(buf) - len(body)
        for marker in (FN_END, END):
            if body.startswith(marker):
                self._close(out)
                self.held = ""
                if marker == END:
                    self.state = "content"
                    self.content.lstrip = True
                else:
                    self.state = "tail"
                return base + skip + len(marker)
        if body.startswith(PARAM):
            close = body.find(">", len(PARAM))
            if close < 0:
                if len(body) > MAX_NAME_CHARS + len(PARAM):
                    self._broken()
                    return len(text)
                self.held = buf
                return len(text)
            pname = body[len(PARAM):close].strip()
            self.kind = self.kinds.get(pname)
            sep = ", " if self.params else ""
            self.params += 1
            self.streaming_string = _is_string_type(self.kind)
            out.args(self.index, sep + json.dumps(pname, ensure_ascii=False) + ": "
                     + ('"' if self.streaming_string else ""))
            self.state, self.held, self.value_started = "value", "", False
            return base + skip + close + 1
        if any(m.startswith(body) for m in (FN_END, END, PARAM)):
            self.held = body  # a marker's start (whitespace between markers is dropped)
            return len(text)
        self._close(out)  # junk where a parameter should be: end the call there
        self._broken()
        return base + skip

    def _value(self, buf: str, base: int, text: str, out: _Out) -> int:
        if not self.value_started:
            if not buf:
                return len(text)
            self.value_started = True
            if buf.startswith("\n"):
                buf, base = buf[1:], base + 1
        p = buf.find(PARAM_END)
        if p >= 0:
            value = buf[:p]
            if value.endswith("\n"):
                value = value[:-1]
            if self.streaming_string:
                out.args(self.index, json.dumps(value, ensure_ascii=False)[1:-1] + '"')
            else:
                out.args(self.index, convert_value(value, self.kind))
            self.state, self.held = "params", ""
            return base + p + len(PARAM_END)
        keep = _partial_suffix(buf, [PARAM_END])
        if not keep and buf.endswith("\n"):
            keep = 1  # maybe the newline before </parameter>
        elif keep and buf[:len(buf) - keep].endswith("\n"):
            keep += 1
        if self.streaming_string:
            out.args(self.index, json.dumps(buf[:len(buf) - keep], ensure_ascii=False)[1:-1])
            self.held = buf[len(buf) - keep:]
        elif len(buf) > MAX_HELD_CHARS:
            self._broken()
        else:
            self.held = buf
        return len(text)

    def _end(self, out: _Out) -> None:
        if self.state == "content":
            self.content.flush(out)
        elif self.state == "fn":
            self._fail(out)
        self.state, self.held = "content", ""


@register_tool_parser("qwen3_coder", "qwen3_xml")
class Qwen3CoderToolParser(ToolParser):
    def streaming(self, make_id: IdFactory = random_tool_call_id) -> StreamingToolParser:
        return Qwen3CoderStream(self.tools, make_id)
