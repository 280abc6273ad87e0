"""`router.mode: gateway` and `router.attachTo`, rendered: the InferencePool and HTTPRoute
valid against their published CRDs (vendored in schemas/), the endpoint picker's Deployment
and Service (Kubernetes 1.32, strict), the pool selecting exactly the client-facing pods of
the router group, the router's discovery selecting exactly the group's worker Services, the
NetworkPolicies letting the gateway and the group's router through, status, and the spec
checks (`parse_spec` and the CRD's CEL rules) that refuse what cannot work."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import pytest
import yaml

from tandem.operator.render import Owner, render_all
from tandem.operator.render.common import CONFIG_HASH as CONFIG_HASH_KEY
from tandem.operator.render.multinode import pod_templates
from tandem.operator.spec import SpecError, parse_spec
from tandem.operator.status import observed
from tandem.protocol.labels import INFERENCE_POOL_LABEL, ROUTER_GROUP_LABEL
from tests.operator.crd_validate import cel_failures, crd_errors, schema_errors
from tests.operator.lws import validate
from tests.operator.manifests import OWNER, arg, by_kind, container, matches, one, set_path
from tests.operator.samples import SHA, resource, schema, unknown_fields

GATEWAY = {"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"}
AGG = {"model": {"uri": "pvc://models/m.gguf", "sha256": SHA}, "decode": {"replicas": 2}}
PD = {"model": {"uri": "pvc://models/llama.gguf", "sha256": SHA, "name": "llama"},
      "prefill": {"replicas": 1}, "decode": {"replicas": 2}}
TP = {"model": {"uri": "pvc://models/big", "sha256": SHA, "dtype": "bfloat16"},
      "decode": {"replicas": 1, "parallelism": {"tensor": 16},
                 "resources": {"limits": {"nvidia.com/gpu": 8}}}}


def with_router(raw: dict[str, Any], router: dict[str, Any]) -> dict[str, Any]:
    return {**copy.deepcopy(raw), "router": router}


def gateway(raw: dict[str, Any] = AGG, **fields: Any) -> dict[str, Any]:
    return with_router(raw, {"mode": "gateway", "gateway": fields})


def render(raw: dict[str, Any], owner: Owner = OWNER) -> list[dict[str, Any]]:
    return render_all(parse_spec(raw), owner, image="tandem:test")


def names(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def selector(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split(","))


def templates(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(workload, pod labels) of every worker pod template."""
    return [(d, t["metadata"]["labels"]) for d in docs if d["kind"] in (
        "Deployment", "LeaderWorkerSet") and d["metadata"]["labels"][
        "app.kubernetes.io/component"] == "worker" for t in pod_templates(d)]


def serving(doc: dict[str, Any], labels: dict[str, str]) -> bool:
    """A pod that answers clients: a decode / aggregated worker (an LWS's leader)."""
    role = labels.get("tandem.dev/role")
    return role in ("decode", "both")


# ---- gateway mode -------------------------------------------------------------------------

