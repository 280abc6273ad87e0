"""What a pool scaled from zero by the operator's own autoscaler renders (`mode: operator`,
`minReplicas: 0`, signal demand): no ScaledObject, the workload keeps a count of its own, the
router holds the model exactly as in keda mode (served_models, flow control on), and the
routers' metrics Service with a NetworkPolicy rule that lets the operator read /scaling; and
`keda.bandTargets`: one metrics-api trigger per band on `queued_by_band.<band>`, each band
listed in router.yaml's flow control so the router always reports it. Every object validates
against the vendored schemas."""

from __future__ import annotations

import copy

import yaml

from tandem.operator.render import OperatorPeer, Owner, render_all
from tandem.operator.render.common import METRICS_PORT
from tandem.operator.spec import parse_spec
from tests.operator.crd_validate import crd_errors
from tests.operator.lws import validate
from tests.operator.manifests import by_kind, one, render
from tests.operator.test_gateway import PD as OWNER_PD
from tests.operator.test_keda_render import AGGREGATED, PD, router_yaml, trigger

OPERATOR = OperatorPeer("tandem-system", "tandem")
PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tandem-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                        "tandem.dev/operator-release": "tandem"}}}
METRICS_RULE = {"from": [PEER], "ports": [{"port": "metrics", "protocol": "TCP"}]}


def operator_mode(raw: dict) -> dict:
    raw = copy.deepcopy(raw)
    for pool in ("prefill", "decode"):
        auto = raw.get(pool, {}).get("autoscaling")
        if auto is not None:
            auto["mode"] = "operator"
            auto.pop("keda", None)
    return raw


def test_operator_mode_from_zero_renders_what_keda_mode_does_for_the_router():
    keda_cfg = router_yaml(render(AGGREGATED))
    docs = render(operator_mode(AGGREGATED), operator=OPERATOR)
    assert by_kind(docs, "ScaledObject") == [] and by_kind(docs, "HorizontalPodAutoscaler") == []
    assert one(docs, "Deployment", "demo-worker")["spec"]["replicas"] == 1  # the operator's
    cfg = router_yaml(docs)
    assert {k: cfg[k] for k in ("served_models", "flow_control")} == {
        k: keda_cfg[k] for k in ("served_models", "flow_control")} == {
        "served_models": [{"name": "llama", "start_timeout_s": 300}],
        "flow_control": {"enabled": True}}
    service = one(docs, "Service", "demo-metrics")
    assert service["spec"]["ports"][0]["port"] == METRICS_PORT
    assert METRICS_RULE in one(docs, "NetworkPolicy", "demo-router")["spec"]["ingress"]
    for doc in docs:
        validate(doc)


def test_pd_both_roles_from_zero_in_operator_mode():
    raw = operator_mode(PD)
    raw["prefill"]["replicas"] = 1  # P/D (prefill's live count may still reach 0)
    raw["decode"]["replicas"] = 0  # starts at zero
    docs = render(raw, operator=OPERATOR)
    assert one(docs, "Deployment", "demo-prefill")["spec"]["replicas"] == 1
    assert one(docs, "Deployment", "demo-decode")["spec"]["replicas"] == 0
    assert router_yaml(docs)["served_models"] == [
        {"name": "Acme/llama:v2", "start_timeout_s": 300}]
    assert METRICS_RULE in one(docs, "NetworkPolicy", "demo-router")["spec"]["ingress"]
    for doc in docs:
        validate(doc)


def test_a_worker_signal_in_operator_mode_reads_no_scaling():
    """Operator mode on the workers' metrics: nothing new (no metrics Service, no rule)."""
    raw = copy.deepcopy(AGGREGATED)
    raw["decode"]["autoscaling"] = {"maxReplicas": 6, "target": 8}
    docs = render(raw, operator=OPERATOR)
    assert [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "demo-metrics"] == []
    assert METRICS_RULE not in one(docs, "NetworkPolicy", "demo-router")["spec"]["ingress"]


