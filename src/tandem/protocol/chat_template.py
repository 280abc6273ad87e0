"""Sandboxed rendering of Hugging Face-style Jinja chat templates.

A chat template ships inside a model file, so it is untrusted: it runs in jinja2's immutable
sandbox, with the HF helpers (`raise_exception`, `tojson`, `strftime_now`, loop controls and
the `{% generation %}` tag), size-checked `*`/`**`/`+` and a bound on the rendered size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_OUTPUT_CHARS = 4_000_000  # default bound on one rendered prompt
_MAX_VALUE_CHARS = 4_000_000  # bound on a string/list built by `*` or `+` inside a template
_MAX_EXPONENT = 256


class ChatTemplateError(ValueError):
    """Bad messages, a template that fails to compile or render, or a template that raised."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that also refuses to build huge values with `*`, `**` and `+`."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # the common case
            if len(left) + len(right) > _MAX_VALUE_CHARS:
                raise SecurityError("template operation '+' builds a value that is too large")
            return left + right
        too_big = False
        if operator == "**":
            too_big = isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(count, int):
                    too_big = too_big or _size(seq) * count > _MAX_VALUE_CHARS
        elif _size(left) is not None and _size(right) is not None:
            too_big = _size(left) + _size(right) > _MAX_VALUE_CHARS
        if too_big:
            raise SecurityError(f"template operation {operator!r} builds a value that is too large")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


_ENV = _make_env()


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string (LRU-cached); ChatTemplateError on bad syntax."""
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error (line {exc.lineno}): {exc}") from None
    except Exception as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None


@lru_cache(maxsize=32)
def _compiled(template: str) -> tuple[jinja2.Template, dict[str, Any]]:
    """The compiled template and its globals as one plain dict, so a render's context is one
    dict merge instead of Jinja flattening its ChainMap of globals every time."""
    compiled = compile_template(template)
    return compiled, dict(compiled.globals)


def _content_text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(f"messages[{index}]: unsupported content part {kind!r}; "
                                        "only {'type': 'text', 'text': ...} parts are accepted")
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"messages[{index}]: text part without a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"messages[{index}]: 'content' must be a string or a list of "
                            f"text parts, not {type(content).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated copies: `role` a non-empty string, `content` a string (text parts joined by
    newlines, like vLLM) or None only beside `tool_calls`; other keys pass through."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict, not {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}]: 'role' must be a non-empty string")
        content = _content_text(message.get("content"), i)
        if content is None and not message.get("tool_calls"):
            raise ChatTemplateError(f"messages[{i}]: missing 'content'")
        out.append({**message, "content": content})
    return out


# the variables a render sets itself, which `chat_template_kwargs` may not replace
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                    "bos_token", "eos_token", "raise_exception",
                                    "strftime_now"})
MAX_TEMPLATE_KWARGS = 64


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs` (vLLM's: extra template variables such as Qwen3's
    `enable_thinking`) as a dict; ChatTemplateError for a variable the render sets itself
    (`messages`, `tools`, ...), a name that is not an identifier, or too many of them."""
    out = dict(kwargs or {})
    if len(out) > MAX_TEMPLATE_KWARGS:
        raise ChatTemplateError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} keys")
    for key in out:
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ChatTemplateError(f"chat_template_kwargs: {str(key)[:64]!r} is not a "
                                    "template variable name")
        if key in RESERVED_TEMPLATE_VARS:
            raise ChatTemplateError(f"chat_template_kwargs may not set {key!r} (the request "
                                    "sets it)")
    return out


def render_chat(template: str, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                *, max_output_chars: int = MAX_OUTPUT_CHARS, **extra: Any) -> str:
    """Render `messages` through `template` in the sandbox; raises ChatTemplateError on bad
    messages, template errors, sandbox violations or output over `max_output_chars`."""
    compiled, template_globals = _compiled(template)
    # as transformers' apply_chat_template: `tools` and `documents` are defined (None unless
    # given), so that templates testing `tools is not none` see no tools
    context = {**template_globals, "tools": None, "documents": None, **extra,
               "messages": normalize_messages(messages),
               "bos_token": bos_token, "eos_token": eos_token,
               "add_generation_prompt": add_generation_prompt}
    chunks: list[str] = []
    size = 0
    try:  # what Template.generate does, with the globals already merged in
        for chunk in compiled.root_render_func(compiled.new_context(context, shared=True)):
            size += len(chunk)
            if size > max_output_chars:
                raise ChatTemplateError(f"rendered chat prompt exceeds {max_output_chars} chars")
            chunks.append(chunk)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {exc}") from None
    except Exception as exc:  # undefined names, type errors, recursion, ... in the template
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    return "".join(chunks)
