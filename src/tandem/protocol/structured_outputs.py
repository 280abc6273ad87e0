"""The structured-output constraint of one request (torch-free; the router and serving use it).

`StructuredOutputs` mirrors vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON
schema, serialized canonically), `json_object` (any JSON object), `regex`, `choice` (one of
the given strings, verbatim) or `grammar` (an EBNF grammar in GBNF / xgrammar syntax, or a
Lark grammar). `disable_any_whitespace` forbids whitespace between JSON tokens.

`validate()` enforces the bounds below before anything is compiled and raises
`StructuredOutputsError` (a ValueError; the API answers it with a 400) naming the problem.
`key()` is the cache key of the compiled grammar: equal constraints give equal keys, and a
schema built with `from_json_schema` is keyed the same whatever whitespace its text had (its
key order is kept: it orders the generated object's keys). The grammar engines live in
`tandem.engine.structured`.
"""

from __future__ import annotations

import json as _json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from itertools import accumulate
from typing import Any

MAX_SCHEMA_CHARS = 65_536  # canonical JSON of one schema
MAX_SCHEMA_DEPTH = 32  # nesting of objects / arrays in the schema document
MAX_GRAMMAR_CHARS = 65_536
MAX_REGEX_CHARS = 8_192
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1_024  # one choice
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """A constraint that is malformed, over a bound, or that the grammar engine cannot
    compile; the message names the problem (the API answers it with a 400)."""


