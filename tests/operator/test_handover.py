"""`reconcile.apply` when a pool moves under an HPA (which renders no replicas): on plain
values, through a recording stand-in for `kube.Kube`."""

from __future__ import annotations

import copy
from typing import Any

from tandem.operator.kube import FIELD_MANAGER, KINDS
from tandem.operator.reconcile import HANDOVER, OperatorConfig, apply
from tandem.operator.render import Owner, render_all
from tandem.operator.spec import parse_spec
from tests.operator.samples import SHA

OWNER = Owner("svc", "ml", "uid-1")
FIXED = {"model": {"uri": "pvc://models", "sha256": SHA}, "prefill": {"replicas": 1},
         "decode": {"replicas": 5}}
HPA = copy.deepcopy(FIXED) | {"decode": {"replicas": 5, "autoscaling": {
    "mode": "hpa", "minReplicas": 1, "maxReplicas": 8, "signal": "waitingRequests",
    "target": 4}}}


def managed(manager: str, operation: str = "Apply", replicas: bool = True) -> dict:
    spec: dict[str, Any] = {"f:template": {}, **({"f:replicas": {}} if replicas else {})}
    return {"manager": manager, "operation": operation, "apiVersion": "apps/v1",
            "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": spec}}


class RecordingKube:
    """Answers `list_owned` from `live` and records each apply as (manager, doc)."""

    def __init__(self, live: list[dict[str, Any]]) -> None:
        self.live = live
        self.applied: list[tuple[str, dict[str, Any]]] = []

    def list_owned(self, kind: str, namespace: str, owner: str, uid: str) -> list[dict]:
        assert kind in KINDS
        return [o for o in self.live if o["kind"] == kind]

    def apply(self, doc: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        self.applied.append((manager, doc))
        return {"metadata": {"resourceVersion": str(len(self.applied))}}

    def create(self, doc: dict[str, Any]) -> bool:
        """The worker-auth Secret: created once, outside the applied children."""
        assert doc["kind"] == "Secret", doc["kind"]
        return True

    def delete(self, kind: str, namespace: str, name: str) -> None:
        raise AssertionError(f"nothing should be deleted: {kind}/{name}")


def live_children(spec: dict, fields: list[dict]) -> list[dict]:
    """The children as a fixed-replica apply left them; the decode Deployment carries
    `fields` as its managedFields."""
    docs = render_all(parse_spec(spec), OWNER, image="img")
    for doc in docs:
        doc["metadata"]["resourceVersion"] = "1"
        if doc["metadata"]["name"] == "svc-decode" and doc["kind"] == "Deployment":
            doc["metadata"]["managedFields"] = fields
    return docs


def run(fields: list[dict], spec: dict = HPA) -> RecordingKube:
    live = live_children(FIXED, fields)
    kube = RecordingKube(live)
    apply(kube, parse_spec(spec), OWNER, OperatorConfig(image="img"))
    return kube


def test_replicas_this_operator_applied_are_handed_over_before_the_hpa_apply():
    kube = run([managed(FIELD_MANAGER)])
    handed = [(i, doc) for i, (m, doc) in enumerate(kube.applied) if m == HANDOVER]
    assert [doc for _, doc in handed] == [{
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "svc-decode", "namespace": "ml"}, "spec": {"replicas": 5}}]
    main = next(i for i, (m, doc) in enumerate(kube.applied) if m == FIELD_MANAGER
                and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "svc-decode")
    assert handed[0][0] < main  # the second owner first, then the apply without replicas
    assert "replicas" not in kube.applied[main][1]["spec"]


def test_no_handover_once_the_hpa_or_a_previous_handover_holds_the_replicas():
    for fields in ([managed("kube-controller-manager", "Update")],
                   [managed(HANDOVER), managed(FIELD_MANAGER, replicas=False)],
                   [managed(FIELD_MANAGER, "Update")], []):
        assert [m for m, _ in run(fields).applied if m == HANDOVER] == [], fields


def test_no_handover_for_a_pool_that_keeps_fixed_replicas():
    kube = run([managed(FIELD_MANAGER)], spec=FIXED)
    assert [m for m, _ in kube.applied if m == HANDOVER] == []
    decode = next(doc for m, doc in kube.applied if doc["metadata"]["name"] == "svc-decode"
                  and doc["kind"] == "Deployment")
    assert decode["spec"]["replicas"] == 5
