"""An InferenceService judged by the CRD's own `openAPIV3Schema`, as the API server judges a
created object: strict field validation (what `kubectl apply` asks for by default since
1.27: an unknown field is an error naming its path, metadata's checked as ObjectMeta's),
null fields dropped, structural defaulting, then the schema's value validations (types,
enums, required, bounds, lengths, patterns, item and property counts, list-type keys).
The CEL rules (`x-kubernetes-validations`) are left to the operator's own spec checks
(`parse_spec` repeats them). The schema is the packaged copy of the CRD
(`tandem/operator/crd/inferenceservice.yaml`, byte for byte `crds/`'s), its served version.

Paths are written as the API server writes them: `spec.decode.replicas`, a list item
`spec.router.allowedClients[0]`, a map key `spec.decode.podLabels[team]`."""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from datetime import date
from importlib import resources
from typing import Any

import yaml

CRD_FILE = "inferenceservice.yaml"
# ObjectMeta's fields (strict decoding of metadata; the CRD's schema says only `object`)
# ObjectMeta's fields and their JSON types (strict decoding of metadata; the CRD's schema
# says only `object`)
META_TYPES = {
    "name": "string", "generateName": "string", "namespace": "string", "selfLink": "string",
    "uid": "string", "resourceVersion": "string", "generation": "integer",
    "creationTimestamp": "string", "deletionTimestamp": "string",
    "deletionGracePeriodSeconds": "integer", "labels": "object", "annotations": "object",
    "ownerReferences": "array", "finalizers": "array", "managedFields": "array"}
OBJECT_META = frozenset(META_TYPES)
STRING_MAPS = ("labels", "annotations")


@dataclass(frozen=True)
class CrdSchema:
    """The served version of the CRD: `group/version`, kind and its openAPIV3Schema."""

    api_version: str
    kind: str
    schema: dict[str, Any]


@dataclass
class Invalid(Exception):
    """The API server's refusal: `unknown` fields (strict decoding) or else `errors`
    (`path: reason` each); `str()` is kubectl's message."""

    kind: str
    name: str
    unknown: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.unknown:
            return (f'{self.kind} "{self.name}": strict decoding error: '
                    + ", ".join(f'unknown field "{p}"' for p in self.unknown))
        head = f'The {self.kind} "{self.name}" is invalid:'
        if len(self.errors) == 1:
            return f"{head} {self.errors[0]}"
        return head + "\n" + "\n".join(f"* {e}" for e in self.errors)


@functools.cache
def packaged_crd() -> dict[str, Any]:
    """The CRD shipped inside the package (what `tandem render` validates against)."""
    text = (resources.files("tandem.operator") / "crd" / CRD_FILE).read_text("utf-8")
    return yaml.safe_load(text)


def crd_schema(crd: dict[str, Any] | None = None) -> CrdSchema:
    """The served (storage, when several are) version's schema of `crd` (default: packaged)."""
    crd = packaged_crd() if crd is None else crd
    served = [v for v in crd["spec"]["versions"] if v.get("served")]
    version = next((v for v in served if v.get("storage")), served[0])
    return CrdSchema(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"],
                     version["schema"]["openAPIV3Schema"])


def _key(path: str, key: str, declared: bool) -> str:
    if declared:
        return f"{path}.{key}" if path else key
    return f"{path}[{key}]"


# ---- strict decoding ----------------------------------------------------------------------

def unknown_fields(node: dict[str, Any], value: Any, path: str = "", *,
                   json_schema: bool = False) -> list[str]:
    """The paths of fields `node` does not declare, in document order. A node with
    `x-kubernetes-preserve-unknown-fields` keeps unknown fields (its declared ones are still
    walked); `additionalProperties` declares every key. `json_schema`: JSON Schema's rule
    instead of a structural schema's (a helm chart's values.schema.json): only an object with
    `additionalProperties: false` refuses a key it does not declare."""
    out: list[str] = []
    if isinstance(value, list):
        items = node.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                out += unknown_fields(items, item, f"{path}[{i}]", json_schema=json_schema)
        return out
    if not isinstance(value, dict):
        return out
    if path == "metadata" and not json_schema:
        return [f"metadata.{k}" for k in value if k not in OBJECT_META]
    props = node.get("properties") or {}
    extra = node.get("additionalProperties")
    keep = node.get("x-kubernetes-preserve-unknown-fields") or extra is True
    closed = extra is False if json_schema else not keep and (props or node.get("type") ==
                                                             "object")
    for key, sub_value in value.items():
        key = str(key)
        if key in props:
            out += unknown_fields(props[key], sub_value, _key(path, key, True),
                                  json_schema=json_schema)
        elif isinstance(extra, dict):
            out += unknown_fields(extra, sub_value, _key(path, key, False),
                                  json_schema=json_schema)
        elif closed:
            out.append(_key(path, key, True))
    return out


