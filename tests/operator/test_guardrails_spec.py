"""`spec.router.guardrails`: the CRD's camelCase keys become router.yaml's `guardrails` (the
router's checker's view, its defaults filled in), the classifier's `apiKeySecretRef` a
read-only Secret mount and `api_key_file`; what the router would refuse is refused at
admission naming the CRD path; `tandem render` shows the guardrails in the router's
ConfigMap. The random agreement of CRD, spec parsing and router: test_guardrails_random.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tandem.operator import crd_schema
from tandem.operator.spec import SpecError, parse_spec
from tandem.router.config import check_config
from tests.operator.crd_validate import schema_errors
from tests.operator.manifests import container, one, render
from tests.operator.samples import resource, schema, spec
from tests.operator.test_dryrun import documents, tandem_render

KEY_FILE = "/etc/tandem/guardrails/mod/api-key"
EXPECTED = {  # the "guardrails" sample's router.yaml `guardrails`
    "input": [
        {"name": "no-injection", "type": "regex", "action": "refuse",
         "pattern": "(?i)ignore (all )?previous instructions", "replacement": "[redacted]"},
        {"name": "pii-in", "type": "pii", "action": "redact", "kinds": ["email", "ssn"],
         "replacement": "[{kind}]"},
        {"name": "heuristics", "type": "injection", "action": "flag", "threshold": 2.0,
         "replacement": "[redacted]"},
        {"name": "size", "type": "limits", "action": "refuse", "max_chars": 20000,
         "max_messages": 50, "max_message_chars": 8000, "max_tools": 16,
         "replacement": "[redacted]"},
        {"name": "mod", "type": "classifier", "action": "refuse",
         "url": "http://moderation:8080/v1/moderations", "timeout_seconds": 0.5,
         "on_error": "allow", "threshold": 0.8, "categories": ["violence"],
         "max_chars": 16384, "model": "omni-moderation-latest", "api_key_file": KEY_FILE,
         "replacement": "[redacted]"}],
    "output": [
        {"name": "no-ssn", "type": "regex", "action": "redact",
         "pattern": r"\b\d{3}-\d{2}-\d{4}\b", "replacement": "[redacted]", "look_behind": 64},
        {"name": "words", "type": "blocklist", "action": "stop",
         "terms": ["secret plan", "codeword"], "case_sensitive": False, "whole_words": True,
         "replacement": "[redacted]"},
        {"name": "pii-out", "type": "pii", "action": "flag", "replacement": "[{kind}]"}],
    "policies": {
        "default": {"models": ["SmolLM2-135M-Instruct"], "max_context": 4096,
                    "max_tokens": 512, "guardrails": ["no-injection", "size"]},
        "tenants": {"acme_corp.eu": {"max_tokens": 1024, "adapters": ["sql"]}}},
    "audit": {"include_match": False, "log_passes": True},
}


def _router_yaml(docs: list[dict[str, Any]], name: str = "demo-router") -> dict[str, Any]:
    return yaml.safe_load(one(docs, "ConfigMap", f"{name}-config")["data"]["router.yaml"])


def _with(guardrails: Any, **router: Any) -> dict[str, Any]:
    return {"model": {"uri": "SmolLM2-135M-Instruct"},
            "router": {**router, "guardrails": guardrails}}


def test_the_sample_round_trips_into_router_yaml() -> None:
    cfg = _router_yaml(render("guardrails"))
    assert cfg["guardrails"] == EXPECTED
    assert check_config(cfg) == cfg  # the router's loader: nothing refused, added or dropped
    assert parse_spec(spec("guardrails")).router.guardrails.config == EXPECTED


def test_the_sample_is_valid_against_the_crd() -> None:
    doc = resource(spec("guardrails"))
    assert schema_errors(schema(), doc) == []  # OpenAPI, no pruned field, CEL rules
    stored = crd_schema.check(doc)  # as `tandem render` (and the API server) judge it
    ref = stored["spec"]["router"]["guardrails"]["input"][4]["apiKeySecretRef"]
    assert ref == {"name": "moderation", "key": "token"}
    assert parse_spec(stored["spec"]) == parse_spec(spec("guardrails"))


@pytest.mark.parametrize("mode", ["router", "gateway"])
def test_the_classifiers_key_is_a_read_only_secret_mount(mode: str) -> None:
    raw = spec("guardrails")
    if mode == "gateway":
        raw["router"]["mode"] = "gateway"
    docs = render(raw)
    name = "demo-router" if mode == "router" else "demo-epp"
    pod = one(docs, "Deployment", name)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "guardrail-keys"]
    assert volume == {"name": "guardrail-keys", "projected": {"defaultMode": 0o440, "sources": [
        {"secret": {"name": "moderation", "items": [{"key": "token", "path": "mod/api-key"}]}}]}}
    (mount,) = [m for m in container({"spec": {"template": {"spec": pod}}})["volumeMounts"]
                if m["name"] == "guardrail-keys"]
    assert mount == {"name": "guardrail-keys", "mountPath": "/etc/tandem/guardrails",
                     "readOnly": True}
    (classifier,) = [e for e in _router_yaml(docs, name)["guardrails"]["input"]
                     if e["type"] == "classifier"]
    assert classifier["api_key_file"] == f"{mount['mountPath']}/mod/api-key" == KEY_FILE


def test_the_secret_key_defaults_and_no_key_no_volume() -> None:
    g = {"input": [{"name": "m", "type": "classifier", "url": "https://mod.example/v1",
                    "action": "flag", "apiKeySecretRef": {"name": "mod"}}]}
    r = parse_spec(_with(g)).router.guardrails
    assert [(k.guardrail, k.secret.name, k.secret.key) for k in r.keys] == [
        ("m", "mod", "api-key")]
    docs = render(_with({"input": [{"name": "m", "type": "limits", "action": "refuse"}]}))
    pod = one(docs, "Deployment", "demo-router")["spec"]["template"]["spec"]
    assert "guardrail-keys" not in {v["name"] for v in pod["volumes"]}


def test_unset_or_empty_guardrails_leave_router_yaml_as_before() -> None:
    before = _router_yaml(render("aggregated"))
    assert "guardrails" not in before
    assert _router_yaml(render(_with({}))) == before


def _entry(**kw: Any) -> dict[str, Any]:
    return {"name": "g", "type": "regex", "pattern": "x", "action": "refuse", **kw}


REFUSED = [  # (guardrails, the start of the SpecError, the CRD's verdict: refused too?)
    ({"input": [_entry(maxChars=3)]}, "router.guardrails.input[0].maxChars: unknown key", True),
    ({"input": [_entry(max_chars=3)]},
     'router.guardrails.input[0]: unknown key "max_chars" (keys are camelCase: maxChars)', True),
    ({"inputs": []}, "router.guardrails.inputs: unknown key (known: audit, input", True),
    ({"input": [{"name": "l", "type": "limits", "action": "redact"}]},
     "router.guardrails.input[0].action: input should be 'refuse' or 'flag'", True),
    ({"output": [_entry()]},
     "router.guardrails.output[0].action: input should be 'redact', 'stop' or 'flag'", True),
    ({"output": [{"name": "l", "type": "limits", "action": "stop"}]},
     "router.guardrails.output[0].type: 'limits' is not one of regex, blocklist, pii", True),
    ({"input": [_entry(pattern=r"(a)\1")]},
     'router.guardrails.input[0].pattern: guardrail "g": RE2 cannot compile', False),
    ({"output": [_entry(pattern="(?<=a)b", action="stop")]},
     'router.guardrails.output[0].pattern: guardrail "g": RE2 cannot compile', False),
    ({"input": [_entry()], "policies": {"default": {"guardrails": ["nope"]}}},
     "router.guardrails.policies.default.guardrails: no guardrail named 'nope'", False),
    ({"policies": {"tenants": {"acme": {"guardrails": ["g"]}}}},
     "router.guardrails.policies.tenants.acme.guardrails: no guardrail named 'g'", False),
    ({"input": [_entry()], "output": [_entry(action="stop")]},
     'router.guardrails: two guardrails are named "g"', False),
    ({"policies": {"tenants": {"a b": {}}}},
     "router.guardrails.policies.tenants.a b: string should match pattern", False),
    ({"policies": {"tenants": {"acme": {"maxTokens": 0}}}},
     "router.guardrails.policies.tenants.acme.maxTokens: input should be greater than", True),
    ({"output": [_entry(apiKeySecretRef={"name": "k"}, action="stop")]},
     "router.guardrails.output[0].apiKeySecretRef: unknown key", True),
    ({"input": [{"name": "c", "type": "classifier", "url": "http://m", "action": "refuse",
                 "apiKeySecretRef": {"key": "k"}}]},
     "router.guardrails.input[0].apiKeySecretRef.name is required", True),
    ({"input": [{"name": "c", "type": "classifier", "url": "http://m", "action": "refuse",
                 "apiKeySecretRef": {"name": "k", "optional": True}}]},
     "router.guardrails.input[0].apiKeySecretRef: expected an object {name, key}", True),
    ({"input": [{"name": "p", "type": "pii", "kinds": ["dna"], "action": "flag"}]},
     "router.guardrails.input[0].kinds[0]: input should be 'email'", True),
    ({"audit": {"includeMatch": "yes"}},
     "router.guardrails.audit.includeMatch: input should be a valid boolean", True),
    ([], "router.guardrails: expected an object", True),
]


@pytest.mark.parametrize(("guardrails", "message", "crd_refuses"), REFUSED,
                         ids=[case[1][:60] for case in REFUSED])
def test_refusals_name_the_crd_path(guardrails: Any, message: str, crd_refuses: bool) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_with(guardrails))
    assert str(err.value).startswith(message), str(err.value)
    errors = schema_errors(schema(), resource(_with(copy.deepcopy(guardrails))))
    assert bool(errors) == crd_refuses, errors  # the rest only the operator (and router) know


def test_a_router_attached_elsewhere_takes_no_guardrails() -> None:
    raw = _with({"input": [_entry()]}, attachTo="alpha")
    with pytest.raises(SpecError, match=r"router\.attachTo: .*router\.guardrails"):
        parse_spec(raw)
    assert any("router.attachTo" in e for e in schema_errors(schema(), resource(raw)))


def test_tandem_render_shows_the_guardrails_in_the_router_config() -> None:
    text = yaml.safe_dump(resource(spec("guardrails")))
    proc = tandem_render("-f", "-", "-n", "ml", stdin=text)
    assert proc.returncode == 0, proc.stderr
    docs = documents(proc.stdout)
    assert _router_yaml(docs)["guardrails"] == EXPECTED
    pod = one(docs, "Deployment", "demo-router")["spec"]["template"]["spec"]
    assert "guardrail-keys" in {v["name"] for v in pod["volumes"]}
    bad = copy.deepcopy(resource(spec("guardrails")))
    bad["spec"]["router"]["guardrails"]["output"][0]["pattern"] = r"(\d)\1"
    proc = tandem_render("-f", "-", stdin=yaml.safe_dump(bad))
    assert proc.returncode == 1 and proc.stdout == ""
    assert "router.guardrails.output[0].pattern" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