def canonical_schema(schema: Mapping[str, Any] | str) -> str:
    """The canonical serialization of a JSON schema: no spaces, keys in the order given (NOT
    sorted: a schema's property order is the order the generated object's keys follow, as
    with OpenAI's structured outputs). A string is parsed first; raises StructuredOutputsError
    if it is not JSON."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise StructuredOutputsError(f"the JSON schema is not valid JSON: {exc}") from None
    try:
        return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputsError(f"the JSON schema is not serializable: {exc}") from None


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint. Mirrors vLLM's StructuredOutputsParams."""

    json: str | None = None  # a JSON schema, canonical (`canonical_schema`: key order kept)
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF / xgrammar syntax) or Lark, as vLLM's guided_grammar
    disable_any_whitespace: bool = False

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any] | str,
                         disable_any_whitespace: bool = False) -> StructuredOutputs:
        """The `json` constraint for a schema given as a dict or JSON text (canonicalized)."""
        return cls(json=canonical_schema(schema), disable_any_whitespace=disable_any_whitespace)

    @property
    def kind(self) -> str:
        """The one constraint set: one of KINDS (validate() first: with none or several set,
        this names the first one set, or "" for none)."""
        return next((k for k in KINDS if self._is_set(k)), "")

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is True if name == "json_object" else value is not None

    def key(self) -> str:
        """Canonical cache key: equal for equal constraints."""
        return _json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of the set fields (for the wire: P/D, tensor-parallel ranks)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value is False:
                continue
            out[f.name] = list(value) if f.name == "choice" else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputs:
        """Inverse of `to_dict`; raises StructuredOutputsError for an unknown field."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StructuredOutputsError(f"unknown structured outputs field {unknown[0]!r}")
        kwargs = dict(data)
        if kwargs.get("choice") is not None:
            kwargs["choice"] = tuple(kwargs["choice"])
        return cls(**kwargs)

    def validate(self) -> None:
        """Raise StructuredOutputsError unless exactly one constraint is set and within the
        bounds: schema text <= MAX_SCHEMA_CHARS, a JSON object, nesting <= MAX_SCHEMA_DEPTH,
        every `$ref` local ("#..."); grammar <= MAX_GRAMMAR_CHARS and regex <=
        MAX_REGEX_CHARS, neither empty; 1..MAX_CHOICES choices, each a non-empty string of
        <= MAX_CHOICE_CHARS. Checked once per instance (it is immutable): the request's
        SamplingParams, each of its n samples' copies, the compile check and the backend
        all validate it, and a large schema's parse costs milliseconds on the engine
        thread."""
        if self.__dict__.get("_valid"):
            return
        chosen = [k for k in KINDS if self._is_set(k)]
        if len(chosen) != 1:
            names = ", ".join(chosen) if chosen else "none"
            raise StructuredOutputsError(
                f"structured outputs take exactly one of {', '.join(KINDS)} (got {names})")
        if self.json is not None:
            _check_schema(self.json)
        if self.regex is not None:
            _check_text("regex", self.regex, MAX_REGEX_CHARS)
        if self.grammar is not None:
            _check_text("grammar", self.grammar, MAX_GRAMMAR_CHARS)
        if self.choice is not None:
            _check_choice(self.choice)
        object.__setattr__(self, "_valid", True)  # not a field: not in eq, key or to_dict


def _check_text(name: str, text: Any, limit: int) -> None:
    if not isinstance(text, str):
        raise StructuredOutputsError(f"the {name} must be a string")
    if not text.strip():
        raise StructuredOutputsError(f"the {name} is empty")
    if len(text) > limit:
        raise StructuredOutputsError(
            f"the {name} has {len(text)} characters, more than the limit of {limit}")


def _check_choice(choice: Any) -> None:
    if not isinstance(choice, tuple | list):
        raise StructuredOutputsError("choice must be a list of strings")
    if not choice:
        raise StructuredOutputsError("choice is empty: give at least one string")
    if len(choice) > MAX_CHOICES:
        raise StructuredOutputsError(
            f"choice has {len(choice)} entries, more than the limit of {MAX_CHOICES}")
    for i, item in enumerate(choice):
        if not isinstance(item, str):
            raise StructuredOutputsError(f"choice[{i}] is not a string")
        if not item:
            raise StructuredOutputsError(f"choice[{i}] is an empty string")
        if len(item) > MAX_CHOICE_CHARS:
            raise StructuredOutputsError(
                f"choice[{i}] has {len(item)} characters, more than the limit of "
                f"{MAX_CHOICE_CHARS}")


def _check_schema(text: Any) -> None:
    if not isinstance(text, str):
        raise StructuredOutputsError("the JSON schema must be serialized JSON text")
    if len(text) > MAX_SCHEMA_CHARS:
        raise StructuredOutputsError(
            f"the JSON schema has {len(text)} characters, more than the limit of "
            f"{MAX_SCHEMA_CHARS}")
    if _nesting(text) > MAX_SCHEMA_DEPTH:  # before parsing: not bounded by the recursion limit
        raise StructuredOutputsError(
            f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        schema = _json.loads(text)
    except RecursionError:
        raise StructuredOutputsError(
            f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as exc:
        raise StructuredOutputsError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise StructuredOutputsError(
            f"the JSON schema must be a JSON object, not {type(schema).__name__}")
    _walk_schema(schema, "#", 1)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _nesting(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON `text` (strings skipped): linear
    in the text, whatever the interpreter's recursion limit."""
    steps = (1 if c in "[{" else -1 for c in _JSON_STRING.sub("", text) if c in "[]{}")
    return max(accumulate(steps), default=0)


# keywords whose values are JSON data, not schemas: a "$ref" key inside is not a reference
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def _walk_schema(node: Any, where: str, depth: int, data: bool = False) -> None:
    """Depth and `$ref` checks (the depth bound keeps the recursion shallow). A `$ref` is
    checked where it is a string in a schema, not in data (`enum`, `const`, ...) nor as the
    name of a property."""
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputsError(
            f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at {where})")
    if isinstance(node, dict):
        ref = node.get("$ref")
        if not data and isinstance(ref, str) and not ref.startswith("#"):
            raise StructuredOutputsError(
                f"the JSON schema's $ref {ref!r} at {where} is not local: only references "
                "into the schema itself (\"#/...\") are supported")
        for name, child in node.items():
            if isinstance(child, dict | list):
                _walk_schema(child, f"{where}/{name}", depth + 1,
                             data or name in DATA_KEYWORDS)
    elif isinstance(node, list):
        for i, child in enumerate(node):
            if isinstance(child, dict | list):
                _walk_schema(child, f"{where}/{i}", depth + 1, data)
