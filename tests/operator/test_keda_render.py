"""`autoscaling.mode: keda`: the ScaledObject per pool (exact fields, aggregated, P/D with
both roles at zero, a multi-node pool's LeaderWorkerSet), each valid against KEDA's published
CRD (schema, CEL, its webhook's bounds, the metrics-api scaler's metadata); the workload
rendered without replicas; the routers' metrics Service and the NetworkPolicy peer KEDA reads
/scaling through; router.yaml holding the model (served_models, flow control on)."""

from __future__ import annotations

import copy

import pytest
import yaml

from tandem.operator.render import render_all
from tandem.operator.render.common import METRICS_PORT
from tandem.operator.spec import parse_spec
from tests.operator import crd_validate
from tests.operator.crd_validate import crd_errors, load_crd
from tests.operator.lws import validate
from tests.operator.manifests import OWNER, by_kind, one, render
from tests.operator.samples import SHA

LABELS = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "demo",
          "app.kubernetes.io/component": "worker",
          "app.kubernetes.io/managed-by": "tandem-operator",
          "tandem.dev/inference-service": "demo"}
REF = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": "demo",
       "uid": OWNER.uid, "controller": True, "blockOwnerDeletion": True}
URL = f"http://demo-metrics.ml.svc:{METRICS_PORT}/scaling"

AGGREGATED = {"model": {"uri": "pvc://models/llama", "name": "llama"},
              "decode": {"replicas": 1, "autoscaling": {
                  "mode": "keda", "minReplicas": 0, "maxReplicas": 6, "target": 8}}}
PD = {"model": {"uri": "pvc://models/llama", "sha256": SHA, "name": "Acme/llama:v2"},
      "prefill": {"replicas": 1, "autoscaling": {
          "mode": "keda", "minReplicas": 0, "maxReplicas": 4, "target": 2,
          "scaleDownStabilizationSeconds": 60,
          "keda": {"pollingIntervalSeconds": 5, "cooldownPeriodSeconds": 120}}},
      "decode": {"replicas": 2, "autoscaling": {
          "mode": "keda", "minReplicas": 0, "maxReplicas": 10, "target": 16,
          "keda": {"kvUtilizationTarget": 0.85}}}}


def trigger(name: str, role: str, location: str, kind: str, target: str,
            activation: str = "0", model: str = "llama") -> dict:
    return {"type": "metrics-api", "name": name, "metricType": kind, "metadata": {
        "url": f"{URL}?model={model}&role={role}", "format": "json",
        "valueLocation": location, "targetValue": target,
        "activationTargetValue": activation}}


def router_yaml(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])


def test_aggregated_pool_scaled_object_exact():
    docs = render(AGGREGATED)
    so = one(docs, "ScaledObject", "demo-worker")
    assert so == {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": "demo-worker", "namespace": "ml",
                     "labels": {**LABELS, "tandem.dev/role": "both"},
                     "ownerReferences": [REF]},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": "demo-worker"},
            "pollingInterval": 15, "cooldownPeriod": 300,
            "minReplicaCount": 0, "maxReplicaCount": 6,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
                "stabilizationWindowSeconds": 300}}}},
            "triggers": [trigger("demand", "decode", "demand", "AverageValue", "8")]}}
    assert crd_errors(so) == []
    # KEDA's HPA owns the count: no replicas rendered, as under mode hpa
    assert "replicas" not in one(docs, "Deployment", "demo-worker")["spec"]
    assert by_kind(docs, "HorizontalPodAutoscaler") == []
    for doc in docs:
        validate(doc)


def test_scale_to_zero_holds_the_model_in_the_router():
    """A pool at zero: router.yaml lists every served name with the start timeout and turns
    flow control on (the queue that holds requests while the pool starts)."""
    cfg = router_yaml(render(AGGREGATED))
    assert cfg["served_models"] == [{"name": "llama", "start_timeout_s": 300}]
    assert cfg["flow_control"] == {"enabled": True}
    raw = copy.deepcopy(AGGREGATED)
    raw["model"] = {"uri": "hf://Org/Model-7B@main"}  # served as Model-7B and Org/Model-7B
    raw["router"] = {"flowControl": {"startTimeoutSeconds": 90}}
    assert router_yaml(render(raw))["served_models"] == [
        {"name": "Model-7B", "start_timeout_s": 90},
        {"name": "Org/Model-7B", "start_timeout_s": 90}]