def test_gateway_mode_renders_the_pool_the_picker_and_the_route():
    docs = render(gateway(parentRefs=[GATEWAY]))
    for doc in docs:
        validate(doc)  # core kinds strictly, InferencePool / HTTPRoute by their CRDs
    assert {("Deployment", "demo-router"), ("Service", "demo-router")}.isdisjoint(names(docs))
    assert {("ServiceAccount", "demo-epp"), ("Role", "demo-epp"), ("RoleBinding", "demo-epp"),
            ("ConfigMap", "demo-epp-config"), ("Deployment", "demo-epp"),
            ("Service", "demo-epp"), ("PodDisruptionBudget", "demo-epp"),
            ("InferencePool", "demo"), ("HTTPRoute", "demo"),
            ("NetworkPolicy", "demo-inference-pool")} <= names(docs)
    pool = one(docs, "InferencePool", "demo")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {INFERENCE_POOL_LABEL: "demo"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"kind": "Service", "name": "demo-epp", "port": {"number": 9002},
                              "failureMode": "FailClose"}}
    route = one(docs, "HTTPRoute", "demo")
    assert route["spec"] == {
        "parentRefs": [GATEWAY],
        "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                   "backendRefs": [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": "demo"}],
                   "timeouts": {"request": "300s"}}]}
    assert crd_errors(pool) == [] and crd_errors(route) == []
    # the picker: the router's process and config, plus the ext_proc port and gRPC probes
    epp = one(docs, "Deployment", "demo-epp")
    c = container(epp)
    args = c["args"]
    assert arg(args, "--ext-proc-port") == "9002"
    assert arg(args, "--discovery") == "kubernetes"
    assert arg(args, "--label-selector") == ("app.kubernetes.io/component=worker,"
                                             f"{ROUTER_GROUP_LABEL}=demo")
    assert arg(args, "--config") == "/etc/tandem/router/router.yaml"
    assert {"name": "ext-proc", "containerPort": 9002, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    pod = epp["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-epp"
    assert {"name": "config", "configMap": {"name": "demo-epp-config"}} in pod["volumes"]
    binding = one(docs, "RoleBinding", "demo-epp")
    assert binding["roleRef"]["name"] == "demo-epp"
    assert binding["subjects"][0]["name"] == "demo-epp"
    svc = one(docs, "Service", "demo-epp")
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [
        {"name": "grpc-ext-proc", "port": 9002, "targetPort": "ext-proc", "protocol": "TCP",
         "appProtocol": "http2"},
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert matches(svc["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    # the pool selects the aggregated pods; the router's discovery their Service
    ((_, labels),) = templates(docs)
    assert matches(pool["spec"]["selector"]["matchLabels"], labels)
    worker_svc = one(docs, "Service", "demo-worker")
    assert matches(selector(arg(args, "--label-selector")), worker_svc["metadata"]["labels"])


def test_the_route_is_rendered_only_with_parent_refs():
    docs = render(gateway())
    assert ("InferencePool", "demo") in names(docs)
    assert not by_kind(docs, "HTTPRoute")


def test_port_failure_mode_timeout_and_objectives():
    docs = render(gateway(extProcPort=9500, failureMode="FailOpen", requestTimeoutSeconds=900,
                          parentRefs=[{"name": "gw"}], objectives={"chat": 10, "batch": -5}))
    pool = one(docs, "InferencePool", "demo")
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9500}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert one(docs, "Service", "demo-epp")["spec"]["ports"][0]["port"] == 9500
    assert arg(container(one(docs, "Deployment", "demo-epp"))["args"],
               "--ext-proc-port") == "9500"
    route = one(docs, "HTTPRoute", "demo")
    assert route["spec"]["rules"][0]["timeouts"] == {"request": "900s"}
    assert crd_errors(pool) == [] and crd_errors(route) == []
    cfg = yaml.safe_load(one(docs, "ConfigMap", "demo-epp-config")["data"]["router.yaml"])
    assert cfg["objectives"] == {"chat": 10, "batch": -5}
    # the same spec in router mode has no objectives and no ext_proc
    plain = render(AGG)
    assert "objectives" not in yaml.safe_load(
        one(plain, "ConfigMap", "demo-router-config")["data"]["router.yaml"])
    assert "--ext-proc-port" not in container(one(plain, "Deployment", "demo-router"))["args"]


def test_the_picker_follows_its_pools_objectives_and_may_read_them():
    """The picker names its InferencePool (`--inference-pool`, as the pool is named) and its
    Role may list and watch InferenceObjectives, which the chart's operator ClusterRole holds
    too (RBAC lets the operator grant only what it holds); the router's Role does not."""
    from tests.chart.test_chart import OPERATOR_RULES, rule_table

    docs = render(gateway())
    assert arg(container(one(docs, "Deployment", "demo-epp"))["args"],
               "--inference-pool") == "demo" == one(docs, "InferencePool", "demo")[
                   "metadata"]["name"]
    role = one(docs, "Role", "demo-epp")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["list", "watch"]},
        {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
         "verbs": ["list", "watch"]}]
    for key, verbs in rule_table(role["rules"]).items():
        assert verbs <= OPERATOR_RULES[key], key
    plain = render(AGG)
    assert one(plain, "Role", "demo-router")["rules"] == role["rules"][:1]
    assert "--inference-pool" not in container(one(plain, "Deployment", "demo-router"))["args"]


def test_ext_proc_tls_mounts_the_secret_and_probes_over_http():
    docs = render(gateway(tls={"secretName": "epp-tls"}))
    c = container(one(docs, "Deployment", "demo-epp"))
    assert arg(c["args"], "--ext-proc-tls-cert") == "/etc/tandem/ext-proc-tls/tls.crt"
    assert arg(c["args"], "--ext-proc-tls-key") == "/etc/tandem/ext-proc-tls/tls.key"
    vol = next(v for v in one(docs, "Deployment", "demo-epp")["spec"]["template"]["spec"][
        "volumes"] if v["name"] == "ext-proc-tls")
    assert vol["secret"]["secretName"] == "epp-tls"
    assert {"name": "ext-proc-tls", "mountPath": "/etc/tandem/ext-proc-tls",
            "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    validate(one(docs, "Deployment", "demo-epp"))
    grpc = one(docs, "Service", "demo-epp")["spec"]["ports"][0]
    assert grpc["name"] == "grpc-ext-proc" and "appProtocol" not in grpc


def test_ext_proc_client_ca_renders_mutual_tls_on_the_picker():
    spiffe = "spiffe://cluster.local/ns/gateways/sa/inference-gateway"
    tls = {"secretName": "epp-tls", "clientAuth": {
        "caSecretName": "gateway-ca", "allowedNames": ["gateway.example", spiffe]}}
    raw = gateway(tls=tls)
    res = resource(raw)
    assert cel(raw) == [] and schema_errors(schema(), res) == []
    assert unknown_fields(schema(), res) == []
    docs = render(raw)
    epp = one(docs, "Deployment", "demo-epp")
    c = container(epp)
    assert arg(c["args"], "--ext-proc-tls-client-ca") == "/etc/tandem/ext-proc-client-ca/ca.crt"
    allowed = [c["args"][i + 1] for i, a in enumerate(c["args"])
               if a == "--ext-proc-allowed-client"]
    assert allowed == ["gateway.example", spiffe]
    vol = next(v for v in epp["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "ext-proc-client-ca")
    assert vol["secret"] == {"secretName": "gateway-ca", "defaultMode": 0o440,
                             "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert {"name": "ext-proc-client-ca", "mountPath": "/etc/tandem/ext-proc-client-ca",
            "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    validate(epp)
    # the flags the router parses: the same settings a hand-run picker gets
    import argparse

    from tandem.router.main import add_router_args

    p = argparse.ArgumentParser()
    add_router_args(p)
    args, _ = p.parse_known_args(c["args"][c["args"].index("router") + 1:])
    assert args.ext_proc_tls_client_ca == "/etc/tandem/ext-proc-client-ca/ca.crt"
    assert args.ext_proc_allowed_client == ["gateway.example", spiffe]
    plain = container(one(render(gateway(tls={"secretName": "epp-tls"})), "Deployment",
                          "demo-epp"))
    assert "--ext-proc-tls-client-ca" not in plain["args"]
    assert all(m["name"] != "ext-proc-client-ca" for m in plain["volumeMounts"])


def test_ext_proc_client_auth_is_checked_by_the_schema_and_parse_spec():
    for tls, message in (
            ({"secretName": "t", "clientAuth": {"allowedNames": ["gw"]}}, "caSecretName"),
            ({"secretName": "t", "clientAuth": {"caSecretName": ""}}, "caSecretName"),
            ({"secretName": "t", "clientAuth": {"caSecretName": "ca", "allowedNames": [""]}},
             "allowedNames"),
            ({"secretName": "t", "clientAuth": {"caSecretName": "ca",
                                                "allowedNames": ["n"] * 65}}, "allowedNames")):
        assert schema_errors(schema(), resource(gateway(tls=tls))) != [], tls
        with pytest.raises(SpecError, match=f"router.gateway.tls.clientAuth.{message}"):
            parse_spec(gateway(tls=tls))


def test_pd_pool_selects_decode_pods_never_prefill():
    docs = render(gateway(PD))
    pool = one(docs, "InferencePool", "demo")["spec"]["selector"]["matchLabels"]
    picked = {d["metadata"]["name"] for d, lab in templates(docs) if matches(pool, lab)}
    assert picked == {"demo-decode"}
    for doc in docs:
        validate(doc)


def test_multinode_pool_selects_the_leaders_only():
    docs = render(gateway(TP))
    pool = one(docs, "InferencePool", "demo")["spec"]["selector"]["matchLabels"]
    lws = one(docs, "LeaderWorkerSet", "demo-worker")
    leader, follower = pod_templates(lws)
    assert matches(pool, leader["metadata"]["labels"])
    assert not matches(pool, follower["metadata"]["labels"])
    validate(lws)


def test_gateway_network_policies():
    """The picker admits the gateway's proxies on its gRPC port only (no http front door)
    and Prometheus on metrics; the pool pods admit the proxies on http."""
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}
    docs = render(gateway(allowedClients=[peer]))
    router = one(docs, "NetworkPolicy", "demo-router")
    assert router["spec"]["ingress"] == [{"from": [peer],
                                          "ports": [{"port": "ext-proc", "protocol": "TCP"}]}]
    pool = one(docs, "NetworkPolicy", "demo-inference-pool")
    assert pool["spec"]["policyTypes"] == ["Ingress"]
    assert pool["spec"]["ingress"] == [{"from": [peer],
                                        "ports": [{"port": "http", "protocol": "TCP"}]}]
    ((_, labels),) = templates(docs)
    assert matches(pool["spec"]["podSelector"]["matchLabels"], labels)
    epp_labels = one(docs, "Deployment", "demo-epp")["spec"]["template"]["metadata"]["labels"]
    assert matches(router["spec"]["podSelector"]["matchLabels"], epp_labels)
    anyone = render(gateway())
    assert one(anyone, "NetworkPolicy", "demo-inference-pool")["spec"]["ingress"] == [
        {"ports": [{"port": "http", "protocol": "TCP"}]}]
    for doc in by_kind(docs, "NetworkPolicy"):
        validate(doc)


def test_status_in_gateway_mode_waits_for_the_picker_and_has_no_endpoint():
    spec = parse_spec(gateway())
    ready = {"metadata": {"generation": 1}, "spec": {"replicas": 1},
             "status": {"observedGeneration": 1, "readyReplicas": 1, "updatedReplicas": 1,
                        "replicas": 1}}
    worker = {**ready, "spec": {"replicas": 2}, "status": {**ready["status"],
              "readyReplicas": 2, "updatedReplicas": 2, "replicas": 2}}
    st = observed(spec, OWNER, {}, {"demo-worker": worker}, 1, "2026-01-01T00:00:00Z")
    assert st["endpoint"] is None and st["router"] == "demo"
    ready_cond = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready_cond["status"] == "False" and "demo-epp: 0/1 ready" in ready_cond["message"]
    st = observed(spec, OWNER, {}, {"demo-worker": worker, "demo-epp": ready}, 1,
                  "2026-01-01T00:00:00Z")
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "True"
    assert st["routerReadyReplicas"] == 1


# ---- router groups (attachTo) ---------------------------------------------------------------

A = Owner("alpha", "ml", "uid-a")
B = Owner("beta", "ml", "uid-b")


def test_attached_service_renders_no_router_and_joins_the_group():
    a = render(PD, A)
    b = render(with_router(AGG, {"attachTo": "alpha"}), B)
    for doc in b:
        validate(doc)
    assert not [n for k, n in names(b) if "router" in n or "epp" in n]
    assert {n for k, n in names(b) if k == "NetworkPolicy"} == {"beta-workers"}
    # every worker Service of the group carries the label; the router selects them all
    args = container(one(a, "Deployment", "alpha-router"))["args"]
    sel = selector(arg(args, "--label-selector"))
    group = {d["metadata"]["name"] for d in by_kind(a + b, "Service")
             if matches(sel, d["metadata"]["labels"])}
    assert group == {"alpha-prefill", "alpha-decode", "beta-worker"}
    # the router's NetworkPolicy reaches every pod of the group; beta's admits its pods
    router_pods = one(a, "Deployment", "alpha-router")["spec"]["template"]["metadata"]["labels"]
    egress = one(a, "NetworkPolicy", "alpha-router")["spec"]["egress"]
    for _, labels in templates(a + b):
        assert any(matches(peer["podSelector"]["matchLabels"], labels) for rule in egress
                   for peer in rule.get("to", []) if "podSelector" in peer
                   and "namespaceSelector" not in peer
                   and {"port": "http", "protocol": "TCP"} in rule.get("ports", []))
    beta = one(b, "NetworkPolicy", "beta-workers")["spec"]["ingress"][0]
    assert matches(beta["from"][0]["podSelector"]["matchLabels"], router_pods)
    assert beta["ports"] == [{"port": "http", "protocol": "TCP"},
                             {"port": "grpc", "protocol": "TCP"}]


def test_one_picker_for_two_services_pools_their_decode_pods():
    a = render(gateway(PD), A)
    b = render(with_router(AGG, {"attachTo": "alpha"}), B)
    c = render(with_router(PD, {"attachTo": "alpha"}), Owner("gamma", "ml", "uid-c"))
    pool = one(a, "InferencePool", "alpha")["spec"]["selector"]["matchLabels"]
    picked = {d["metadata"]["name"] for d, lab in templates(a + b + c) if matches(pool, lab)}
    assert picked == {"alpha-decode", "beta-worker", "gamma-decode"}
    policy = one(a, "NetworkPolicy", "alpha-inference-pool")["spec"]["podSelector"]
    assert {d["metadata"]["name"] for d, lab in templates(a + b + c)
            if matches(policy["matchLabels"], lab)} == picked


def test_attached_status_names_its_router():
    spec = parse_spec(with_router(AGG, {"attachTo": "alpha"}))
    worker = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
              "status": {"observedGeneration": 1, "readyReplicas": 2, "updatedReplicas": 2,
                         "replicas": 2}}
    st = observed(spec, B, {}, {"beta-worker": worker}, 1, "2026-01-01T00:00:00Z")
    assert st["router"] == "alpha" and st["endpoint"] is None
    assert st["routerReadyReplicas"] is None
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "True"


def test_router_mode_keeps_its_pods_unlabelled():
    """No pool label on a router-mode service's pods (adding one would restart them)."""
    for _, labels in templates(render(PD)):
        assert INFERENCE_POOL_LABEL not in labels and ROUTER_GROUP_LABEL not in labels


def test_random_groups_keep_selectors_exact():
    """Seeded: random groups of services (aggregated, P/D, multi-node; an owner in either
    mode and 0-3 attached services): the router's discovery selects exactly the group's
    worker Services, the pool (gateway mode) exactly the group's client-facing pods, and
    nothing of another group."""
    rng = random.Random(41)
    shapes = [AGG, PD, TP]
    for trial in range(60):
        docs: dict[str, list[dict[str, Any]]] = {}
        groups: dict[str, str] = {}  # service -> its router's service
        owners = [f"own{trial}x{i}" for i in range(2)]
        for o in owners:
            mode = rng.choice(["router", "gateway"])
            raw = gateway(rng.choice(shapes)) if mode == "gateway" else copy.deepcopy(
                rng.choice(shapes))
            docs[o] = render(raw, Owner(o, "ml", "u"))
            groups[o] = o
            for j in range(rng.randrange(4)):
                name = f"{o}a{j}"
                docs[name] = render(with_router(rng.choice(shapes), {"attachTo": o}),
                                    Owner(name, "ml", "u"))
                groups[name] = o
        every = [d for ds in docs.values() for d in ds]
        for o in owners:
            front = next(d for d in docs[o] if d["kind"] == "Deployment"
                         and d["metadata"]["name"] in (f"{o}-router", f"{o}-epp"))
            sel = selector(arg(container(front)["args"], "--label-selector"))
            got = {d["metadata"]["name"] for d in by_kind(every, "Service")
                   if matches(sel, d["metadata"]["labels"])}
            want = {d["metadata"]["name"] for s, g in groups.items() if g == o
                    for d in by_kind(docs[s], "Service")
                    if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"}
            assert got == want
            pools = by_kind(docs[o], "InferencePool")
            if not pools:
                continue
            match = pools[0]["spec"]["selector"]["matchLabels"]
            got_pods = {(d["metadata"]["name"], id(lab)) for d, lab in templates(every)
                        if matches(match, lab)}
            want_pods = {(d["metadata"]["name"], id(lab)) for s, g in groups.items()
                         if g == o for d, lab in templates(docs[s])
                         if serving(d, lab)}
            assert got_pods == want_pods


# ---- refused specs --------------------------------------------------------------------------

def cel(raw: dict[str, Any]) -> list[str]:
    return cel_failures(schema(), resource(raw))


REFUSED = [
    (with_router(AGG, {"gateway": {}}), "router.gateway needs router.mode: gateway"),
    (with_router(AGG, {"mode": "gateway", "serviceType": "LoadBalancer"}),
     "router.mode gateway"),
    (with_router(AGG, {"mode": "gateway", "allowedClients": [{"podSelector": {}}]}),
     "router.mode gateway"),
    (with_router(AGG, {"attachTo": "alpha", "replicas": 2}), "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "apiKeysSecret": {"name": "k"}}),
     "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "mode": "gateway"}), "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "nodeSelector": {"a": "b"}}), "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "strategy": {"maxSurge": 2}}), "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "flowControl": {"enabled": True}}),
     "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "pdDecision": "threshold"}), "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "pdStallBudget": 0.01}), "router.attachTo"),
    (with_router(AGG, {"attachTo": "alpha", "pdItlWeight": 2}), "router.attachTo"),
]


