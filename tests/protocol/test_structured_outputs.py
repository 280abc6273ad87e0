"""The structured-output constraint spec: bounds, canonical keys, the wire form, torch-free."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tandem.protocol.structured_outputs as so
from tandem.protocol.structured_outputs import StructuredOutputs as S
from tandem.protocol.structured_outputs import StructuredOutputsError


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("spec, message", [
    (S(), "exactly one of json, json_object, regex, choice, grammar \\(got none\\)"),
    (S(regex="a", grammar='root ::= "a"'), "exactly one of .* \\(got regex, grammar\\)"),
    (S(json="[]"), "the JSON schema must be a JSON object, not list"),
    (S(json="{"), "the JSON schema is not valid JSON"),
    (S(json='{"description":"' + "x" * so.MAX_SCHEMA_CHARS + '"}'),
     f"the JSON schema has {so.MAX_SCHEMA_CHARS + 18} characters, more than the limit of "
     f"{so.MAX_SCHEMA_CHARS}"),
    (S(json='{"properties":{"a":{"$ref":"https://example.com/a.json"}}}'),
     "the JSON schema's \\$ref 'https://example.com/a.json' at #/properties/a is not local"),
    (S(json="[" * 2000 + "]" * 2000), "the JSON schema nests deeper than 32 levels"),
    (S.from_json_schema(nested(so.MAX_SCHEMA_DEPTH)), "nests deeper than 32 levels"),
    (S(regex=""), "the regex is empty"),
    (S(regex="a" * (so.MAX_REGEX_CHARS + 1)), "the regex has 8193 characters"),
    (S(grammar=" \n"), "the grammar is empty"),
    (S(grammar="x" * (so.MAX_GRAMMAR_CHARS + 1)), "the grammar has 65537 characters"),
    (S(choice=()), "choice is empty"),
    (S(choice=("a",) * (so.MAX_CHOICES + 1)), "choice has 257 entries, more than the limit"),
    (S(choice=("a", "")), "choice\\[1\\] is an empty string"),
    (S(choice=("a", 3)), "choice\\[1\\] is not a string"),
    (S(choice=("x" * (so.MAX_CHOICE_CHARS + 1),)), "choice\\[0\\] has 1025 characters"),
])
def test_validate_names_the_problem(spec, message) -> None:
    with pytest.raises(StructuredOutputsError, match=message):
        spec.validate()


def test_within_bounds_validates() -> None:
    S.from_json_schema(nested(so.MAX_SCHEMA_DEPTH // 2 - 1)).validate()
    S.from_json_schema({"$defs": {"p": {"type": "integer"}},
                        "properties": {"x": {"$ref": "#/$defs/p"}}}).validate()
    S.from_json_schema({"properties": {"$ref": {"type": "string"}},  # a property so named
                        "default": {"$ref": "https://example.com"},  # data, not a schema
                        "enum": [{"$ref": "x"}]}).validate()
    S(choice=("a",) * so.MAX_CHOICES).validate()
    S(json_object=True, disable_any_whitespace=True).validate()
    assert issubclass(StructuredOutputsError, ValueError)


def test_keys_are_canonical_and_keep_the_property_order() -> None:
    a = S.from_json_schema('{ "type": "object",\n "properties": {"b": {}, "a": {}} }')
    b = S.from_json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert a == b and a.key() == b.key()
    assert a.json == '{"type":"object","properties":{"b":{},"a":{}}}'
    swapped = S.from_json_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    assert swapped.key() != a.key()  # the order of the generated keys differs
    assert S(regex="a").key() != S(grammar="a").key()
    assert S(json_object=True).key() != S(json_object=True, disable_any_whitespace=True).key()
    with pytest.raises(StructuredOutputsError, match="not valid JSON"):
        S.from_json_schema("{'a': 1}")


def test_the_wire_form_round_trips() -> None:
    for spec in (S(choice=("é", "b")), S.from_json_schema({"type": "object"}),
                 S(json_object=True, disable_any_whitespace=True), S(grammar='root ::= "a"')):
        data = json.loads(json.dumps(spec.to_dict()))
        assert S.from_dict(data) == spec and S.from_dict(data).key() == spec.key()
    assert S(choice=("a",)).kind == "choice" and S().kind == ""
    with pytest.raises(StructuredOutputsError, match="unknown structured outputs field 'jsn'"):
        S.from_dict({"jsn": "{}"})


def test_module_is_torch_free() -> None:
    code = ("import sys, tandem.protocol.structured_outputs; "
            "bad = [m for m in sys.modules if m in ('torch', 'xgrammar', 'llguidance') "
            "or m.startswith('tandem.engine')]; assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": str(Path(so.__file__).parents[2])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_nesting_is_bounded_whatever_the_recursion_limit() -> None:
    """The depth bound holds before parsing: with a recursion limit high enough for
    `json.loads` to parse 2,000 levels (some libraries raise it), still the named refusal;
    brackets inside strings do not count."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)
    try:
        with pytest.raises(StructuredOutputsError, match="nests deeper than 32 levels"):
            S(json="[" * 2000 + "]" * 2000).validate()
    finally:
        sys.setrecursionlimit(limit)
    S(json='{"description": "' + "[{" * 100 + '\\"", "type": "string"}').validate()


def test_a_constraint_is_validated_once(monkeypatch) -> None:
    """A request's n samples, its compile check and the backend validate one instance: the
    schema is parsed once (a large one costs milliseconds on the engine thread)."""
    from tandem.engine.sampling_params import SamplingParams

    parses = []
    real = so._check_schema
    monkeypatch.setattr(so, "_check_schema", lambda text: (parses.append(text), real(text)))
    spec = S.from_json_schema(nested(3))
    params = SamplingParams(n=8, structured_outputs=spec)
    for i in range(8):
        assert params.clone_for_sample(i).structured_outputs is spec
    spec.validate()
    assert len(parses) == 1
    assert spec == S(json=spec.json) and spec.key() == S(json=spec.json).key()
    assert spec.to_dict() == {"json": spec.json}
    bad = S(json="[]")
    for _ in range(2):  # a failure is not remembered as a pass
        with pytest.raises(StructuredOutputsError, match="must be a JSON object"):
            bad.validate()
