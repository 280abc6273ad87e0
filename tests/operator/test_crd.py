"""The InferenceService CRD: a valid CustomResourceDefinition (Kubernetes 1.32 schema, strict),
a structural schema (the API server's rules, checked here without one), samples valid and
invalid against its openAPIV3Schema for the stated reason, its CEL rules evaluated (cel-python,
numbers typed as the API server types them), and defaults that agree with `parse_spec`."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import kubernetes_validate
import pytest
from openapi_schema_validator import OAS30Validator

from tandem.operator.spec import parse_spec
from tests.operator.manifests import set_path
from tests.operator.samples import SPECS, apply_defaults, crd, resource, schema, spec

FORBIDDEN = {"$ref", "$schema", "id", "definitions", "dependencies", "patternProperties",
             "additionalItems", "uniqueItems"}


def test_crd_is_a_valid_custom_resource_definition():
    kubernetes_validate.validate(crd(), "1.32", strict=True)


def test_crd_names_scope_and_subresources():
    c = crd()["spec"]
    assert (c["group"], c["scope"], c["names"]["kind"]) == (
        "tandem.dev", "Namespaced", "InferenceService")
    assert c["names"]["shortNames"] == ["tisvc"]  # `isvc` is KServe's
    (v,) = c["versions"]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert v["subresources"]["status"] == {}
    s = schema()
    for path in v["subresources"]["scale"].values():
        assert _schema_at(s, path)["type"] in ("integer", "string")
    assert _schema_at(s, v["subresources"]["scale"]["labelSelectorPath"])["type"] == "string"
    columns = {col["name"]: col for col in v["additionalPrinterColumns"]}
    assert {"Model", "Prefill", "Decode", "Endpoint", "Age"} <= set(columns)
    for col in columns.values():
        path = col["jsonPath"].split("[")[0]
        if not path.startswith(".metadata"):
            assert _schema_at(s, path)["type"] in (col["type"], "array"), col


def _schema_at(s: dict, json_path: str) -> dict:
    for key in json_path.strip(".").split("."):
        s = s["properties"][key]
    return s


def _nodes(node: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _nodes(sub, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}[*]")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")


def test_schema_is_structural():
    root = schema()
    assert root["type"] == "object"
    assert root["properties"]["metadata"] == {"type": "object"}
    for path, node in _nodes(root):
        assert not FORBIDDEN & set(node), (path, FORBIDDEN & set(node))
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in ("object", "array", "string", "integer", "number",
                                        "boolean"), path
        for junction in ("anyOf", "allOf", "oneOf"):
            for branch in node.get(junction, []):
                if not node.get("x-kubernetes-int-or-string"):
                    assert not {"type", "default", "description", "nullable",
                                "additionalProperties"} & set(branch), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), path
        if node.get("type") == "object" and path != ".metadata":
            assert ("properties" in node or "additionalProperties" in node
                    or node.get("x-kubernetes-preserve-unknown-fields")), path
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), path
        for rule in node.get("x-kubernetes-validations", []):
            assert set(rule) == {"rule", "message"}, path
        if "enum" in node:
            kind = {"string": str, "integer": int, "number": (int, float)}[node["type"]]
            assert all(isinstance(v, kind) for v in node["enum"]), path


def test_defaults_validate_against_their_own_schema():
    seen = 0
    for path, node in _nodes(schema()):
        if "default" in node:
            seen += 1
            errors = list(OAS30Validator(node).iter_errors(node["default"]))
            assert not errors, (path, errors)
    assert seen > 20


def _errors(obj: dict) -> list:
    return list(OAS30Validator(schema()).iter_errors(obj))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_valid_samples_pass_the_schema(name):
    assert _errors(resource(spec(name))) == []
    assert _errors(resource(apply_defaults(schema()["properties"]["spec"], spec(name)))) == []


INVALID = [  # (what, where in spec, value, keyword that must fail, at this path)
    ("an unknown URI scheme", "model.uri", "s3://bucket/m", "pattern", "spec.model.uri"),
    ("a short digest", "model.sha256", "abc123", "pattern", "spec.model.sha256"),
    ("negative replicas", "decode.replicas", -1, "minimum", "spec.decode.replicas"),
    ("too many routers", "router.replicas", 101, "maximum", "spec.router.replicas"),
    ("an unknown policy", "router.policy", "fastest", "enum", "spec.router.policy"),
    ("an unknown dtype", "model.dtype", "int4", "enum", "spec.model.dtype"),
    ("autoscaling without a target", "decode.autoscaling", {"maxReplicas": 3}, "required",
     "spec.decode.autoscaling"),
    ("a zero target (exclusive minimum)", "decode.autoscaling",
     {"maxReplicas": 3, "target": 0}, "minimum", "spec.decode.autoscaling.target"),
    ("an unknown signal", "decode.autoscaling", {"maxReplicas": 3, "target": 1,
                                                 "signal": "cpu"}, "enum",
     "spec.decode.autoscaling.signal"),
    ("a KV budget in words", "decode.engine", {"kvCacheMemory": "lots"}, "pattern",
     "spec.decode.engine.kvCacheMemory"),
    ("a CPU quantity in words", "decode.resources", {"limits": {"cpu": "two"}}, "pattern",
     "spec.decode.resources.limits.cpu"),
    ("a toleration operator", "decode.tolerations", [{"key": "k", "operator": "Maybe"}],
     "enum", "spec.decode.tolerations.0.operator"),
    ("an unknown backend", "kvTransfer.backend", "rdma", "enum", "spec.kvTransfer.backend"),
    ("a scrape interval in words", "monitoring.interval", "often", "pattern",
     "spec.monitoring.interval"),
    ("a Redis URL Secret without a name", "router.redisUrlSecretRef", {"key": "url"},
     "required", "spec.router.redisUrlSecretRef"),
    ("an unknown issuer kind", "kvTransfer.tlsIssuerRef", {"name": "ca", "kind": "Vault"},
     "enum", "spec.kvTransfer.tlsIssuerRef.kind"),
    ("a selector operator", "router.allowedClients",
     [{"podSelector": {"matchExpressions": [{"key": "app", "operator": "Has"}]}}], "enum",
     "spec.router.allowedClients.0.podSelector.matchExpressions.0.operator"),
    ("an ipBlock without a CIDR", "router.allowedClients", [{"ipBlock": {"except": []}}],
     "required", "spec.router.allowedClients.0.ipBlock"),
    ("a key Secret name in the wrong type", "security.workerAuthSecretName", 7, "type",
     "spec.security.workerAuthSecretName"),
    ("a block size of 0", "prefill.engine", {"blockSize": 0}, "minimum",
     "spec.prefill.engine.blockSize"),
    ("a negative chunk cap", "prefill.engine", {"longPrefillTokenThreshold": -1}, "minimum",
     "spec.prefill.engine.longPrefillTokenThreshold"),
    ("an unknown device", "decode.engine", {"device": "tpu"}, "enum",
     "spec.decode.engine.device"),
    ("an unknown attention backend", "decode.engine", {"attentionBackend": "flash"}, "enum",
     "spec.decode.engine.attentionBackend"),
    ("a GPU memory share above 1", "decode.engine", {"gpuMemoryUtilization": 1.01}, "maximum",
     "spec.decode.engine.gpuMemoryUtilization"),
    ("a GPU memory share of 0 (exclusive minimum)", "decode.engine",
     {"gpuMemoryUtilization": 0}, "minimum", "spec.decode.engine.gpuMemoryUtilization"),
]


@pytest.mark.parametrize(("what", "path", "value", "keyword", "where"), INVALID,
                         ids=[case[0] for case in INVALID])
def test_invalid_samples_fail_for_the_stated_reason(what, path, value, keyword, where):
    errors = _errors(resource(set_path(spec("aggregated"), path, value)))
    assert [(e.validator, ".".join(map(str, e.absolute_path))) for e in errors] == [
        (keyword, where)], what


def test_a_spec_without_model_fails():
    errors = _errors(resource({"decode": {"replicas": 1}}))
    assert [(e.validator, e.message) for e in errors] == [
        ("required", "'model' is a required property")]


# ---- CEL --------------------------------------------------------------------------------

def _cel_value(node: dict, value: Any) -> Any:
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


def _rule_sites(node: dict, value: Any) -> Iterator[tuple[dict, Any]]:
    """(rule, the value it applies to) for every rule of every node present in `value`."""
    for rule in node.get("x-kubernetes-validations", []):
        yield rule, value
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key in value:
                yield from _rule_sites(sub, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for v in value:
            yield from _rule_sites(node["items"], v)


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def failed_rules(obj: dict) -> list[str]:
    """The messages of the CEL rules `obj` (defaulted first, as the API server does) breaks."""
    root = schema()
    obj = _cel_value(root, apply_defaults(root, copy.deepcopy(obj)))
    failed = []
    for rule, value in _rule_sites(root, obj):
        program = _PROGRAMS.get(rule["rule"])
        if program is None:
            program = _PROGRAMS[rule["rule"]] = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if not result:
            failed.append(rule["message"])
    return failed


def test_every_rule_compiles_and_is_reached_by_the_samples():
    rules = {r["rule"] for _, node in _nodes(schema())
             for r in node.get("x-kubernetes-validations", [])}
    assert len(rules) >= 6
    reached = set()
    for name in SPECS:
        obj = apply_defaults(schema(), resource(spec(name)))
        reached |= {rule["rule"] for rule, _ in _rule_sites(schema(), obj)}
    assert reached == rules


@pytest.mark.parametrize("name", sorted(SPECS))
def test_valid_samples_pass_every_cel_rule(name):
    assert failed_rules(resource(spec(name))) == []


CEL_INVALID = [
    ("disaggregated", "prefill.engine", {"blockSize": 32}, "blockSize must match"),
    ("aggregated", "prefill.autoscaling", {"maxReplicas": 2, "target": 1}, "prefill.replicas"),
    ("aggregated", "decode.autoscaling", {"minReplicas": 4, "maxReplicas": 2, "target": 1},
     "minReplicas must not exceed maxReplicas"),
    ("aggregated", "decode.autoscaling", {"maxReplicas": 2, "target": 2,
                                          "signal": "kvUtilization"}, "fraction in (0, 1]"),
    ("aggregated", "router.sharedIndex", True, "sharedIndex needs router.redisUrlSecretRef"),
    ("aggregated", "kvTransfer.tlsIssuerRef", {"name": "ca"}, "tlsIssuerRef needs"),
    ("aggregated", "router.allowedClients", [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                              "podSelector": {}}], "an ipBlock alone"),
    ("aggregated", "router.allowedClients", [{}], "an ipBlock alone"),
    ("aggregated", "router.allowedClients",
     [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}],
     "values are required with In"),
    ("aggregated", "router.allowedClients",
     [{"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Exists",
                                                   "values": ["x"]}]}}],
     "values are required with In"),
    ("aggregated", "monitoring.prometheus", {}, "needs a podSelector"),
    ("aggregated", "decode.resources", {"requests": {"nvidia.com/gpu": 1}},
     "nvidia.com/gpu goes in limits"),
    ("aggregated", "router.resources", {"requests": {"nvidia.com/gpu": 1},
                                        "limits": {"cpu": 1}}, "nvidia.com/gpu goes in limits"),
    ("aggregated", "decode.resources", {"limits": {"nvidia.com/gpu": 2}},
     "nvidia.com/gpu above parallelism.tensor"),
    ("disaggregated", "prefill.resources", {"limits": {"nvidia.com/gpu": "8"}},
     "one GPU per tensor-parallel rank"),
    ("aggregated", "decode", {"resources": {"limits": {"nvidia.com/gpu": 4}},
                              "parallelism": {"tensor": 6}},
     "parallelism.tensor must be a multiple of resources.limits nvidia.com/gpu"),
    ("aggregated", "decode.resources", {"limits": {"nvidia.com/gpu": "500m"}},
     "nvidia.com/gpu: whole GPUs"),
    ("aggregated", "decode.engine", {"device": "cuda"}, "engine.device cuda needs a GPU"),
    ("gpu", "decode.engine", {"device": "cpu"}, "would hold a GPU it never uses"),
]


@pytest.mark.parametrize(("name", "path", "value", "message"), CEL_INVALID,
                         ids=[case[3] for case in CEL_INVALID])
def test_cel_rules_reject_what_the_schema_alone_accepts(name, path, value, message):
    obj = resource(set_path(spec(name), path, value))
    assert _errors(obj) == []  # the OpenAPI part alone lets it through
    (failed,) = failed_rules(obj)
    assert message in failed


def test_cel_rule_on_the_name_length():
    assert failed_rules(resource(spec("aggregated"), name="a" * 52)) == []
    (failed,) = failed_rules(resource(spec("aggregated"), name="a" * 53))
    assert "at most 52" in failed


# ---- defaults agree with parse_spec -------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SPECS))
def test_crd_defaults_and_parse_spec_defaults_agree(name):
    raw = spec(name)
    defaulted = apply_defaults(schema()["properties"]["spec"], spec(name))
    assert defaulted != raw
    assert parse_spec(defaulted) == parse_spec(raw)


def test_weight_defaults_are_the_routers():
    from tandem.operator.render.router import SCORERS
    from tandem.router.policy import DEFAULT_WEIGHTS, SESSION_WEIGHT

    weights = schema()["properties"]["spec"]["properties"]["router"]["properties"]["weights"]
    # the router's: its scorers' defaults (a scorer it leaves out, `cost`, is off: 0) and
    # the session-affinity weight both policies read
    assert {SCORERS[k]: v["default"] for k, v in weights["properties"].items()} == (
        {**DEFAULT_WEIGHTS, "cost": 0.0, "session_affinity": SESSION_WEIGHT})