@pytest.mark.parametrize(("raw", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_refused_by_cel_and_by_parse_spec(raw, message):
    (failed,) = cel(raw)
    assert message in failed
    with pytest.raises(SpecError, match=message):
        parse_spec(raw)


def test_attached_error_names_the_fields():
    raw = with_router(AGG, {"attachTo": "alpha", "replicas": 1, "policy": "random",
                            "allowedClients": [{"podSelector": {}}]})
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert str(e.value).endswith("(router.policy, router.allowedClients)")
    # defaults spelled out are not settings
    assert cel(with_router(AGG, {"attachTo": "alpha", "replicas": 1})) == []
    parse_spec(with_router(AGG, {"attachTo": "alpha", "replicas": 1}))
    same = {"attachTo": "alpha", "pdDecision": "cost", "pdItlWeight": 1, "pdStallBudget": 0.005}
    assert cel(with_router(AGG, same)) == []
    parse_spec(with_router(AGG, same))


def test_accepted_specs_pass_cel():
    for raw in (gateway(parentRefs=[GATEWAY], tls={"secretName": "t"}, objectives={"a": 1}),
                with_router(PD, {"attachTo": "alpha"}), AGG):
        assert cel(raw) == []
        parse_spec(raw)


@pytest.mark.parametrize(("path", "value", "message"), [
    ("router.gateway.parentRefs", [{"namespace": "x"}], "parentRefs[0].name is required"),
    ("router.gateway.parentRefs", [{"name": "g", "hostname": "x"}], "unknown fields"),
    ("router.gateway.parentRefs", [{"name": "g", "kind": "Not A Kind"}], "kind"),
    ("router.gateway.parentRefs", [{"name": "g", "port": 0}], "port"),
    ("router.gateway.extProcPort", 80, "extProcPort"),
    ("router.gateway.failureMode", "FailSometimes", "failureMode"),
    ("router.gateway.tls", {}, "tls.secretName is required"),
    ("router.gateway.objectives", {"chat": "high"}, "integer priority"),
    ("router.gateway.objectives", {"Not_A_Name": 1}, "not an object name"),
    ("router.attachTo", "Bad_Name", "attachTo"),
])
def test_bad_gateway_fields_are_refused(path, value, message):
    raw = set_path(gateway(), path, value)
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(raw)


def test_attached_to_itself_is_refused():
    raw = with_router(AGG, {"attachTo": "demo"})
    with pytest.raises(SpecError, match="names this InferenceService itself"):
        render(raw)


# ---- the router fetches its members' tokenizers ------------------------------------------

HF = {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main",
                "hfTokenSecretRef": {"name": "hf"}}, "router": {"attachTo": "alpha"}}
FILE = {"image": "registry.example/own:1", "model": {"uri": "file:///opt/m", "name": "own"},
        "router": {"attachTo": "alpha"}}


def test_the_router_fetches_every_members_tokenizer():
    members = [("zeta", parse_spec(FILE)), ("beta", parse_spec(HF))]  # (any order: by name)
    for raw in (PD, gateway(PD)):
        docs = render_all(parse_spec(raw), A, image="tandem:test", members=members)
        front = next(d for d in by_kind(docs, "Deployment")
                     if d["metadata"]["name"] in ("alpha-router", "alpha-epp"))
        validate(front)
        config = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] in (
            "alpha-router-config", "alpha-epp-config"))
        assert yaml.safe_load(config["data"]["router.yaml"])["tokenizers"] == {
            "llama": "/tokenizer", "SmolLM2-135M-Instruct": "/tokenizer-1",
            "HuggingFaceTB/SmolLM2-135M-Instruct": "/tokenizer-1", "own": "/tokenizer-2"}
        pod = front["spec"]["template"]["spec"]
        inits = {c["name"]: c for c in pod["initContainers"]}
        assert list(inits) == ["fetch-tokenizer", "fetch-tokenizer-1", "fetch-tokenizer-2"]
        hf, own = inits["fetch-tokenizer-1"], inits["fetch-tokenizer-2"]
        assert hf["command"][-2:] == ["--dest", "/tokenizer-1"]
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "hf", "key": "token"}}} in hf["env"]
        assert own["image"] == "registry.example/own:1"  # the member's image holds its file
        assert own["command"][-4:] == ["--local", "/opt/m", "--dest", "/tokenizer-2"]
        mounts = container(front)["volumeMounts"]
        for i in (1, 2):
            assert {"name": f"tokenizer-{i}", "mountPath": f"/tokenizer-{i}",
                    "readOnly": True} in mounts
    alone = one(render(PD, A), "Deployment", "alpha-router")
    assert CONFIG_HASH_KEY in alone["spec"]["template"]["metadata"]["annotations"]
    assert (alone["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_KEY]
            != one(render_all(parse_spec(PD), A, image="tandem:test", members=members),
                   "Deployment", "alpha-router")["spec"]["template"]["metadata"][
                "annotations"][CONFIG_HASH_KEY])  # a new member rolls the router


def test_tandem_render_of_a_group_gives_the_router_its_members(tmp_path):
    """`tandem render -f` of several documents: an owner's router learns the attached ones
    in the same input."""
    import argparse

    from tandem.operator.dryrun import add_render_args
    from tandem.operator.dryrun import render as dry_render

    text = yaml.safe_dump_all([
        {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "alpha"}, "spec": PD},
        {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "beta"}, "spec": HF}])
    p = argparse.ArgumentParser()
    add_render_args(p)
    out = [d for d in yaml.safe_load_all(dry_render(p.parse_args(["-f", "-", "-n", "ml"]),
                                                    text, {})) if d]
    config = next(d for d in out if d["metadata"]["name"] == "alpha-router-config")
    assert yaml.safe_load(config["data"]["router.yaml"])["tokenizers"][
        "SmolLM2-135M-Instruct"] == "/tokenizer-1"
    assert not [d for d in out if d["metadata"]["name"].startswith("beta-router")]


