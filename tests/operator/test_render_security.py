"""The security side of the rendered children: the worker-auth key Secret and its mount,
the gRPC peer identity and cert-manager Certificate, the Redis URL from a Secret,
and NetworkPolicies whose selectors, evaluated with NetworkPolicy semantics against the pods
of two InferenceServices in one namespace (and pods around them), admit exactly the intended
peers."""

from __future__ import annotations

import base64
import random

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tandem.operator.render import OperatorPeer, Owner, render_all
from tandem.operator.render.security import (
    OPERATOR_RELEASE_LABEL,
    operator_from_env,
    worker_auth_secret,
)
from tandem.operator.spec import parse_spec
from tests.operator.manifests import K8S, OWNER, arg, by_kind, container, one, render
from tests.operator.netpol import Pod, admits, admitted, pods_of, selects
from tests.operator.samples import SPECS, spec

KEY_FILE = "/etc/tandem/worker-auth/key"
# cert-manager.io/v1 Certificate, the fields the operator may set (from cert-manager's CRD;
# kubernetes-validate has no schema for it): unknown fields and bad enum values fail
_STR = {"type": "string", "minLength": 1}
CERTIFICATE_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Certificate"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["secretName", "issuerRef"],
            "properties": {
                "secretName": _STR, "commonName": _STR, "duration": _STR, "renewBefore": _STR,
                "dnsNames": {"type": "array", "minItems": 1, "items": _STR},
                "usages": {"type": "array", "uniqueItems": True, "items": {"enum": [
                    "signing", "digital signature", "content commitment", "key encipherment",
                    "key agreement", "data encipherment", "cert sign", "crl sign",
                    "encipher only", "decipher only", "any", "server auth", "client auth",
                    "code signing", "email protection", "s/mime", "ipsec end system",
                    "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
                    "microsoft sgc", "netscape sgc"]}},
                "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "size": {"enum": [2048, 3072, 4096, 8192, 256, 384, 521]}}},
                "issuerRef": {"type": "object", "additionalProperties": False,
                              "required": ["name"],
                              "properties": {"name": _STR, "kind": _STR, "group": _STR}}}}}}


def workloads(docs: list[dict]) -> list[dict]:
    return by_kind(docs, "Deployment")


# ---- the worker-auth key -------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SPECS))
def test_router_and_every_worker_mount_the_key_as_a_directory(name):
    docs = render(name)
    secret = "secure-signing-key" if name == "secure" else "demo-worker-auth"
    for d in workloads(docs):
        pod, c = d["spec"]["template"]["spec"], container(d)
        (vol,) = [v for v in pod["volumes"] if v["name"] == "worker-auth"]
        assert vol["secret"] == {"secretName": secret, "defaultMode": 0o440,
                                 "items": [{"key": "key", "path": "key"}]}
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "worker-auth"]
        # no subPath: the kubelet swaps the directory's files when the Secret changes
        assert mount == {"name": "worker-auth", "mountPath": "/etc/tandem/worker-auth",
                         "readOnly": True}
        assert arg(c["args"], "--worker-auth-key-file") == KEY_FILE
    assert not by_kind(docs, "Secret")  # created once by reconcile, never (re-)applied