# ---- pruning of nulls, defaulting ---------------------------------------------------------

def drop_nulls_and_default(node: dict[str, Any], value: Any) -> Any:
    """A copy of `value` with null fields the schema does not call `nullable` dropped, then
    structural defaults applied top-down (a defaulted object gets its own defaults in turn),
    as the API server stores a created object."""
    if isinstance(value, list):
        items = node.get("items")
        return [drop_nulls_and_default(items, v) if isinstance(items, dict) else v
                for v in value]
    if not isinstance(value, dict):
        return value
    props = node.get("properties") or {}
    extra = node.get("additionalProperties")
    out = {}
    for key, sub_value in value.items():
        sub = props.get(key, extra if isinstance(extra, dict) else {})
        if sub_value is None and not sub.get("nullable"):
            continue
        out[key] = drop_nulls_and_default(sub, sub_value)
    for key, sub in props.items():
        if key not in out and "default" in sub:
            out[key] = drop_nulls_and_default(sub, copy.deepcopy(sub["default"]))
    return out


# ---- value validation ---------------------------------------------------------------------

def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str | date):  # YAML timestamps: strings to the API server
        return "string"
    return "array" if isinstance(value, list) else "object"


def _show(value: Any) -> str:
    if isinstance(value, date):
        value = value.isoformat()
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)


def _type_error(node: dict[str, Any], value: Any, path: str) -> str | None:
    kind = _type_of(value)
    if node.get("x-kubernetes-int-or-string"):
        wanted = ("integer", "string")
    elif "type" in node:
        wanted = (node["type"],)
    else:
        return None
    if kind in wanted or (kind == "integer" and "number" in wanted):
        return None
    if kind == "null" and node.get("nullable"):
        return None
    return (f"{path}: Invalid value: {_show(value)}: {path} in body must be of type "
            f"{' or '.join(wanted)}: {_show(kind)}")


def _bounds(node: dict[str, Any], value: Any, path: str) -> list[str]:
    out = []
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = node.get("minimum"), node.get("maximum")
        for bound, above in (("exclusiveMinimum", True), ("exclusiveMaximum", False)):
            limit = node.get(bound)  # JSON Schema draft 6+: a number (OpenAPI v3: a flag)
            if isinstance(limit, int | float) and not isinstance(limit, bool) and not (
                    value > limit if above else value < limit):
                out.append(f"should be {'greater' if above else 'less'} than {limit}")
        if low is not None:
            if node.get("exclusiveMinimum") is True and not value > low:
                out.append(f"should be greater than {low}")
            elif node.get("exclusiveMinimum") is not True and not value >= low:
                out.append(f"should be greater than or equal to {low}")
        if high is not None:
            if node.get("exclusiveMaximum") is True and not value < high:
                out.append(f"should be less than {high}")
            elif node.get("exclusiveMaximum") is not True and not value <= high:
                out.append(f"should be less than or equal to {high}")
        step = node.get("multipleOf")
        if step and (value / step) != int(value / step):
            out.append(f"should be a multiple of {step}")
    if isinstance(value, str):
        if "minLength" in node and len(value) < node["minLength"]:
            out.append(f"should be at least {node['minLength']} chars long")
        if "maxLength" in node and len(value) > node["maxLength"]:
            return [f"{path}: Too long: may not be more than {node['maxLength']} bytes"]
        if "pattern" in node and not re.search(node["pattern"], value):
            out.append(f"should match '{node['pattern']}'")
    if isinstance(value, list):
        if node.get("uniqueItems") and len({_show(v) for v in value}) < len(value):
            out.append("shouldn't contain duplicates")
        if "minItems" in node and len(value) < node["minItems"]:
            out.append(f"should have at least {node['minItems']} items")
        if "maxItems" in node and len(value) > node["maxItems"]:
            return [f"{path}: Too many: {len(value)}: must have at most {node['maxItems']} "
                    "items"]
    if isinstance(value, dict):
        if "minProperties" in node and len(value) < node["minProperties"]:
            out.append(f"should have at least {node['minProperties']} properties")
        if "maxProperties" in node and len(value) > node["maxProperties"]:
            return [f"{path}: Too many: {len(value)}: must have at most "
                    f"{node['maxProperties']} items"]
    return [f"{path}: Invalid value: {_show(value)}: {path} in body {why}" for why in out]


