"""Rendered custom resources checked against the published CRDs vendored in schemas/ (each
unmodified below a licence header naming its release): the served version's
openAPIV3Schema after structural defaulting (OpenAPI 3.0, jsonschema underneath), no field
the structural schema would prune, and its CEL rules (`x-kubernetes-validations`, evaluated
with cel-python on the defaulted object; transition rules, which need an old object, are
not). `tests/operator/lws.py` adds the LeaderWorkerSet webhook's checks on top."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import yaml
from openapi_schema_validator import OAS30Validator

from tests.operator.samples import apply_defaults, unknown_fields

SCHEMAS = Path(__file__).with_name("schemas")
# (API group, kind) -> the vendored CRD
VENDORED = {
    ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"):
        "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    ("inference.networking.k8s.io", "InferencePool"):
        "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
}


def group_kind(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["apiVersion"].rpartition("/")[0], doc["kind"]


def vendored(doc: dict[str, Any]) -> bool:
    return group_kind(doc) in VENDORED


@cache
def crd(group: str, kind: str) -> dict[str, Any]:
    text = (SCHEMAS / VENDORED[group, kind]).read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def schema_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The openAPIV3Schema of the served version `doc` names (AssertionError otherwise)."""
    group, kind = group_kind(doc)
    c = crd(group, kind)
    assert c["spec"]["group"] == group and c["spec"]["names"]["kind"] == kind
    version = doc["apiVersion"].rpartition("/")[2]
    (v,) = [v for v in c["spec"]["versions"] if v["name"] == version]
    assert v["served"], f"{doc['apiVersion']} {kind} is not served"
    return v["schema"]["openAPIV3Schema"]


def _cel_value(node: dict[str, Any], value: Any) -> Any:
    """JSON -> what CEL sees: `type: number` fields are doubles even when written as 1."""
    if node.get("type") == "number" and isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        props, extra = node.get("properties") or {}, node.get("additionalProperties")
        return {k: _cel_value(props.get(k) or (extra if isinstance(extra, dict) else {}), v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_value(node.get("items") or {}, v) for v in value]
    return value


def rule_sites(node: dict[str, Any], value: Any,
               path: str = "") -> Iterator[tuple[dict[str, Any], Any, str]]:
    """(rule, the value it applies to, where) for every rule of every node in `value`."""
    for rule in node.get("x-kubernetes-validations", []):
        yield rule, value, path or "."
    if isinstance(value, dict):
        props, extra = node.get("properties") or {}, node.get("additionalProperties")
        for key, sub in value.items():
            child = props.get(key) or (extra if isinstance(extra, dict) else None)
            if child is not None:
                yield from rule_sites(child, sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, v in enumerate(value):
            yield from rule_sites(node["items"], v, f"{path}[{i}]")


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def cel_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """The messages of the CEL rules the (defaulted) `obj` breaks."""
    obj = _cel_value(schema, obj)
    out = []
    for rule, value, where in rule_sites(schema, obj):
        if "oldSelf" in rule["rule"]:
            continue
        program = _PROGRAMS.get(rule["rule"])
        if program is None:
            program = _PROGRAMS[rule["rule"]] = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not result:
            out.append(f"{where}: {rule.get('message') or rule['rule']}")
    return out


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """What the API server would refuse (or prune) of `doc` by its vendored CRD."""
    schema = schema_of(doc)
    obj = apply_defaults(schema, copy.deepcopy(doc))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in OAS30Validator(schema).iter_errors(obj)]
    return errors + unknown_fields(schema, doc) + cel_errors(schema, obj)