def test_connectivity_of_a_gateway_group():
    """NetworkPolicy semantics (`netpol.connects`) over an EPP owner (P/D) and an attached
    aggregated service: the picker reaches every worker of both on http and grpc; the
    gateway's proxies (their namespace) reach the picker's gRPC port and the pool pods'
    http, never a prefill pod nor the picker's http; a stranger pod reaches no worker."""
    from tests.operator.netpol import Pod, connects, pods_of

    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}
    a = render(gateway(PD, allowedClients=[peer]), A)
    b = render(with_router(AGG, {"attachTo": "alpha"}), B)
    policies = by_kind(a + b, "NetworkPolicy")
    pods = {p.name.split("/")[1]: p for p in pods_of(a + b, "ml")}
    epp = pods["alpha-epp"]
    for name in ("alpha-prefill", "alpha-decode", "beta-worker"):
        for port in (8000, 50051):
            assert connects(policies, epp, pods[name], port), (name, port)
    proxy = Pod("gateways/envoy", "gateways", {"app": "envoy"})
    assert connects(policies, proxy, epp, 9002)
    assert not connects(policies, proxy, epp, 8000)
    for name, ok in (("alpha-decode", True), ("beta-worker", True), ("alpha-prefill", False)):
        assert connects(policies, proxy, pods[name], 8000) == ok, name
    stranger = Pod("ml/stranger", "ml", {"app": "x"})
    for name in ("alpha-prefill", "alpha-decode", "beta-worker"):
        assert not connects(policies, stranger, pods[name], 8000), name