def test_the_key_secret_is_32_fresh_random_bytes_owned_by_the_service():
    a, b = worker_auth_secret(OWNER), worker_auth_secret(OWNER)
    kubernetes_validate.validate(a, K8S, strict=True)
    assert (a["type"], a["metadata"]["name"], a["metadata"]["namespace"]) == (
        "Opaque", "demo-worker-auth", "ml")
    assert set(a["data"]) == {"key"}
    key = base64.b64decode(a["data"]["key"], validate=True)
    assert len(key) == 32
    assert key != base64.b64decode(b["data"]["key"])
    assert a["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_the_key_secret_name_is_in_no_config_hash_but_a_new_name_rolls_the_pods():
    """The pods read the key file themselves: nothing of the key is in the template; naming
    another Secret changes the volume, so the pods roll onto it."""
    base, other = spec("disaggregated"), spec("disaggregated")
    other["security"] = {"workerAuthSecretName": "rotated-by-hand"}
    before = {d["metadata"]["name"]: d["spec"]["template"] for d in workloads(render(base))}
    after = {d["metadata"]["name"]: d["spec"]["template"] for d in workloads(render(other))}
    assert all(before[n] != after[n] for n in before)
    assert render(base) == render(base)


# ---- TLS identity and the Certificate -----------------------------------------------

@pytest.mark.parametrize("name", ["tls", "secure"])
def test_tls_routers_and_workers_verify_the_services_identity(name):
    for d in workloads(render(name)):
        assert arg(container(d)["args"], "--grpc-tls-server-name") == "demo.ml.tandem.internal"
    for d in workloads(render("disaggregated")):
        assert "--grpc-tls-server-name" not in container(d)["args"]


def test_certificate_for_the_identity_from_the_issuer():
    docs = render("secure")
    (cert,) = by_kind(docs, "Certificate")
    jsonschema.Draft202012Validator(CERTIFICATE_SCHEMA).validate(cert)
    assert cert["metadata"]["name"] == "demo-grpc-tls"
    assert cert["spec"]["secretName"] == "secure-grpc-tls"
    assert cert["spec"]["dnsNames"] == ["demo.ml.tandem.internal"]
    assert set(cert["spec"]["usages"]) == {"server auth", "client auth", "digital signature",
                                           "key encipherment"}
    assert cert["spec"]["privateKey"]["rotationPolicy"] == "Always"
    assert cert["spec"]["issuerRef"] == {"name": "tandem-ca", "kind": "ClusterIssuer",
                                         "group": "cert-manager.io"}
    assert docs.index(cert) < docs.index(one(docs, "Deployment", "demo-decode"))
    assert not by_kind(render("tls"), "Certificate")  # a Secret made by hand: no issuer
    bad = dict(cert, spec={**cert["spec"], "usages": ["server auth", "mutual auth"]})
    with pytest.raises(jsonschema.ValidationError):  # the schema is not vacuous
        jsonschema.Draft202012Validator(CERTIFICATE_SCHEMA).validate(bad)


# ---- the Redis URL stays in its Secret ------------------------------------------------

def test_redis_url_comes_from_the_secret_into_the_routers_environment_only():
    for name, secret, key in (("disaggregated", "tandem-redis-url", "url"),
                              ("secure", "redis-auth", "redis-url")):
        docs = render(name)
        router = container(one(docs, "Deployment", "demo-router"))
        (env,) = [e for e in router["env"] if e["name"] == "TANDEM_REDIS_URL"]
        assert env == {"name": "TANDEM_REDIS_URL",
                       "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        cfg = yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])
        assert cfg["redis"] == "env:TANDEM_REDIS_URL"
        assert cfg.get("index") == ("env:TANDEM_REDIS_URL" if name == "disaggregated" else None)
        for d in workloads(docs):
            if d["metadata"]["name"] != "demo-router":
                assert "TANDEM_REDIS_URL" not in str(d)
    cfg = yaml.safe_load(one(render("aggregated"), "ConfigMap", "demo-router-config")["data"][
        "router.yaml"])
    assert "redis" not in cfg and "index" not in cfg


# ---- NetworkPolicies ---------------------------------------------------------------------

NS = "ml"
OPERATOR = OperatorPeer(namespace="tandem-system", release="tandem")


def two_services(raw: dict, operator: OperatorPeer | None = OPERATOR,
                 names: tuple[str, str] = ("alpha", "beta")) -> tuple[list[dict], list[Pod]]:
    docs, pods = [], []
    for i, name in enumerate(names):
        out = render_all(parse_spec(raw), Owner(name, NS, f"uid-{i}"), image="t",
                         operator=operator)
        docs += out
        pods += pods_of(out, NS)
    pods += [Pod("ml/stranger", NS, {"app": "stranger"}),
             Pod("tandem-system/operator", "tandem-system",
                 {"app.kubernetes.io/component": "operator", OPERATOR_RELEASE_LABEL: "tandem"}),
             Pod("tandem-system/other-operator", "tandem-system",
                 {"app.kubernetes.io/component": "operator", OPERATOR_RELEASE_LABEL: "other"}),
             Pod("ml/fake-operator", NS, {"app.kubernetes.io/component": "operator",
                                         OPERATOR_RELEASE_LABEL: "tandem"}),
             Pod("web/gateway", "web", {"app": "gateway"}, namespace_labels={"team": "web"}),
             Pod("web/ui", "web", {"app": "ui"}, ip="10.20.1.5",
                 namespace_labels={"team": "web"}),
             Pod("lab/gateway", "lab", {"app": "gateway"}, ip="10.20.9.7"),
             Pod("monitoring/prometheus", "monitoring",
                 {"app.kubernetes.io/name": "prometheus", "shard": "0"}),
             Pod("ml/prometheus", NS, {"app.kubernetes.io/name": "prometheus", "shard": "0"})]
    return by_kind(docs, "NetworkPolicy"), pods


def by_name(pods: list[Pod], name: str) -> Pod:
    (pod,) = [p for p in pods if p.name == name]
    return pod


@pytest.mark.parametrize("name", sorted(SPECS))
def test_policies_validate_strictly_with_every_peer_kind(name):
    docs = render(name, operator=OPERATOR)
    assert len(by_kind(docs, "NetworkPolicy")) == 2
    for doc in by_kind(docs, "NetworkPolicy"):
        kubernetes_validate.validate(doc, K8S, strict=True)


def test_workers_admit_only_their_own_router_and_peers():
    policies, pods = two_services(spec("disaggregated"))
    for svc, other in (("alpha", "beta"), ("beta", "alpha")):
        for pool in ("prefill", "decode"):
            target = by_name(pods, f"ml/{svc}-{pool}")
            peers = {f"ml/{svc}-prefill", f"ml/{svc}-decode"} - {target.name}
            assert admitted(policies, pods, target, 50051) == {f"ml/{svc}-router"} | peers
            # http: the router, and the release's operator (the autoscaler scrapes /metrics)
            assert admitted(policies, pods, target, 8000) == {
                f"ml/{svc}-router", "tandem-system/operator"}
            assert admitted(policies, pods, target, 41234) == set()  # no other port
            assert not {p.name for p in pods if p.name.startswith(f"ml/{other}-")} & (
                admitted(policies, pods, target, 50051) | admitted(policies, pods, target, 8000))


def test_routers_admit_clients_on_http_only():
    policies, pods = two_services(spec("disaggregated"))
    router = by_name(pods, "ml/alpha-router")
    everyone = {p.name for p in pods} - {router.name}
    assert admitted(policies, pods, router, 8000) == everyone  # the front door
    assert admitted(policies, pods, router, 50051) == set()


def test_allowed_clients_and_prometheus_narrow_the_router_and_reach_metrics():
    policies, pods = two_services(spec("secure"))
    router = by_name(pods, "ml/alpha-router")
    # web/gateway: namespace team=web + app In (gateway, ui); web/ui too (and by ipBlock);
    # lab/gateway sits in the ipBlock's `except`; Prometheus only from its namespace
    assert admitted(policies, pods, router, 8000) == {"web/gateway", "web/ui",
                                                      "monitoring/prometheus"}
    decode = by_name(pods, "ml/alpha-decode")
    assert admitted(policies, pods, decode, 8000) == {"ml/alpha-router",
                                                      "tandem-system/operator",
                                                      "monitoring/prometheus"}
    assert admitted(policies, pods, decode, 50051) == {"ml/alpha-router", "ml/alpha-prefill"}


def test_torch_backend_opens_every_port_between_the_services_own_workers_only():
    raw = spec("tls")  # backend torch: TCPStore and gloo/NCCL sockets on ephemeral ports
    policies, pods = two_services(raw)
    prefill, decode = by_name(pods, "ml/alpha-prefill"), by_name(pods, "ml/alpha-decode")
    for port in (29500, 41234, 60999):
        assert admitted(policies, pods, decode, port) == {"ml/alpha-prefill"}
        assert admitted(policies, pods, prefill, port) == {"ml/alpha-decode"}
    assert admitted(policies, pods, decode, 50051) == {"ml/alpha-router", "ml/alpha-prefill"}


def test_without_an_operator_identity_no_one_scrapes_and_routers_are_unlabelled():
    policies, pods = two_services(spec("disaggregated"), operator=None)
    assert admitted(policies, pods, by_name(pods, "ml/alpha-decode"), 8000) == {
        "ml/alpha-router"}
    assert OPERATOR_RELEASE_LABEL not in by_name(pods, "ml/alpha-router").labels
    _, labelled = two_services(spec("disaggregated"))
    assert by_name(labelled, "ml/alpha-router").labels[OPERATOR_RELEASE_LABEL] == "tandem"
    assert OPERATOR_RELEASE_LABEL not in by_name(labelled, "ml/alpha-decode").labels


def test_random_service_names_stay_isolated_from_each_other():
    rng = random.Random(20)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-"
    for _ in range(25):
        a, b = ("x" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20))) + "z"
                for _ in range(2))
        if a == b:
            continue
        policies, pods = two_services(spec("disaggregated"), names=(a, b))
        for target in pods:
            if not target.name.startswith(("ml/" + a + "-", "ml/" + b + "-")):
                continue
            own = a if target.name.rsplit("-", 1)[0] == f"ml/{a}" else b
            allowed = admitted(policies, pods, target, 50051)
            if not target.name.endswith("-router"):
                assert allowed and all(n.rsplit("-", 1)[0] == f"ml/{own}" for n in allowed)


