"""Rendered manifests are valid Kubernetes 1.32 objects (strict JSON schemas: no unknown
fields), owned by the InferenceService, with labels that the Deployments', Services' and
PDBs' selectors and the router's own EndpointSlice discovery match."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tandem.operator.render import pool_selector, pools
from tandem.operator.spec import parse_spec
from tandem.protocol.labels import COMPONENT_LABEL, ROLE_LABEL, SERVICE_LABEL
from tests.operator import crd_validate
from tests.operator.manifests import K8S, OWNER, arg, by_kind, container, matches, one, render
from tests.operator.samples import SPECS, spec


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_manifest_validates_against_kubernetes_1_32_strict(name):
    docs = render(name)
    assert docs
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "Certificate"):  # CRDs of the Prometheus Operator
            # and cert-manager: no schema here (test_render_security checks the Certificate)
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S, strict=True)
            continue
        if crd_validate.crd_for(doc) is not None:  # a vendored CRD (ScaledObject, ...)
            crd_validate.validate(doc, K8S)
            continue
        kubernetes_validate.validate(doc, K8S, strict=True)


def test_strict_validation_catches_an_unknown_field():
    """The check above means something: a typo'd field fails strict validation."""
    deployment = one(render("aggregated"), "Deployment", "demo-worker")
    container(deployment)["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S, strict=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_owner_references_namespace_and_common_labels(name):
    for doc in render(name):
        meta = doc["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{
            "apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": "demo",
            "uid": OWNER.uid, "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"][SERVICE_LABEL] == "demo"
        assert meta["name"].startswith("demo")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_selectors_select_exactly_their_own_pods(name):
    docs = render(name)
    deployments = by_kind(docs, "Deployment")
    templates = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
                 for d in deployments}
    for d in deployments:
        assert matches(d["spec"]["selector"]["matchLabels"], templates[d["metadata"]["name"]])
    selectors = [(s, s["spec"]["selector"]) for s in by_kind(docs, "Service")]
    selectors += [(p, p["spec"]["selector"]["matchLabels"])
                  for p in by_kind(docs, "PodDisruptionBudget")]
    # one Service and one PDB per workload, and with a ServiceMonitor or a KEDA ScaledObject
    # the routers' metrics Service (demo-metrics), which selects the routers
    monitored = bool(by_kind(docs, "ServiceMonitor") or by_kind(docs, "ScaledObject"))
    assert len(selectors) == 2 * len(deployments) + monitored
    for doc, selector in selectors:
        hits = [n for n, labels in templates.items() if matches(selector, labels)]
        own = {"demo-metrics": "demo-router"}.get(doc["metadata"]["name"],
                                                  doc["metadata"]["name"])
        assert hits == [own], (doc["kind"], doc["metadata"]["name"], hits)
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in templates


@pytest.mark.parametrize("name", sorted(SPECS))
def test_router_discovery_finds_the_worker_services_and_their_http_port(name):
    """EndpointSlices carry their Service's labels: the router's own selector and port
    logic, applied to a slice made from each rendered Service, finds every worker pool (with
    its role) on port 8000, and nothing else."""
    from tandem.router.discovery.k8s import slice_endpoints, worker_selector

    docs = render(name)
    selector = dict(kv.split("=") for kv in worker_selector("demo").split(","))
    found = {}
    for svc in by_kind(docs, "Service"):
        if not matches(selector, svc["metadata"]["labels"]):
            continue
        fake_slice = {"metadata": {"name": f"{svc['metadata']['name']}-abcde",
                                   "labels": svc["metadata"]["labels"]},
                      "ports": [{"name": p["name"], "port": p["port"]}
                                for p in svc["spec"]["ports"]],
                      "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True}}]}
        (ep,) = slice_endpoints(fake_slice)
        found[ep.role] = ep.url
    roles = {p.role for p in pools(parse_spec(spec(name)))}
    assert set(found) == roles
    assert all(url == "http://10.0.0.7:8000" for url in found.values())
    assert "demo-router" not in {s["metadata"]["name"] for s in by_kind(docs, "Service")
                                 if matches(selector, s["metadata"]["labels"])}


def test_aggregated_and_disaggregated_pools():
    agg = render("aggregated")
    assert [d["metadata"]["name"] for d in by_kind(agg, "Deployment")] == [
        "demo-router", "demo-worker"]
    worker = one(agg, "Deployment", "demo-worker")
    assert worker["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == "both"
    assert arg(container(worker)["args"], "--role") == "both"
    assert arg(container(worker)["args"], "--model") is None  # bundled
    pd = render("disaggregated")
    roles = {d["metadata"]["name"]: arg(container(d)["args"], "--role")
             for d in by_kind(pd, "Deployment") if d["metadata"]["name"] != "demo-router"}
    assert roles == {"demo-prefill": "prefill", "demo-decode": "decode"}
    assert one(pd, "Deployment", "demo-prefill")["spec"]["replicas"] == 2
    assert one(pd, "Deployment", "demo-decode")["spec"]["replicas"] == 3
    svc = one(pd, "Service", "demo-decode")
    assert svc["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("http", 8000),
                                                                      ("grpc", 50051)]
    assert pool_selector(OWNER, pools(parse_spec(spec("disaggregated")))[1]) == (
        f"{SERVICE_LABEL}=demo,{COMPONENT_LABEL}=worker,{ROLE_LABEL}=decode")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_manifest_validates_against_kubernetes_1_30_the_charts_floor(name):
    """Chart.yaml's kubeVersion is >=1.30: the pods' preStop sleep action is beta (on by
    default) from 1.30, and everything else rendered exists there too."""
    docs = render(name)
    sleeps = [h["preStop"]["sleep"] for d in by_kind(docs, "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"]
              if (h := c.get("lifecycle"))]
    assert sleeps, "no preStop sleep rendered: the 1.30 floor may be lowered"
    for doc in docs:
        if crd_validate.crd_for(doc) is not None:  # a vendored CRD: its own schema
            crd_validate.validate(doc, "1.30")
        elif doc["apiVersion"].split("/")[0] not in crd_validate.NO_SCHEMA:
            kubernetes_validate.validate(doc, "1.30", strict=True)  # (CRDs: no schema here)
