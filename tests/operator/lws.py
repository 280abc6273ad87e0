"""Rendered manifests checked as a cluster would: core kinds strictly against Kubernetes'
schemas (kubernetes-validate), LeaderWorkerSets against the published LWS CRD (vendored in
schemas/, release v0.9.0): its openAPIV3Schema after structural defaulting (OpenAPI 3.0,
jsonschema underneath), no field the structural schema would prune, the LWS webhook's
rollout and size checks, and each of its pod templates strictly as a core PodTemplateSpec.
Other vendored custom kinds (KEDA's ScaledObject) go to `crd_validate`, the shared helper."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
from openapi_schema_validator import OAS30Validator

from tandem.operator.render.multinode import LWS_KIND, pod_templates
from tests.operator import crd_validate
from tests.operator.samples import apply_defaults, unknown_fields

LWS_CRD = Path(__file__).with_name("schemas") / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
NO_SCHEMA = crd_validate.NO_SCHEMA  # CRDs without a schema here


def lws_crd() -> dict[str, Any]:
    return crd_validate.load_crd(LWS_CRD.name)


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
    schema = lws_schema()
    assert doc["apiVersion"] == f"{lws_crd()['spec']['group']}/v1"
    assert doc["kind"] == lws_crd()["spec"]["names"]["kind"]
    obj = apply_defaults(schema, copy.deepcopy(doc))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in OAS30Validator(schema).iter_errors(obj)]
    return errors + unknown_fields(schema, doc) + webhook_errors(doc)


def validate(doc: dict[str, Any], version: str = "1.32") -> None:
    """Raises (kubernetes_validate.ValidationError, AssertionError) unless `doc` is valid."""
    if doc["apiVersion"].split("/")[0] in NO_SCHEMA:
        return
    if doc["kind"] != LWS_KIND and crd_validate.crd_for(doc) is not None:
        crd_validate.validate(doc, version)
        return
    if doc["kind"] != LWS_KIND:
        kubernetes_validate.validate(doc, version, strict=True)
        return
    assert lws_errors(doc) == [], lws_errors(doc)
    for template in pod_templates(doc):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": doc["metadata"]["name"],
                                                   "namespace": doc["metadata"]["namespace"]},
                                      "template": template}, version, strict=True)