def test_policies_can_be_turned_off():
    raw = spec("disaggregated")
    raw["security"] = {"networkPolicy": {"enabled": False}}
    assert not by_kind(render(raw), "NetworkPolicy")


def test_the_evaluator_is_not_vacuous():
    """Unselected pods admit everyone; a policy with no rules admits no one; selectors apply
    each operator as Kubernetes does."""
    a, b = Pod("ns/a", "ns", {"app": "a"}), Pod("ns/b", "ns", {"app": "b"})
    deny = {"metadata": {"namespace": "ns"},
            "spec": {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Ingress"]}}
    assert admits([], b, a, 80) and admits([deny], a, b, 80) and not admits([deny], b, a, 80)
    labels = {"app": "x", "tier": "web"}
    assert selects({}, labels)
    assert selects({"matchExpressions": [{"key": "tier", "operator": "In",
                                          "values": ["web"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "tier", "operator": "NotIn",
                                              "values": ["web"]}]}, labels)
    assert selects({"matchExpressions": [{"key": "gone", "operator": "DoesNotExist"}]}, labels)
    assert not selects({"matchExpressions": [{"key": "gone", "operator": "Exists"}]}, labels)
    assert not selects({"matchLabels": {"app": "y"}}, labels)


def test_operator_identity_from_the_charts_environment():
    assert operator_from_env({}) == OperatorPeer(None, None)
    assert operator_from_env({"TANDEM_OPERATOR_NAMESPACE": "tandem-system",
                              "TANDEM_OPERATOR_RELEASE": "tandem"}) == OPERATOR


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_real_router_parser_takes_the_security_flags(name):
    import argparse

    from tandem.router.main import add_router_args

    p = argparse.ArgumentParser(exit_on_error=False)
    add_router_args(p)
    parsed = p.parse_args(container(one(render(name), "Deployment", "demo-router"))["args"][1:])
    assert parsed.worker_auth_key_file == KEY_FILE
    tls = parse_spec(spec(name)).kv_transfer.tls_secret
    assert parsed.grpc_tls_server_name == ("demo.ml.tandem.internal" if tls else None)


def test_tandem_operator_takes_its_identity_from_the_environment():
    import argparse

    from tandem.operator.cli import add_operator_args, config_from

    p = argparse.ArgumentParser()
    add_operator_args(p)
    config = config_from(p.parse_args(["-A"]), {"TANDEM_OPERATOR_NAMESPACE": "tandem-system",
                                                "TANDEM_OPERATOR_RELEASE": "tandem"})
    assert config.operator == OPERATOR


def test_reconcile_renders_with_the_operators_identity():
    from tandem.operator.reconcile import OperatorConfig, manifests

    docs = manifests(parse_spec(spec("disaggregated")), OWNER, OperatorConfig(operator=OPERATOR))
    labels = one(docs, "Deployment", "demo-router")["spec"]["template"]["metadata"]["labels"]
    assert labels[OPERATOR_RELEASE_LABEL] == "tandem"
    (scrape,) = [r for r in one(docs, "NetworkPolicy", "demo-workers")["spec"]["ingress"]
                 if r["ports"] == [{"port": "http", "protocol": "TCP"}]]
    assert scrape["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tandem-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                        OPERATOR_RELEASE_LABEL: "tandem"}}}]
