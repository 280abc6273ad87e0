"""Custom resources checked as a cluster would check them, against the published CRDs
vendored in schemas/ (each unmodified below a licence header): the storage version's
openAPIV3Schema after structural defaulting (OpenAPI 3.0, jsonschema underneath), no field
the structural schema would prune, and the CRD's own CEL rules (`x-kubernetes-validations`,
cel-python, numbers typed as the API server types them). `validate` dispatches: a kind
vendored here (plus its controller's webhook checks, `EXTRA`), a CRD without a schema here
(`NO_SCHEMA`: skipped), else core Kubernetes strictly (kubernetes-validate).

Vendored: LeaderWorkerSet (kubernetes-sigs/lws v0.9.0, see lws.py for its webhook and pod
templates), KEDA's ScaledObject (kedacore/keda v2.20.2, `keda_errors`: its webhook's
replica bounds and the metrics-api scaler's metadata parsing), the Gateway API Inference
Extension's InferencePool (v1.6.0) and InferenceObjective (v1alpha2, from v1.5.0: the last
release publishing it) and the Gateway API's HTTPRoute (standard, v1.6.1).
Transition rules (`oldSelf`) need an old object and are not evaluated; a rule whose
evaluation errs counts as broken."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import yaml
from openapi_schema_validator import OAS30Validator

from tests.operator.samples import apply_defaults, unknown_fields

SCHEMAS = Path(__file__).with_name("schemas")
# (group, kind) -> the vendored CRD file
VENDORED = {("leaderworkerset.x-k8s.io", "LeaderWorkerSet"):
            "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
            ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
            ("inference.networking.k8s.io", "InferencePool"):
            "inference.networking.k8s.io_inferencepools.yaml",
            ("gateway.networking.k8s.io", "HTTPRoute"):
            "gateway.networking.k8s.io_httproutes.yaml",
            ("inference.networking.x-k8s.io", "InferenceObjective"):
            "inference.networking.x-k8s.io_inferenceobjectives.yaml"}
NO_SCHEMA = ("monitoring.coreos.com", "cert-manager.io")  # CRDs without a schema here


@cache
def load_crd(filename: str) -> dict[str, Any]:
    text = (SCHEMAS / filename).read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def crd_for(doc: dict[str, Any]) -> dict[str, Any] | None:
    group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
    name = VENDORED.get((group, doc["kind"]))
    return None if name is None else load_crd(name)


def served_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    """The openAPIV3Schema of `version`, which the CRD must serve."""
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert v["served"], f"{crd['metadata']['name']} does not serve {version}"
    return v["schema"]["openAPIV3Schema"]


# ---- CEL ---------------------------------------------------------------------------------

def cel_value(node: dict[str, Any], value: Any) -> Any:
    """JSON -> what CEL sees: `type: number` fields are doubles even when written as 1."""
    if node.get("type") == "number" and isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        props, extra = node.get("properties") or {}, node.get("additionalProperties")
        return {k: cel_value(props.get(k) or (extra if isinstance(extra, dict) else {}), v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [cel_value(node.get("items") or {}, v) for v in value]
    return value


def rule_sites(node: dict[str, Any], value: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    """(rule, the value it applies to) for every rule of every node present in `value`."""
    for rule in node.get("x-kubernetes-validations", []):
        yield rule, value
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key in value:
                yield from rule_sites(sub, value[key])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for sub_value in value.values():
                yield from rule_sites(extra, sub_value)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for v in value:
            yield from rule_sites(node["items"], v)


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def cel_failures(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """The messages of the CEL rules `obj` (defaulted first, as the API server does) breaks."""
    obj = cel_value(schema, apply_defaults(schema, copy.deepcopy(obj)))
    failed = []
    for rule, value in rule_sites(schema, obj):
        if "oldSelf" in rule["rule"]:
            continue
        program = _PROGRAMS.get(rule["rule"])
        if program is None:
            program = _PROGRAMS[rule["rule"]] = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not result:
            failed.append(rule.get("message", rule["rule"]))
    return failed


# ---- schema --------------------------------------------------------------------------------

def schema_errors(schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """What the API server refuses or prunes: schema errors after defaulting, unknown
    fields, broken CEL rules."""
    obj = apply_defaults(schema, copy.deepcopy(doc))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in OAS30Validator(schema).iter_errors(obj)]
    return errors + unknown_fields(schema, doc) + cel_failures(schema, doc)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """`doc` against its vendored CRD (the kind and version it names), plus `EXTRA`."""
    crd = crd_for(doc)
    assert crd is not None, f"no vendored CRD for {doc['apiVersion']} {doc['kind']}"
    group, version = doc["apiVersion"].split("/")
    assert (group, doc["kind"]) == (crd["spec"]["group"], crd["spec"]["names"]["kind"])
    extra = EXTRA.get(doc["kind"])
    return schema_errors(served_schema(crd, version), doc) + (extra(doc) if extra else [])


# ---- KEDA ----------------------------------------------------------------------------------

def _float(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def metrics_api_errors(trigger: dict[str, Any], where: str) -> list[str]:
    """KEDA v2.20.2's metrics-api scaler (pkg/scalers/metrics_api_scaler.go): url and
    valueLocation required, format json|prometheus|xml|yaml, numeric targetValue (non-zero:
    the ScaledObject is no metric source) and activationTargetValue, metricType AverageValue
    or Value (an External metric: no Utilization)."""
    m, out = trigger.get("metadata") or {}, []
    for key in ("url", "valueLocation"):
        if not m.get(key):
            out.append(f"{where}.metadata.{key}: required")
    if m.get("format", "json") not in ("prometheus", "json", "xml", "yaml"):
        out.append(f"{where}.metadata.format: {m['format']!r}")
    target = _float(m.get("targetValue", "0"))
    if not target:
        out.append(f"{where}.metadata.targetValue: a non-zero number, got "
                   f"{m.get('targetValue')!r}")
    if _float(m.get("activationTargetValue", "0")) is None:
        out.append(f"{where}.metadata.activationTargetValue: {m['activationTargetValue']!r}")
    if trigger.get("metricType", "AverageValue") not in ("AverageValue", "Value"):
        out.append(f"{where}.metricType: {trigger['metricType']!r}")
    return out


SCALERS: dict[str, Callable[[dict[str, Any], str], list[str]]] = {
    "metrics-api": metrics_api_errors}


def keda_errors(doc: dict[str, Any]) -> list[str]:
    """KEDA's webhook (CheckReplicaCountBoundsAreValid): min <= max (max default 100),
    idleReplicaCount < minReplicaCount; each trigger of a scaler checked here parses."""
    spec, out = doc["spec"], []
    lo, hi = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if lo > hi:
        out.append(f"MinReplicaCount={lo} must be less than MaxReplicaCount={hi}")
    if "idleReplicaCount" in spec and spec["idleReplicaCount"] >= lo:
        out.append(f"IdleReplicaCount={spec['idleReplicaCount']} must be less than "
                   f"MinReplicaCount={lo}")
    for i, t in enumerate(spec.get("triggers", [])):
        check = SCALERS.get(t.get("type"))
        assert check is not None, f"no check for KEDA scaler {t.get('type')!r}"
        out += check(t, f"spec.triggers[{i}]")
    return out


EXTRA: dict[str, Callable[[dict[str, Any]], list[str]]] = {"ScaledObject": keda_errors}


def validate(doc: dict[str, Any], version: str = "1.32") -> None:
    """Raises (kubernetes_validate.ValidationError, AssertionError) unless `doc` is valid:
    a vendored custom kind against its CRD, other custom kinds skipped (`NO_SCHEMA`), core
    kinds strictly."""
    if crd_for(doc) is not None:
        errors = crd_errors(doc)
        assert errors == [], errors
        return
    if doc["apiVersion"].split("/")[0] in NO_SCHEMA:
        return
    kubernetes_validate.validate(doc, version, strict=True)
