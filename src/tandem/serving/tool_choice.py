"""Forced tool calls: `tool_choice` "required" or a named function, enforced by a grammar.

`ToolCallPlan.for_request` turns the request's tools and tool choice into the JSON schema the
output must follow (vLLM's shapes) and turns that output back into OpenAI `tool_calls`:

* a named function: the output is the function's arguments (its `parameters` schema; no
  parameters: an empty object). One call; `finish_reason` stays the engine's ("stop"), as
  OpenAI's and vLLM's.
* "required": the output is a JSON array of 1.. calls (exactly one with
  `parallel_tool_calls` false), each `{"name": <one of the tools>, "parameters": {...}}`,
  the parameters following that tool's schema (`$defs` of every tool hoisted to the root).
  `finish_reason` "tool_calls" once the model stopped (as vLLM's).

A tool call's id is `chatcmpl-tool-<hex>` (as vLLM's) and its arguments are the JSON the
model wrote. `ToolCallStream` scans the output as it comes: each call's first
`delta.tool_calls` chunk carries its index, id, type and name; later ones carry fragments
of its arguments, which concatenate to that JSON. A whole output gets the same calls. An
output where no call is recognised is returned as `content`, without `tool_calls`; one cut
short by `max_tokens` keeps the calls begun (finish reason "length").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.errors import InvalidRequestError
from tandem.protocol.openai_api import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
    new_tool_call_id,
)
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS = ("$defs", "definitions")  # where schemas keep their shared definitions


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or EMPTY_PARAMETERS


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """The schema of a "required" output: an array of calls to the given tools. Raises
    InvalidRequestError (param `tools`) when two tools define one `$defs` name differently."""
    defs: dict[str, dict[str, Any]] = {}
    branches = []
    for tool in tools:
        params = dict(_parameters(tool))
        for key in _DEFS:
            for name, schema in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise InvalidRequestError(
                        f"two tools define {key} {name!r} differently", "tools")
        branches.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1
                              else {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


@dataclass(frozen=True)
class ToolCallPlan:
    """A forced tool call: `name` for a named function (None: "required")."""

    spec: StructuredOutputs  # what the output must follow
    name: str | None = None
    parallel: bool = True

    @property
    def required(self) -> bool:
        return self.name is None

    @classmethod
    def for_request(cls, req: ChatCompletionRequest) -> ToolCallPlan | None:
        """The plan for the request's tool choice; None unless it is "required" or a named
        function (the model chooses, or no tools). Raises InvalidRequestError naming
        `tool_choice` (or `tools`) for a schema the engine's bounds refuse."""
        choice = req.effective_tool_choice()
        tools = req.tools or []
        if isinstance(choice, NamedToolChoice):
            tool = next(t for t in tools if t.function.name == choice.function.name)
            schema, name = _parameters(tool), tool.function.name
        elif choice == "required":
            schema, name = required_schema(tools, req.parallel_tool_calls), None
        else:
            return None
        try:
            spec = StructuredOutputs.from_json_schema(schema)
            spec.validate()
        except StructuredOutputsError as exc:
            raise InvalidRequestError(f"the tools' schema: {exc}", "tool_choice") from None
        return cls(spec, name, req.parallel_tool_calls)

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in a whole output, as a stream of it sends them (each call's arguments
        as the model wrote them; a call cut short keeps what was written); None when no
        call was recognised."""
        if self.name is not None:
            return [ToolCall(id=new_tool_call_id(),
                             function=FunctionCall(name=self.name, arguments=text))]
        stream = self.stream()
        _, deltas = stream.feed(text)
        if not stream.called:
            return None
        calls: dict[int, ToolCall] = {}
        for d in deltas:
            assert d.function is not None
            if d.id is not None:
                calls[d.index] = ToolCall(id=d.id, function=FunctionCall(
                    name=d.function.name or "", arguments=""))
            calls[d.index].function.arguments += d.function.arguments or ""
        return [calls[i] for i in sorted(calls)]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """The choice's finish reason: "tool_calls" for "required" calls the model ended."""
        return "tool_calls" if self.required and called and reason == "stop" else reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


_KEY, _COLON, _VALUE_START, _VALUE, _AFTER = range(5)