def _list_keys(node: dict[str, Any], value: list[Any], path: str) -> list[str]:
    kind = node.get("x-kubernetes-list-type")
    if kind not in ("set", "map"):
        return []
    keys = node.get("x-kubernetes-list-map-keys") or []
    seen, out = set(), []
    for i, item in enumerate(value):
        key = (_show({k: item.get(k) for k in keys}) if kind == "map" and isinstance(item, dict)
               else _show(item))
        if key in seen:
            out.append(f"{path}[{i}]: Duplicate value: {key}")
        seen.add(key)
    return out


def validate(node: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """The value validations `value` fails under `node` (`path: reason` each, in document
    order); a value of the wrong type is reported once, nothing below it."""
    where = path or "<root>"
    error = _type_error(node, value, where)
    if error:
        return [error]
    out: list[str] = []
    if "enum" in node and value not in node["enum"]:
        out.append(f"{where}: Unsupported value: {_show(value)}: supported values: "
                   + ", ".join(_show(v) for v in node["enum"]))
    out += _bounds(node, value, where)
    for branch_kind in ("allOf", "anyOf", "oneOf", "not"):
        branches = node.get(branch_kind)
        if branches is None:
            continue
        if branch_kind == "not":
            if not validate(branches, value, path):
                out.append(f"{where}: Invalid value: {_show(value)}: must not validate the "
                           "schema (not)")
            continue
        passed = [not validate(b, value, path) for b in branches]
        if branch_kind == "allOf":
            out += [e for b in branches for e in validate(b, value, path)]
        elif branch_kind == "anyOf" and not any(passed):
            out.append(f"{where}: Invalid value: {_show(value)}: {where} in body must "
                       "validate at least one schema (anyOf)")
        elif branch_kind == "oneOf" and sum(passed) != 1:
            out.append(f"{where}: Invalid value: {_show(value)}: {where} in body must "
                       "validate one and only one schema (oneOf)")
    if isinstance(value, list):
        out += _list_keys(node, value, where)
        if isinstance(node.get("items"), dict):
            for i, item in enumerate(value):
                out += validate(node["items"], item, f"{path}[{i}]")
    elif isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key in node.get("required") or []:
            if key not in value:
                out.append(f"{_key(path, key, True)}: Required value")
        for key, sub_value in value.items():
            if key in props:
                out += validate(props[key], sub_value, _key(path, str(key), True))
            elif isinstance(extra, dict):
                out += validate(extra, sub_value, _key(path, str(key), False))
    return out


def _meta_errors(meta: dict[str, Any]) -> list[str]:
    """ObjectMeta's field types (a namespace or uid that is not a string, ...) and its
    labels' and annotations' values."""
    out = []
    for field, value in meta.items():
        where = f"metadata.{field}"
        error = _type_error({"type": META_TYPES[field]}, value, where)
        if error:
            out.append(error)
        elif field in STRING_MAPS:
            out += [f"{where}[{k}]: Invalid value: {_show(v)}: {where}[{k}] in body must be "
                    "of type string" for k, v in value.items() if not isinstance(v, str)]
    return out


# ---- the whole object ---------------------------------------------------------------------

def check(doc: dict[str, Any], crd: CrdSchema | None = None) -> dict[str, Any]:
    """The object the API server would store for `doc` (nulls dropped, defaults applied);
    `Invalid` with what it would refuse: unknown fields first (strict decoding stops
    there), else the value validations, ObjectMeta's labels and annotations included."""
    crd = crd_schema() if crd is None else crd
    meta = doc.get("metadata")
    name = str(meta.get("name", "")) if isinstance(meta, dict) else ""
    unknown = unknown_fields(crd.schema, doc)
    if unknown:
        raise Invalid(crd.kind, name, unknown=tuple(sorted(unknown)))
    stored = drop_nulls_and_default(crd.schema, doc)
    errors = validate(crd.schema, stored)
    if isinstance(stored.get("metadata"), dict):
        errors += _meta_errors(stored["metadata"])
    if errors:
        raise Invalid(crd.kind, name, errors=tuple(errors))
    return stored
