"""The tool-call parser interface, its registry, and the pieces the formats share.

A `ToolParser` (one per request, knowing the request's `tools`) turns a model's own
tool-call syntax into OpenAI tool calls: `extract(text)` for a whole output, `streaming()`
for an incremental `StreamingToolParser` whose `feed(delta_text)` returns a `StreamDelta`:
plain text outside calls as `content`, and per call first its index, id and name, then
argument fragments whose concatenation is the arguments' JSON text (valid JSON once the
call is complete). Malformed output is content, never an exception; the text held back
while a call's start is undecided is bounded (`MAX_HELD_CHARS`), as is JSON nesting.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.protocol.openai_api import new_tool_call_id
from tandem.serving.tool_parsers.json_stream import Event, JsonScanner

MAX_HELD_CHARS = 1 << 16  # text held while deciding what a call's start is
MAX_HELD_WHITESPACE = 4096  # whitespace held back before a possible call
MAX_NAME_CHARS = 256

IdFactory = Callable[[], str]


random_tool_call_id: IdFactory = new_tool_call_id  # vLLM's tool-call id format


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole output split: `content` is None when only calls remain (or nothing)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class ToolCallDelta:
    """One `delta.tool_calls` entry: `id` and `name` only in a call's first delta."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass
class StreamDelta:
    """What one piece of model output adds: reasoning, content and tool-call deltas."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


class _Out:
    """Collects one feed's output, merging adjacent pieces of the same call."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[ToolCallDelta] = []
        self.headers = 0  # calls started over the whole stream

    def text(self, s: str) -> None:
        if s:
            self.content.append(s)

    def header(self, index: int, call_id: str, name: str) -> None:
        self.headers += 1
        self.calls.append(ToolCallDelta(index, call_id, name))

    def args(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += fragment
        else:
            self.calls.append(ToolCallDelta(index, arguments=fragment))

    def take(self) -> StreamDelta:
        delta = StreamDelta("".join(self.content), "", self.calls)
        self.content, self.calls = [], []
        return delta


class StreamingToolParser(ABC):
    """Incremental parser for one output (one choice): `feed` each new piece of text, then
    `finish` once at the end (releases what was held back)."""

    def __init__(self, make_id: IdFactory = random_tool_call_id) -> None:
        self.make_id = make_id
        self._out = _Out()

    @property
    def num_calls(self) -> int:
        """Calls started (their headers sent): also the next call's index."""
        return self._out.headers

    @property
    def tools_called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> StreamDelta:
        if text:
            self._run(text, self._out)
        return self._out.take()

    def finish(self) -> StreamDelta:
        self._end(self._out)
        return self._out.take()

    @abstractmethod
    def _run(self, text: str, out: _Out) -> None: ...

    @abstractmethod
    def _end(self, out: _Out) -> None: ...


class ToolParser(ABC):
    """A model family's tool-call format. `tools` are the request's tools (OpenAI's
    `{"type": "function", "function": {...}}` entries); a format may use their schemas."""

    name = ""
    # the format's markers are special tokens: the request must keep them in its text
    needs_special_tokens = False

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = list(tools or [])

    @abstractmethod
    def streaming(self, make_id: IdFactory = random_tool_call_id) -> StreamingToolParser: ...

    def extract(self, text: str, make_id: IdFactory = random_tool_call_id
                ) -> ExtractedToolCalls:
        """A whole output: its calls (arguments re-serialized compactly as vLLM does) and
        the text outside them; any call whose arguments are not a JSON object makes the
        whole output content."""
        stream = self.streaming(make_id)
        deltas = [stream.feed(text), stream.finish()]
        if not stream.tools_called:
            return ExtractedToolCalls(False, [], text)
        calls: dict[int, list[str]] = {}
        names: dict[int, tuple[str, str]] = {}
        for d in deltas:
            for c in d.tool_calls:
                if c.name is not None and c.id is not None:
                    names[c.index] = (c.id, c.name)
                calls.setdefault(c.index, []).append(c.arguments)
        out = []
        for index in sorted(names):
            try:
                args = json.loads("".join(calls[index]))
            except ValueError:
                args = None
            if not isinstance(args, dict):
                return ExtractedToolCalls(False, [], text)
            call_id, name = names[index]
            out.append(ToolCall(call_id, name, json.dumps(args, ensure_ascii=False)))
        content = "".join(d.content for d in deltas)
        return ExtractedToolCalls(True, out, content if content.strip() else None)


_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def add(cls: type[ToolParser]) -> type[ToolParser]:
        for n in names:
            _REGISTRY[n] = cls
        cls.name = cls.name or names[0]
        return cls
    return add


def tool_parser_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; KeyError names the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; known: "
                       f"{', '.join(tool_parser_names())}") from None