def test_the_pickers_pod_takes_the_routers_pod_settings():
    raw = with_router(AGG, {"mode": "gateway", "gateway": {}, "replicas": 3,
                            "nodeSelector": {"pool": "cpu"}, "podLabels": {"team": "ml"},
                            "resources": {"limits": {"memory": "1Gi"}}})
    docs = render_all(parse_spec(raw), OWNER, image="tandem:test", image_pull_policy="Always",
                      image_pull_secrets=["regcred"])
    epp = one(docs, "Deployment", "demo-epp")
    pod = epp["spec"]["template"]
    assert epp["spec"]["replicas"] == 3
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert container(epp)["imagePullPolicy"] == "Always"
    assert container(epp)["resources"] == {"limits": {"memory": "1Gi"}}
    validate(epp)


def test_the_rendered_picker_is_accepted_by_the_router(tmp_path):
    """The real `tandem router` parser and config loader take the picker's flags and
    router.yaml: ext_proc on the rendered port, TLS files, the objectives' priorities, the
    group's discovery selector."""
    import argparse

    from tandem.router.main import add_router_args, build

    (tmp_path / "key").write_bytes(b"k" * 32)
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("pem")
    docs = render(gateway(tls={"secretName": "t"}, objectives={"chat": 7}, extProcPort=9500))
    (tmp_path / "router.yaml").write_text(
        one(docs, "ConfigMap", "demo-epp-config")["data"]["router.yaml"])
    p = argparse.ArgumentParser()
    add_router_args(p)
    args = [str(tmp_path / "router.yaml") if a.endswith("router.yaml") else
            str(tmp_path / "key") if a.endswith("/worker-auth/key") else
            str(tmp_path / a.rsplit("/", 1)[1]) if a.startswith("/etc/tandem/ext-proc-tls/")
            else "ml" if a == "$(POD_NAMESPACE)" else a
            for a in container(one(docs, "Deployment", "demo-epp"))["args"][1:]]
    _, _, server = build(p.parse_args(args))
    ext = server.ext_proc
    assert (ext.port, dict(ext.objectives)) == (9500, {"chat": 7})
    assert (ext.inference_pool, ext.watch.namespace, ext.watch.pool) == ("demo", "ml", "demo")
    assert (ext.tls_cert, ext.tls_key) == (str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    assert server.discovery.label_selector == (
        f"app.kubernetes.io/component=worker,{ROUTER_GROUP_LABEL}=demo")


def test_an_attached_service_scaled_by_keda_from_zero():
    """An attached P/D service whose pools KEDA scales to zero: its ScaledObjects read the
    group router's /scaling (NAME-metrics of attachTo), which the group's owner renders and
    opens to KEDA; the owner's router lists the attached model and holds its requests in
    flow control while its pool starts."""
    zero = {"model": {"uri": "pvc://models/z.gguf", "name": "zero"},
            "router": {"attachTo": "alpha"}, "prefill": {"replicas": 1, "autoscaling": {
                "mode": "keda", "minReplicas": 0, "maxReplicas": 2, "target": 4}},
            "decode": {"replicas": 1, "autoscaling": {"mode": "keda", "minReplicas": 0,
                                                      "maxReplicas": 2, "target": 4}}}
    member = parse_spec(zero)
    b = render_all(member, B, image="tandem:test")
    assert not [d for d in b if d["metadata"]["name"] == "beta-metrics"]
    urls = {t["metadata"]["url"] for so in by_kind(b, "ScaledObject")
            for t in so["spec"]["triggers"]}
    assert urls == {"http://alpha-metrics.ml.svc:9090/scaling?model=zero&role=prefill",
                    "http://alpha-metrics.ml.svc:9090/scaling?model=zero&role=decode"}
    for doc in by_kind(b, "ScaledObject"):
        validate(doc)
    a = render_all(parse_spec(PD), A, image="tandem:test", members=[("beta", member)])
    metrics = one(a, "Service", "alpha-metrics")
    router = one(a, "Deployment", "alpha-router")["spec"]["template"]["metadata"]["labels"]
    assert matches(metrics["spec"]["selector"], router)
    cfg = yaml.safe_load(one(a, "ConfigMap", "alpha-router-config")["data"]["router.yaml"])
    assert cfg["flow_control"] == {"enabled": True}
    assert cfg["served_models"] == [{"name": "zero", "start_timeout_s": 300}]
    ingress = one(a, "NetworkPolicy", "alpha-router")["spec"]["ingress"]
    assert {"from": [member.keda], "ports": [{"port": "metrics", "protocol": "TCP"}]} in ingress
    alone = render(PD, A)
    assert not [d for d in alone if d["metadata"]["name"] == "alpha-metrics"]
    assert "served_models" not in yaml.safe_load(
        one(alone, "ConfigMap", "alpha-router-config")["data"]["router.yaml"])