def test_pd_both_roles_scale_to_zero_each_on_its_own_role():
    docs = render(PD)
    model = "Acme%2Fllama%3Av2"  # the served name, URL-encoded
    prefill, decode = one(docs, "ScaledObject", "demo-prefill"), one(docs, "ScaledObject",
                                                                     "demo-decode")
    assert prefill["metadata"]["labels"]["tandem.dev/role"] == "prefill"
    assert prefill["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                           "name": "demo-prefill"},
        "pollingInterval": 5, "cooldownPeriod": 120, "minReplicaCount": 0,
        "maxReplicaCount": 4,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
            "stabilizationWindowSeconds": 60}}}},
        "triggers": [trigger("demand", "prefill", "demand", "AverageValue", "2",
                             model=model)]}
    assert decode["spec"]["triggers"] == [
        trigger("demand", "decode", "demand", "AverageValue", "16", model=model),
        # KV use never wakes a pool at zero (activation above any fraction)
        trigger("kvutilization", "decode", "kv_utilization", "Value", "0.85", "1.01",
                model=model)]
    assert (decode["spec"]["minReplicaCount"], decode["spec"]["maxReplicaCount"]) == (0, 10)
    # still P/D with prefill at zero: both pools exist, prefill.replicas only marks P/D
    for pool in ("prefill", "decode"):
        assert "replicas" not in one(docs, "Deployment", f"demo-{pool}")["spec"]
    assert by_kind(docs, "Deployment")[1]["metadata"]["name"] == "demo-prefill"
    cfg = router_yaml(docs)
    assert cfg["served_models"] == [{"name": "Acme/llama:v2", "start_timeout_s": 300}]
    assert cfg["flow_control"]["enabled"] is True
    for so in (prefill, decode):
        assert crd_errors(so) == []


def test_metrics_service_and_network_policy_let_keda_read_scaling():
    docs = render(AGGREGATED)
    service = one(docs, "Service", "demo-metrics")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": METRICS_PORT,
                                         "targetPort": "metrics", "protocol": "TCP"}]
    assert service["spec"]["clusterIP"] == "None"
    assert by_kind(docs, "ServiceMonitor") == []  # only the Service KEDA reads through
    policy = one(docs, "NetworkPolicy", "demo-router")
    keda = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
            "podSelector": {"matchLabels": {"app": "keda-operator"}}}
    assert {"from": [keda], "ports": [{"port": "metrics", "protocol": "TCP"}]} in (
        policy["spec"]["ingress"])
    raw = copy.deepcopy(AGGREGATED)
    mine = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "autoscale"}}}
    prom = {"podSelector": {"matchLabels": {"app": "prom"}}}
    raw["monitoring"] = {"keda": mine, "prometheus": prom}
    policy = one(render(raw), "NetworkPolicy", "demo-router")
    assert {"from": [prom, mine], "ports": [{"port": "metrics", "protocol": "TCP"}]} in (
        policy["spec"]["ingress"])


def test_no_keda_pool_renders_nothing_new():
    """Without mode keda: no ScaledObject, no metrics Service, router.yaml as before."""
    raw = copy.deepcopy(AGGREGATED)
    raw["decode"]["autoscaling"] = {"maxReplicas": 6, "target": 8}
    docs = render(raw)
    assert by_kind(docs, "ScaledObject") == []
    assert [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "demo-metrics"] == []
    cfg = router_yaml(docs)
    assert "flow_control" not in cfg and "served_models" not in cfg
    assert one(docs, "Deployment", "demo-worker")["spec"]["replicas"] == 1


def test_multinode_pool_scales_its_leader_worker_set():
    """KEDA scales any resource with a scale subresource: the LWS CRD has one (its groups)."""
    raw = {"model": {"uri": "pvc://models/llama-70b", "sha256": SHA, "dtype": "bfloat16"},
           "decode": {"replicas": 1, "parallelism": {"tensor": 16},
                      "resources": {"limits": {"nvidia.com/gpu": 8}},
                      "autoscaling": {"mode": "keda", "minReplicas": 1, "maxReplicas": 3,
                                      "target": 4, "keda": {"idleReplicas": 0}}}}
    docs = render(raw)
    so = one(docs, "ScaledObject", "demo-worker")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                            "kind": "LeaderWorkerSet", "name": "demo-worker"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["idleReplicaCount"]) == (1, 0)
    assert so["spec"]["triggers"] == [trigger("demand", "decode", "demand", "AverageValue", "4",
                                              model="llama-70b")]
    lws = one(docs, "LeaderWorkerSet", "demo-worker")
    assert "replicas" not in lws["spec"]
    (version,) = [v for v in load_crd(crd_validate.VENDORED[
        ("leaderworkerset.x-k8s.io", "LeaderWorkerSet")])["spec"]["versions"] if v["storage"]]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    for doc in docs:
        validate(doc)
    # idleReplicas 0 is a scale to zero too: the router holds the model
    assert router_yaml(docs)["served_models"] == [
        {"name": "llama-70b", "start_timeout_s": 300}]