def test_band_targets_render_one_trigger_per_band_and_list_the_bands():
    raw = copy.deepcopy(PD)
    raw["decode"]["autoscaling"]["keda"]["bandTargets"] = {"2": 4, "-1": 16.5}
    raw["router"] = {"flowControl": {"bands": {"2": {"maxRequests": 50}}}}
    docs = render(raw)
    model = "Acme%2Fllama%3Av2"
    so = one(docs, "ScaledObject", "demo-decode")
    assert so["spec"]["triggers"] == [
        trigger("demand", "decode", "demand", "AverageValue", "16", model=model),
        trigger("kvutilization", "decode", "kv_utilization", "Value", "0.85", "1.01",
                model=model),
        trigger("bandm1", "decode", "queued_by_band.-1", "AverageValue", "16.5", model=model),
        trigger("band2", "decode", "queued_by_band.2", "AverageValue", "4", model=model)]
    assert crd_errors(so) == []
    assert len(one(docs, "ScaledObject", "demo-prefill")["spec"]["triggers"]) == 1
    # the router lists each band (its own bounds kept; a new one with the default's), so
    # /scaling always has the key KEDA's trigger reads
    fc = router_yaml(docs)["flow_control"]
    assert fc == {"enabled": True, "bands": {-1: {}, 2: {"max_requests": 50}}}
    text = one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"]
    assert yaml.safe_load(text)["flow_control"]["bands"] == {-1: {}, 2: {"max_requests": 50}}
    for doc in docs:
        validate(doc)


def test_band_targets_turn_flow_control_on_without_scaling_to_zero():
    raw = copy.deepcopy(AGGREGATED)
    raw["decode"]["autoscaling"] |= {"minReplicas": 1, "keda": {"bandTargets": {"0": 3}}}
    docs = render(raw)
    cfg = router_yaml(docs)
    assert cfg["flow_control"] == {"enabled": True, "bands": {0: {}}}
    assert "served_models" not in cfg  # never at zero: nothing held for a start
    assert one(docs, "ScaledObject", "demo-worker")["spec"]["triggers"][-1] == trigger(
        "band0", "decode", "queued_by_band.0", "AverageValue", "3")


def test_an_attached_service_scaled_from_zero_by_the_operator():
    """An attached service whose decode pool the operator scales from zero and whose other
    pool KEDA scales on a band: the group's owner renders the metrics Service, lets the
    operator (and KEDA) read /scaling, lists the attached model, holds its requests and
    lists the band its trigger reads."""
    alpha = Owner("alpha", "ml", "uid-a")
    zero = {"model": {"uri": "pvc://models/z.gguf", "name": "zero"},
            "router": {"attachTo": "alpha"},
            "prefill": {"replicas": 1, "autoscaling": {
                "mode": "keda", "minReplicas": 1, "maxReplicas": 2, "target": 4,
                "keda": {"bandTargets": {"3": 2}}}},
            "decode": {"replicas": 0, "autoscaling": {
                "mode": "operator", "minReplicas": 0, "maxReplicas": 2, "target": 4}}}
    member = parse_spec(zero)
    docs = render_all(parse_spec(OWNER_PD), alpha, image="tandem:test",
                      members=[("beta", member)], operator=OPERATOR)
    one(docs, "Service", "alpha-metrics")
    ingress = one(docs, "NetworkPolicy", "alpha-router")["spec"]["ingress"]
    assert {"from": [member.keda, PEER], "ports": [{"port": "metrics", "protocol": "TCP"}]} in (
        ingress)
    cfg = yaml.safe_load(one(docs, "ConfigMap", "alpha-router-config")["data"]["router.yaml"])
    assert cfg["flow_control"] == {"enabled": True, "bands": {3: {}}}
    assert cfg["served_models"] == [{"name": "zero", "start_timeout_s": 300}]


def test_a_model_served_under_two_names_wakes_on_either():
    """hf://Org/Model-7B is served as Model-7B and Org/Model-7B; with no worker up the
    router queues each name apart, so KEDA reads both (a request for either wakes it)."""
    raw = copy.deepcopy(AGGREGATED)
    raw["model"] = {"uri": "hf://Org/Model-7B@main"}
    so = one(render(raw), "ScaledObject", "demo-worker")
    assert so["spec"]["triggers"] == [
        trigger("demand", "decode", "demand", "AverageValue", "8", model="Model-7B"),
        trigger("demand1", "decode", "demand", "AverageValue", "8", model="Org%2FModel-7B")]
    assert crd_errors(so) == []