@dataclass
class ToolCallStream:
    """One choice's streamed output -> (content, `delta.tool_calls`) pieces. Until a call
    is recognised the text is held back; output that is not the expected shape is sent as
    content (all of it, from the start)."""

    plan: ToolCallPlan
    called: bool = False  # a call's first chunk was sent
    _held: list[str] = field(default_factory=list)
    _failed: bool = False
    _stopped: bool = False  # calls were sent, then something else: the rest is dropped
    # "required": a character-level scan of `[{"name": ..., "parameters": ...}, ...]`
    _depth: int = 0  # 0 outside the array, 1 in it, 2 in a call's object
    _state: int = _KEY
    _in_str: bool = False
    _esc: bool = False
    _buf: list[str] = field(default_factory=list)  # a key, or the name's JSON string
    _key: str = ""
    _vdepth: int = 0  # nesting inside the current value
    _v_started: bool = False
    _index: int = -1
    _name_seen: bool = False
    _args_sent: bool = False
    _pending: list[str] = field(default_factory=list)  # arguments before the name
    _out: list[DeltaToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """The content to send and the tool-call deltas for the output's next `text`."""
        if self._failed:
            return text, []
        if self._stopped:
            return "", []
        if self.plan.name is not None:
            if not self.called:
                if not text:
                    return "", []
                self.called = True
                return "", [DeltaToolCall(index=0, id=new_tool_call_id(), type="function",
                                          function=DeltaFunctionCall(name=self.plan.name,
                                                                     arguments=text))]
            return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
        if not self.called:
            self._held.append(text)
        for ch in text:
            if not self._char(ch):
                if self.called:  # calls were sent: what follows is dropped
                    self._stopped = True
                    break
                self._failed = True
                self._out.clear()
                return "".join(self._held), []
        return "", self._drain()

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """At the end of the output: held-back text that never became a call, as content."""
        if self.called or self._failed:
            return "", []
        self._failed = True
        return "".join(self._held), []

    # -- the scan ----------------------------------------------------------------------
    def _drain(self) -> list[DeltaToolCall]:
        """The pending deltas, a call's consecutive argument fragments merged."""
        merged: list[DeltaToolCall] = []
        for d in self._out:
            last = merged[-1] if merged else None
            if (last is not None and last.index == d.index and d.id is None
                    and last.function is not None and d.function is not None
                    and d.function.name is None):
                last.function.arguments = (last.function.arguments or "") + (
                    d.function.arguments or "")
            else:
                merged.append(d)
        self._out.clear()
        return merged

    def _args(self, text: str) -> None:
        if self._name_seen:
            self._args_sent = True
            self._out.append(DeltaToolCall(index=self._index,
                                           function=DeltaFunctionCall(arguments=text)))
        else:
            self._pending.append(text)

    def _char(self, ch: str) -> bool:
        """Scan one character; False when the output is not a list of calls."""
        if self._depth == 2 and self._state == _VALUE:
            return self._value_char(ch)
        if self._in_str:  # a key
            self._buf.append(ch)
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                self._key = json.loads("".join(self._buf))
                self._state = _COLON
            return True
        if ch.isspace():
            return True
        if self._depth == 0:
            if ch != "[" or self._index >= 0:
                return False
            self._depth = 1
        elif self._depth == 1:
            if ch == "{":
                self._depth, self._state, self._index = 2, _KEY, self._index + 1
                self._name_seen = self._args_sent = False
                self._pending.clear()
            elif ch == "]":
                self._depth = 0
            elif ch != "," or self._index < 0:
                return False
        elif self._state == _KEY:
            if ch == '"':
                self._in_str, self._buf = True, [ch]
            elif ch == "}":
                return self._end_call()
            else:
                return False
        elif self._state == _COLON:
            if ch != ":":
                return False
            self._state = _VALUE_START
        elif self._state == _VALUE_START:
            self._state, self._vdepth, self._v_started = _VALUE, 0, False
            self._buf = []
            return self._value_char(ch)
        elif self._state == _AFTER:
            if ch == ",":
                self._state = _KEY
            elif ch == "}":
                return self._end_call()
            else:
                return False
        return True

    def _take(self, ch: str) -> None:
        if self._key == "parameters":
            self._args(ch)
        elif self._key == "name":
            self._buf.append(ch)

    def _value_char(self, ch: str) -> bool:
        if self._in_str:
            self._take(ch)
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._vdepth == 0:
                    return self._end_value()
            return True
        if self._vdepth == 0 and self._v_started and (ch in ",}" or ch.isspace()):
            return self._end_value() and self._char(ch)  # a number, true, false or null
        self._v_started = True
        self._take(ch)
        if ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._vdepth += 1
        elif ch in "}]":
            self._vdepth -= 1
            if self._vdepth == 0:
                return self._end_value()
        return True

    def _end_value(self) -> bool:
        self._state = _AFTER
        if self._key == "name":
            try:
                name = json.loads("".join(self._buf))
            except ValueError:
                return False
            if not isinstance(name, str) or self._name_seen:
                return False
            self._name_seen = self.called = True
            self._out.append(DeltaToolCall(index=self._index, id=new_tool_call_id(),
                                           type="function",
                                           function=DeltaFunctionCall(name=name,
                                                                      arguments="")))
            if self._pending:
                self._args("".join(self._pending))
                self._pending.clear()
        return True

    def _end_call(self) -> bool:
        self._depth = 1
        if not self._name_seen:
            return False
        if not self._args_sent:
            self._args("{}")
        return True