def test_kv_utilization_signal_is_a_value_target():
    raw = copy.deepcopy(AGGREGATED)
    raw["decode"]["autoscaling"] |= {"signal": "kvUtilization", "target": 0.7,
                                     "minReplicas": 2}
    docs = render(raw)
    so = one(docs, "ScaledObject", "demo-worker")
    assert so["spec"]["triggers"] == [trigger("kvutilization", "decode", "kv_utilization",
                                              "Value", "0.7")]
    assert so["spec"]["minReplicaCount"] == 2
    raw["decode"]["autoscaling"] |= {"signal": "waitingRequests", "target": 3}
    so = one(render(raw), "ScaledObject", "demo-worker")
    assert so["spec"]["triggers"] == [trigger("waitingrequests", "decode", "waiting",
                                              "AverageValue", "3")]
    assert "served_models" not in router_yaml(docs)  # never at zero: nothing to hold
    assert crd_errors(so) == []


@pytest.mark.parametrize(("path", "value", "error"), [
    (("spec", "minReplicaCount"), 7, "minReplicaCount must be less than or equal to"),
    (("spec", "idleReplicaCount"), 0, "IdleReplicaCount=0 must be less than"),
    (("spec", "pollingInterval"), 0, "0 is less than the minimum of 1"),
    (("spec", "scaleTargetRef", "nmae"), "x", ".spec.scaleTargetRef.nmae"),
    (("spec", "triggers", 0, "metadata", "targetValue"), "0", "targetValue: a non-zero"),
    (("spec", "triggers", 0, "metricType"), "Utilization", "metricType: 'Utilization'"),
])
def test_the_scaled_object_check_catches_what_keda_refuses(path, value, error):
    """The validation above means something: each break is caught with KEDA's reason."""
    so = copy.deepcopy(one(render(AGGREGATED), "ScaledObject", "demo-worker"))
    node = so
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert any(error in e for e in crd_errors(so)), crd_errors(so)


def test_render_all_is_what_tandem_render_prints():
    """The same list through the operator's own entry point (no spec-side copy)."""
    docs = render_all(parse_spec(PD), OWNER, image="tandem:test")
    assert [d["metadata"]["name"] for d in by_kind(docs, "ScaledObject")] == [
        "demo-prefill", "demo-decode"]


def test_a_pool_moving_to_keda_keeps_its_count_until_keda_scales_it():
    """As for an HPA: the operator's applied replicas are handed over (a second field owner)
    before the first apply without them, so the switch does not reset the pool to 1."""
    from tandem.operator.kube import FIELD_MANAGER
    from tandem.operator.reconcile import HANDOVER, OperatorConfig, apply
    from tests.operator.test_handover import FIXED, OWNER, RecordingKube, live_children, managed

    keda = copy.deepcopy(FIXED) | {"decode": {"replicas": 5, "autoscaling": {
        "mode": "keda", "minReplicas": 0, "maxReplicas": 8, "target": 4}}}
    kube = RecordingKube(live_children(FIXED, [managed(FIELD_MANAGER)]))
    kube.delete = lambda *a: None  # (nothing is removed: a ScaledObject is added)
    apply(kube, parse_spec(keda), OWNER, OperatorConfig(image="img"))
    handed = [(i, doc) for i, (m, doc) in enumerate(kube.applied) if m == HANDOVER]
    assert [doc["spec"] for _, doc in handed] == [{"replicas": 5}]
    names = [(m, d["kind"], d["metadata"]["name"]) for m, d in kube.applied]
    main = names.index((FIELD_MANAGER, "Deployment", "svc-decode"))
    assert handed[0][0] < main and "replicas" not in kube.applied[main][1]["spec"]
    assert (FIELD_MANAGER, "ScaledObject", "svc-decode") in names
