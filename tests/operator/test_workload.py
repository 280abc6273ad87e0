"""One `Workload` per pool decides Deployment vs LeaderWorkerSet: its kind, names and
selectors are the ones every rendered child of the pool carries (seeded random pool layouts),
and `pdb` takes the selector a LeaderWorkerSet's groups need."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tandem.operator.render import Workload, pool_selector, pool_workloads, pools
from tandem.operator.render.common import labels, pdb
from tandem.operator.render.workload import LWS_NAME_LABEL
from tandem.operator.spec import parse_spec
from tandem.protocol.labels import COMPONENT_LABEL, ROLE_LABEL, SERVICE_LABEL, WORKER_COMPONENT
from tests.operator.manifests import OWNER, render
from tests.operator.samples import SHA

WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")
AUTOSCALING = (None, {"minReplicas": 1, "maxReplicas": 4, "signal": "waitingRequests",
                      "target": 3},
               {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4,
                "signal": "waitingRequests", "target": 3})


def random_pool(rng: random.Random) -> dict[str, Any]:
    """A pool on CPU (its ranks in one pod) or on GPUs (one pod, or a multi-node group)."""
    pool: dict[str, Any] = {"replicas": rng.randint(1, 3)}
    tensor = rng.choice([1, 2, 4, 8, 16])
    if rng.random() < 0.75:
        gpus = rng.choice([g for g in (1, 2, 4, 8) if g <= tensor and tensor % g == 0])
        pool["resources"] = {"limits": {"nvidia.com/gpu": gpus, "memory": "64Gi"}}
    if tensor > 1:
        pool["parallelism"] = {"tensor": tensor}
    auto = rng.choice(AUTOSCALING)
    if auto is not None:
        pool["autoscaling"] = dict(auto)
    return pool


def random_spec(rng: random.Random) -> dict[str, Any]:
    model = {"uri": "pvc://models/m", "sha256": SHA, "dtype": "bfloat16"}  # CPU and GPU pools
    raw: dict[str, Any] = {"model": model, "decode": random_pool(rng)}
    if rng.random() < 0.6:
        raw["prefill"] = random_pool(rng)
    if rng.random() < 0.3:
        raw["security"] = {"networkPolicy": {"enabled": False}}
    return raw


def named(docs: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]


@pytest.mark.parametrize("seed", range(40))
def test_every_child_of_a_pool_follows_its_workload(seed: int) -> None:
    raw = random_spec(random.Random(seed))
    spec = parse_spec(raw)
    docs = render(raw)
    workloads = pool_workloads(spec, OWNER)
    assert [w.pool for w in workloads] == pools(spec)
    for w in workloads:
        layout = w.pool.spec.layout
        assert w.kind == ("LeaderWorkerSet" if layout.multinode else "Deployment")
        assert w.name == f"demo-{w.pool.name}"
        # the pool runs as exactly one workload, of the Workload's kind
        kinds = [d["kind"] for d in docs if d["kind"] in WORKLOAD_KINDS
                 and d["metadata"]["name"] == w.name]
        assert kinds == [w.kind]
        (doc,) = named(docs, w.kind, w.name)
        assert doc["apiVersion"] == w.api_version
        assert doc["metadata"]["labels"][ROLE_LABEL] == w.role
        (service,) = named(docs, "Service", w.name)
        assert service["spec"]["selector"] == w.selector
        (budget,) = named(docs, "PodDisruptionBudget", w.name)
        assert budget["spec"]["selector"]["matchLabels"] == w.pod_selector
        hpas = named(docs, "HorizontalPodAutoscaler", w.name)
        auto = w.pool.spec.autoscaling
        assert [h["spec"]["scaleTargetRef"] for h in hpas] == (
            [w.target] if auto is not None and auto.mode == "hpa" else [])
        groups = named(docs, "NetworkPolicy", f"{w.name}-group")
        policies = raw.get("security", {}).get("networkPolicy", {}).get("enabled", True)
        assert len(groups) == (1 if w.multinode and policies else 0)
        if w.multinode:
            lwt = doc["spec"]["leaderWorkerTemplate"]
            assert lwt["size"] == w.group_size == layout.nodes
            for g in groups:
                assert g["spec"]["podSelector"]["matchLabels"] == w.pod_selector
        else:
            assert w.group_size == 1
            assert doc["spec"]["selector"]["matchLabels"] == w.selector == w.pod_selector


def test_a_multi_node_pool_selects_its_leaders_to_serve_and_every_pod_of_its_groups() -> None:
    raw = {"model": {"uri": "pvc://models/m", "sha256": SHA},
           "prefill": {"replicas": 2, "parallelism": {"tensor": 16},
                       "resources": {"limits": {"nvidia.com/gpu": 8}}},
           "decode": {"replicas": 1, "parallelism": {"tensor": 8},
                      "resources": {"limits": {"nvidia.com/gpu": 8}}}}
    prefill, decode = pool_workloads(parse_spec(raw), OWNER)
    assert (prefill.kind, prefill.api_version, prefill.group_size, prefill.multinode) == (
        "LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1", 2, True)
    assert prefill.selector == {SERVICE_LABEL: "demo", COMPONENT_LABEL: WORKER_COMPONENT,
                                ROLE_LABEL: "prefill"}
    assert prefill.pod_selector == {SERVICE_LABEL: "demo", COMPONENT_LABEL: WORKER_COMPONENT,
                                    LWS_NAME_LABEL: "demo-prefill"}
    assert prefill.target == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                              "kind": "LeaderWorkerSet", "name": "demo-prefill"}
    assert (decode.kind, decode.api_version, decode.group_size, decode.multinode) == (
        "Deployment", "apps/v1", 1, False)
    assert decode.pod_selector == decode.selector
    for w in (prefill, decode):
        assert w.selector_string == pool_selector(OWNER, w.pool) == (
            f"{SERVICE_LABEL}=demo,{COMPONENT_LABEL}={WORKER_COMPONENT},{ROLE_LABEL}={w.role}")
        assert Workload.of(OWNER, w.pool) == w


def test_one_pdb_selects_the_components_pods_or_the_selector_given() -> None:
    own = pdb(OWNER, "demo-decode", WORKER_COMPONENT, "decode")
    assert own["spec"] == {"maxUnavailable": 1, "selector": {
        "matchLabels": labels(OWNER, WORKER_COMPONENT, "decode")}}
    group = {SERVICE_LABEL: "demo", LWS_NAME_LABEL: "demo-prefill"}
    out = pdb(OWNER, "demo-prefill", WORKER_COMPONENT, "prefill", selector=group)
    assert out["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": group}}
    assert out["metadata"]["labels"][ROLE_LABEL] == "prefill"
    assert out["metadata"]["name"] == "demo-prefill"