# -- shared pieces ------------------------------------------------------------------------
def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class Content:
    """Text outside calls: forwarded at once but for a possible marker's start and the
    whitespace right before it (dropped if a call follows), and whitespace right after a
    call (`lstrip`), which is dropped."""

    def __init__(self, markers: Sequence[str]) -> None:
        self.markers = tuple(markers)
        self.pending = ""
        self.lstrip = False
        self.before = ""  # the whitespace dropped before the latest marker

    def scan(self, text: str, i: int, out: _Out) -> tuple[str | None, int]:
        """Consume `text[i:]` up to and including the first marker: (the marker, the index
        after it), or (None, len(text)) with everything consumed."""
        held = len(self.pending)
        buf = self.pending + text[i:]
        start = 0
        if self.lstrip:
            start = len(buf) - len(buf.lstrip())
            if start == len(buf):
                self.pending = ""
                return None, len(text)
            self.lstrip = False
        found, pos = None, -1
        for m in self.markers:
            p = buf.find(m, start)
            if p >= 0 and (pos < 0 or p < pos):
                found, pos = m, p
        if found is not None:
            text_before = buf[start:pos]
            out.text(text_before.rstrip())
            self.before = text_before[len(text_before.rstrip()):]
            self.pending = ""
            return found, i + pos + len(found) - held
        keep = _partial_suffix(buf[start:], self.markers)
        body = buf[start:len(buf) - keep]
        stripped = body.rstrip()
        if len(body) - len(stripped) > MAX_HELD_WHITESPACE:
            stripped = body
        out.text(stripped)
        self.pending = buf[start + len(stripped):]
        return None, len(text)

    def flush(self, out: _Out) -> None:
        if not self.lstrip:
            out.text(self.pending)
        self.pending = ""


class CallObject:
    """One `{"name": ..., "arguments": {...}}` object (also `"parameters"`), streamed: the
    header once the name is known and the arguments object opens, then the arguments' raw
    characters. Keys in another order, or arguments given as a JSON string, are held (up
    to MAX_HELD_CHARS) and sent whole when the object closes. A call without arguments
    gets `{}`."""

    NAME_KEYS = ("name",)
    ARG_KEYS = ("arguments", "parameters")

    def __init__(self, index: int, make_id: IdFactory) -> None:
        self.index = index
        self.make_id = make_id
        self.scan = JsonScanner()
        self.held: list[str] = []
        self.mode = "head"  # head | args | tail | buffered
        self.status = "open"  # open | done | error
        self.emitted = False
        self.name: str | None = None
        self._key: Any = None
        self._key_start = 0
        self._value_start = 0
        self._started = False

    def raw(self) -> str:
        """The text held (everything so far unless the header was sent)."""
        return "".join(self.held)

    def feed(self, text: str, i: int, out: _Out) -> int:
        """Consume from `text[i:]` until the object closes or breaks (`status`); the index
        of the first character not consumed."""
        frag: list[str] = []
        n = len(text)
        while i < n and self.status == "open":
            ch = text[i]
            if not self._started and not ch.isspace():
                self._started = True
                if ch != "{":
                    self.status = "error"
                    break
            ev = self.scan.push(ch)
            if self.scan.error:
                self.status = "error"
                break
            i += 1
            if self.mode == "args":
                frag.append(ch)
                if ev is Event.VALUE_END:
                    self.mode = "tail"
                continue
            if self.mode == "tail":
                if ev is Event.CLOSED:
                    self.status = "done"
                continue
            self.held.append(ch)
            if len(self.held) > MAX_HELD_CHARS:
                self.status = "error"
                break
            if self.mode == "head":
                self._head(ev, ch, out)
            if ev is Event.CLOSED:
                self._whole(out)
        if frag:
            out.args(self.index, "".join(frag))
        return i

    def _head(self, ev: Event, ch: str, out: _Out) -> None:
        pos = len(self.held) - 1
        if ev is Event.KEY_START:
            self._key_start = pos
        elif ev is Event.KEY_END:
            self._key = json.loads("".join(self.held[self._key_start:]))
        elif ev is Event.VALUE_START:
            self._value_start = pos
            if self._key in self.ARG_KEYS:
                if ch == "{" and self.name is not None:
                    self.emitted = True
                    out.header(self.index, self.make_id(), self.name)
                    out.args(self.index, "{")
                    self.mode, self.held = "args", []
                else:
                    self.mode = "buffered"
        elif ev is Event.VALUE_END and self._key in self.NAME_KEYS and self.name is None:
            value = json.loads("".join(self.held[self._value_start:]))
            if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS:
                self.name = value

    def _whole(self, out: _Out) -> None:
        """The object closed while held: send it whole, or mark it malformed."""
        obj = json.loads(self.raw())
        name = obj.get("name")
        args = next((obj[k] for k in self.ARG_KEYS if k in obj), {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            self.status = "error"
            return
        self.status, self.emitted = "done", True
        out.header(self.index, self.make_id(), name)
        out.args(self.index, json.dumps(args, ensure_ascii=False))


class ArgsObject:
    """A call whose name is already known: its arguments object, streamed raw from its
    `{` (leading whitespace skipped); the header goes out with the `{`."""

    def __init__(self, index: int, name: str, make_id: IdFactory) -> None:
        self.index = index
        self.name = name
        self.make_id = make_id
        self.scan = JsonScanner()
        self.status = "open"
        self.emitted = False

    def feed(self, text: str, i: int, out: _Out) -> int:
        frag: list[str] = []
        n = len(text)
        while i < n and self.status == "open":
            ch = text[i]
            if not self.emitted:
                if ch.isspace():
                    i += 1
                    continue
                if ch != "{":
                    self.status = "error"
                    break
                self.emitted = True
                out.header(self.index, self.make_id(), self.name)
            ev = self.scan.push(ch)
            if self.scan.error:
                self.status = "error"
                break
            frag.append(ch)
            i += 1
            if ev is Event.CLOSED:
                self.status = "done"
        if frag:
            out.args(self.index, "".join(frag))
        return i
