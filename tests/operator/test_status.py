"""The InferenceService's status as pure functions (`tandem.operator.status`): rollout state
of a Deployment, conditions and their transition times, per pool replicas, and the minimal
merge patch the handlers send."""

from __future__ import annotations

from typing import Any

from tandem.operator.render import Owner
from tandem.operator.spec import parse_spec
from tandem.operator.status import condition, failed, merge_patch, observed, rollout
from tests.operator.samples import SHA, spec

OWNER = Owner("demo", "ml", "uid-1")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def deployment(replicas: int, ready: int, *, generation: int = 1, observed_gen: int = 1,
               updated: int | None = None, total: int | None = None) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed_gen, "readyReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated,
                       "replicas": replicas if total is None else total}}


def test_rollout():
    assert rollout(None) == (1, 0, False)
    assert rollout(deployment(3, 3)) == (3, 3, True)
    assert rollout(deployment(3, 2)) == (3, 2, False)
    assert rollout(deployment(3, 3, generation=2)) == (3, 3, False)  # not yet observed
    assert rollout(deployment(3, 3, updated=2)) == (3, 3, False)  # old pods left
    assert rollout(deployment(3, 3, total=4)) == (3, 3, False)  # surge pod still there
    assert rollout({"metadata": {"generation": 1}, "spec": {"replicas": 2}}) == (2, 0, False)


def test_condition_keeps_its_transition_time_until_its_status_moves():
    first = condition([], "Ready", False, "ReplicasNotReady", "x", 1, T0)
    assert first["lastTransitionTime"] == T0 and first["status"] == "False"
    same = condition([first], "Ready", False, "ReplicasNotReady", "y", 2, T1)
    assert same["lastTransitionTime"] == T0 and same["observedGeneration"] == 2
    moved = condition([first], "Ready", True, "AllReplicasReady", "", 2, T1)
    assert moved["lastTransitionTime"] == T1


def test_observed_disaggregated_ready_and_not():
    s = parse_spec(spec("disaggregated"))
    deps = {"demo-prefill": deployment(2, 2), "demo-decode": deployment(3, 1),
            "demo-router": deployment(2, 2)}
    out = observed(s, OWNER, {}, deps, 1, T0)
    assert out["endpoint"] == "http://demo-router.ml.svc:8000"
    assert out["modelDigest"] == SHA
    assert out["prefill"]["readyReplicas"] == 2 and out["decode"]["readyReplicas"] == 1
    assert out["decode"]["replicas"] == 3 and out["routerReadyReplicas"] == 2
    assert out["decode"]["selector"].endswith("tandem.dev/role=decode")
    ready = {c["type"]: c for c in out["conditions"]}
    assert ready["Ready"]["status"] == "False"
    assert ready["Ready"]["message"] == "demo-decode: 1/3 ready"
    assert ready["Progressing"]["status"] == "True" and ready["Degraded"]["status"] == "False"
    deps["demo-decode"] = deployment(3, 3)
    conds = {c["type"]: c for c in observed(s, OWNER, out, deps, 1, T1)["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "AllReplicasReady"
    assert conds["Ready"]["lastTransitionTime"] == T1
    assert conds["Degraded"]["lastTransitionTime"] == T0  # unchanged: False all along


def test_observed_aggregated_zeroes_prefill_and_misses_count_as_not_ready():
    s = parse_spec(spec("aggregated"))
    out = observed(s, OWNER, {}, {}, 1, T0)
    assert out["prefill"] == {"replicas": 0, "readyReplicas": 0, "selector": None,
                              "desiredReplicas": None, "lastScaleTime": None}
    assert out["decode"]["selector"].endswith("tandem.dev/role=both")
    assert out["modelDigest"] is None
    ready = out["conditions"][0]
    assert ready["message"] == "demo-worker: 0/1 ready; demo-router: 0/1 ready"


def test_observed_keeps_the_autoscalers_fields_only_for_operator_mode():
    s = parse_spec(spec("autoscaling"))  # prefill: mode hpa; decode: mode operator
    current = {"prefill": {"desiredReplicas": 3, "lastScaleTime": T0},
               "decode": {"desiredReplicas": 5, "lastScaleTime": T0}}
    out = observed(s, OWNER, current, {}, 1, T1)
    assert out["decode"]["desiredReplicas"] == 5 and out["decode"]["lastScaleTime"] == T0
    assert out["prefill"]["desiredReplicas"] is None  # removed by the merge patch


def test_failed():
    invalid = failed({}, 3, "InvalidSpec", "decode.engine.kvCacheMemory '1.5': ...", T0)
    assert invalid["observedGeneration"] == 3  # judged: nothing more for this generation
    conds = {c["type"]: c for c in invalid["conditions"]}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "InvalidSpec")
    assert conds["Degraded"]["message"].startswith("decode.engine.kvCacheMemory")
    assert conds["Progressing"]["status"] == "False"
    retrying = failed({}, 3, "ApplyFailed", "503 Service Unavailable", T0)
    assert "observedGeneration" not in retrying  # it will be retried
    conds = {c["type"]: c for c in retrying["conditions"]}
    assert conds["Progressing"]["status"] == "True" and conds["Degraded"]["status"] == "True"


def test_merge_patch():
    current = {"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2], "kopf": {"x": 1}}
    assert merge_patch(current, {"a": 1, "b": {"c": 2}}) == {}
    assert merge_patch(current, {"a": 2, "b": {"d": None}}) == {"a": 2, "b": {"d": None}}
    assert merge_patch(current, {"gone": None}) == {}  # absent stays absent
    assert merge_patch(current, {"l": [1, 2, 3]}) == {"l": [1, 2, 3]}  # lists whole
    assert merge_patch(current, {"n": {"x": 1, "y": None}}) == {"n": {"x": 1}}
    assert merge_patch({}, {"b": {"c": 1}}) == {"b": {"c": 1}}
