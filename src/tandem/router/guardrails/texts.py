"""The text of a request, as input guardrails read and redact it (`request_texts`).

Every string the model will read is a `TextField`: a completion's prompt and suffix (a
prompt of token ids is decoded with the model's tokenizer, and cannot be redacted), each
chat message's content (a string or its text parts), reasoning and tool-call arguments,
and a Responses API request's instructions and input items (text parts, function-call
arguments and outputs); and what a chat template renders besides: every string of the tool
definitions (names, descriptions, parameter schemas) and of `chat_template_kwargs`.
`TextField.set` writes a redacted text back into the body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Decode = Callable[[list[int]], str]


@dataclass
class TextField:
    """One string of the body: `holder[key]` (None: decoded from token ids, read-only);
    `message`: the index of the message or input item it belongs to (-1: none)."""

    text: str
    holder: Any = None
    key: Any = None
    message: int = -1

    @property
    def editable(self) -> bool:
        return self.holder is not None

    def set(self, text: str) -> None:
        assert self.holder is not None
        self.holder[self.key] = text
        self.text = text


@dataclass
class RequestTexts:
    """A request's text fields, and its shape (messages, tools) for the limits guardrail."""

    fields: list[TextField]
    messages: int = 0
    tools: int = 0

    def chars(self) -> int:
        return sum(len(f.text) for f in self.fields)


def request_texts(kind: str, data: dict[str, Any], decode: Decode | None) -> RequestTexts:
    """The text fields of `data` (`kind`: "completions", "chat" or "responses"). ValueError
    for a token-id prompt with no tokenizer to read it (`decode` None): a guardrail cannot
    pass what it cannot read."""
    out: list[TextField] = []
    if kind == "completions":
        _prompt(data, out, decode)
        _string(data, "suffix", out)
        return RequestTexts(out)
    if kind == "chat":
        messages = data.get("messages")
        messages = messages if isinstance(messages, list) else []
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                _message(m, i, out)
        _strings(data.get("chat_template_kwargs"), out)
        tools = data.get("tools")
        _strings(tools, out)
        return RequestTexts(out, len(messages), len(tools) if isinstance(tools, list) else 0)
    _string(data, "instructions", out)
    items = data.get("input")
    if isinstance(items, str):
        _string(data, "input", out, 0)
        items = [items]
    elif isinstance(items, list):
        for i, item in enumerate(items):
            if isinstance(item, dict):
                _message(item, i, out)
                for key in ("output", "arguments"):  # function_call(_output) items
                    _string(item, key, out, i)
    else:
        items = []
    tools = data.get("tools")
    _strings(tools, out)
    return RequestTexts(out, len(items), len(tools) if isinstance(tools, list) else 0)


def _string(holder: dict, key: str, out: list[TextField], message: int = -1) -> None:
    v = holder.get(key)
    if isinstance(v, str):
        out.append(TextField(v, holder, key, message))


def _strings(node: Any, out: list[TextField]) -> None:
    """Every string under `node` (keys of objects excluded), in order."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str):
                out.append(TextField(v, node, k))
            else:
                _strings(v, out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, str):
                out.append(TextField(v, node, i))
            else:
                _strings(v, out)


def _prompt(data: dict, out: list[TextField], decode: Decode | None) -> None:
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        out.append(TextField(prompt, data, "prompt"))
        return
    if not isinstance(prompt, list) or not prompt:
        return
    if all(isinstance(p, str) for p in prompt):
        out.extend(TextField(p, prompt, i, i) for i, p in enumerate(prompt))
        return
    batches = prompt if isinstance(prompt[0], list) else [prompt]
    if decode is None:
        raise ValueError("prompt: token ids cannot be checked by the guardrails without the "
                         "model's tokenizer; send text")
    for i, ids in enumerate(batches):
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
                for t in ids):  # what a guardrail cannot read does not pass it
            raise ValueError("prompt: a string, a list of strings, token ids or lists of "
                             "token ids")
        out.append(TextField(decode(ids), message=i))


def _message(m: dict, i: int, out: list[TextField]) -> None:
    content = m.get("content")
    if isinstance(content, str):
        out.append(TextField(content, m, "content", i))
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                _string(part, "text", out, i)
    for key in ("reasoning_content", "refusal"):
        _string(m, key, out, i)
    calls = m.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            _string(fn, "arguments", out, i)
