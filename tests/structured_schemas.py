"""Seeded random JSON schemas and valid instances of them (tests and bench/grammar_backends.py).

`random_schema(seed)` gives an object schema with nested objects, string enums, arrays with
minItems / maxItems, integers with ranges, numbers, booleans, strings with length bounds and
required fields; every object has `additionalProperties: false` (what OpenAI's strict mode
asks for). `random_instance(schema, rng)` gives a value valid against it whose object keys
follow the schema's property order (the order constrained decoding generates them in);
`compact(value)` is its JSON text without whitespace. `is_valid(value, schema)` checks the
subset of JSON Schema these schemas use.
"""

from __future__ import annotations

import json
import random
from typing import Any

NAMES = ("id", "name", "age", "score", "tags", "items", "owner", "kind", "status", "count",
         "price", "active", "label", "notes", "level", "parts", "color", "size", "city", "code")
WORDS = ("red", "green", "blue", "alpha", "beta", "x", "hello world", "Zürich", "a\"b",
         "back\\slash", "tab\there", "line\nbreak", "42", "", "naïve café", "日本")
PLAIN = str.maketrans({"\"": "q", "\\": "s", "\t": "t", "\n": "n"})
ENUMS = (("low", "medium", "high"), ("on", "off"), ("cat", "dog", "bird", "fish"),
         ("north", "south", "east", "west"), ("yes", "no", "maybe"))


def random_schema(seed: int, max_depth: int = 3, max_props: int = 5) -> dict[str, Any]:
    """A seeded random object schema (see the module docstring)."""
    return _object(random.Random(seed), max_depth, max_props)


def _object(rng: random.Random, depth: int, max_props: int) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(1, max_props))
    props = {n: _value(rng, depth - 1, max_props) for n in names}
    required = [n for n in names if rng.random() < 0.6] or [names[0]]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int, max_props: int) -> dict[str, Any]:
    kinds = ["string", "enum", "integer", "number", "boolean", "array"]
    if depth > 0:
        kinds += ["object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        out: dict[str, Any] = {"type": "string"}
        if rng.random() < 0.4:
            lo = rng.randint(0, 3)
            out.update(minLength=lo, maxLength=lo + rng.randint(2, 12))
        return out
    if kind == "enum":
        return {"type": "string", "enum": list(rng.choice(ENUMS))}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        lo = rng.randint(0, 2)
        items = (_value(rng, depth - 1, max_props) if depth > 0
                 else {"type": rng.choice(["string", "integer", "boolean"])})
        return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    return _object(rng, depth, max_props)


def random_instance(schema: dict[str, Any], rng: random.Random,
                    plain_bounded: bool = False) -> Any:
    """A value valid against `schema` (one of random_schema's), keys in schema order.
    `plain_bounded`: strings with length bounds need no JSON escape (xgrammar 0.2 refuses
    escapes inside length-bounded strings)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        required = set(schema.get("required", ()))
        return {name: random_instance(sub, rng, plain_bounded)
                for name, sub in schema["properties"].items()
                if name in required or rng.random() < 0.5}
    if kind == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [random_instance(schema["items"], rng, plain_bounded) for _ in range(n)]
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 24)
        word = rng.choice(WORDS)
        if plain_bounded and ("minLength" in schema or "maxLength" in schema):
            word = word.translate(PLAIN)
        while len(word) < lo:
            word += rng.choice("abcxyz")
        return word[:hi]
    if kind == "integer":
        return rng.randint(schema.get("minimum", -10**6), schema.get("maximum", 10**6))
    if kind == "number":
        return rng.choice([0, 1.5, -2.25, 3.0e-3, 12345.678, -7])
    if kind == "boolean":
        return rng.random() < 0.5
    raise ValueError(f"unsupported schema {schema!r}")


def compact(value: Any) -> str:
    """JSON text without whitespace, non-ASCII kept as is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def is_valid(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` satisfies `schema` (the keywords random_schema uses)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", ())):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(is_valid(v, props[k]) for k, v in value.items() if k in props)
    if kind == "array":
        return (isinstance(value, list)
                and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
                and all(is_valid(v, schema["items"]) for v in value))
    if kind == "string":
        return (isinstance(value, str)
                and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 10**9))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -10**18) <= value <= schema.get("maximum", 10**18))
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return True
