"""Rendered manifests checked as a cluster would: core kinds strictly against Kubernetes'
schemas (kubernetes-validate), custom kinds against their published CRDs (vendored in
schemas/; `crd_validate.crd_errors`: schema after structural defaulting, pruning, CEL):
LeaderWorkerSets (release v0.9.0) with the LWS webhook's rollout and size checks too, and
each of its pod templates strictly as a core PodTemplateSpec; InferencePools and HTTPRoutes
(gateway mode)."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate

from tandem.operator.render.multinode import LWS_KIND, pod_templates
from tests.operator.crd_validate import crd, crd_errors, vendored
from tests.operator.samples import apply_defaults

NO_SCHEMA = ("monitoring.coreos.com", "cert-manager.io")  # CRDs without a schema here


def lws_crd() -> dict[str, Any]:
    return crd("leaderworkerset.x-k8s.io", LWS_KIND)


def lws_schema() -> dict[str, Any]:
    (version,) = [v for v in lws_crd()["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def _scaled(value: int | str, replicas: int, up: bool) -> int:
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * replicas / 100
    return int(-(-share // 1)) if up else int(share)


def webhook_errors(doc: dict[str, Any]) -> list[str]:
    """The LWS webhook's generalValidate (pkg/webhooks/leaderworkerset_webhook.go, v0.9.0):
    size >= 1, replicas >= 0, rollout bounds within 100% and not both 0 groups."""
    spec = apply_defaults(lws_schema(), copy.deepcopy(doc))["spec"]
    out = []
    if spec["leaderWorkerTemplate"].get("size", 1) < 1:
        out.append("size must be equal or greater than 1")
    replicas = spec.get("replicas", 1)
    if replicas < 0:
        out.append("replicas must be equal or greater than 0")
    rolling = spec.get("rolloutStrategy", {}).get("rollingUpdateConfiguration", {})
    surge, unavailable = rolling.get("maxSurge", 0), rolling.get("maxUnavailable", 1)
    for v in (surge, unavailable):
        if isinstance(v, str) and int(v.rstrip("%")) > 100:
            out.append(f"{v}: must not be greater than 100%")
    if replicas and not (_scaled(surge, replicas, True) or _scaled(unavailable, replicas, False)):
        out.append("maxUnavailable must not be 0 when `maxSurge` is 0")
    return out


def lws_errors(doc: dict[str, Any]) -> list[str]:
    """Everything the API server (CRD schema, pruning) and the LWS webhook would refuse."""
    assert doc["apiVersion"] == f"{lws_crd()['spec']['group']}/v1"
    return crd_errors(doc) + webhook_errors(doc)


def validate(doc: dict[str, Any], version: str = "1.32") -> None:
    """Raises (kubernetes_validate.ValidationError, AssertionError) unless `doc` is valid."""
    if doc["apiVersion"].split("/")[0] in NO_SCHEMA:
        return
    if not vendored(doc):
        kubernetes_validate.validate(doc, version, strict=True)
        return
    if doc["kind"] != LWS_KIND:
        assert crd_errors(doc) == [], crd_errors(doc)
        return
    assert lws_errors(doc) == [], lws_errors(doc)
    for template in pod_templates(doc):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": doc["metadata"]["name"],
                                                   "namespace": doc["metadata"]["namespace"]},
                                      "template": template}, version, strict=True)
