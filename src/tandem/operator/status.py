"""The InferenceService's status as pure functions: per pool replicas from the children's
Deployments (a multi-node pool's LeaderWorkerSet: its groups, each one tensor-parallel
worker, ready when all its pods are), the Ready / Progressing / Degraded conditions with
reasons, and the minimal merge patch from the status there is to the status there should be.

With a pool under `autoscaling.mode: hpa`, a fourth condition, `MetricsAdapter` (status
Unknown: the operator cannot see the custom metrics API), names the per-pod metric each HPA
reads and how to install the adapter that serves it (`render.monitoring.ADAPTER_INSTALL`)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from tandem.operator.render import (
    Owner,
    front_door_name,
    pool_name,
    pool_selector,
    pools,
    router_endpoint,
    router_name,
)
from tandem.operator.render.monitoring import ADAPTER_INSTALL
from tandem.operator.render.multinode import LWS_KIND
from tandem.operator.spec import InferenceServiceSpec, signal_for

STATUS_KEY = {"prefill": "prefill", "decode": "decode", "worker": "decode"}  # pool -> status
CONDITIONS = ("Ready", "Progressing", "Degraded")


def now_iso() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rollout(dep: Mapping[str, Any] | None) -> tuple[int, int, bool]:
    """(wanted, ready, rolled out) of a Deployment or LeaderWorkerSet (replicas: groups); a
    missing one wants 1 and has none. An LWS controller older than v0.9 reports no
    observedGeneration: its counts are taken as current."""
    if dep is None:
        return 1, 0, False
    spec, st = dep.get("spec") or {}, dep.get("status") or {}
    wanted = spec.get("replicas", 1)
    ready = st.get("readyReplicas") or 0
    seen = st.get("observedGeneration")
    if seen is None and dep.get("kind") == LWS_KIND and st:
        seen = dep["metadata"].get("generation", 0)
    current = (seen or 0) >= dep["metadata"].get("generation", 0)
    done = (current and (st.get("updatedReplicas") or 0) >= wanted and ready >= wanted
            and (st.get("replicas") or 0) <= wanted)
    return wanted, ready, done


def condition(current: list[dict[str, Any]], type_: str, status: bool, reason: str,
              message: str, generation: int, now: str) -> dict[str, Any]:
    """One condition; its lastTransitionTime moves only when its status does."""
    value = "True" if status else "False"
    old = next((c for c in current if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == value and old.get(
        "lastTransitionTime") else now
    return {"type": type_, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def conditions(current: list[dict[str, Any]], generation: int, now: str, *, ready: bool,
               progressing: bool, degraded: bool, reason: str, message: str) -> list[dict]:
    """All three: `reason`/`message` explain the one that is not as it should be."""
    ok = ("AllReplicasReady", "RolloutComplete", "AsExpected")
    return [condition(current, "Ready", ready, ok[0] if ready else reason,
                      "" if ready else message, generation, now),
            condition(current, "Progressing", progressing, reason if progressing else ok[1],
                      message if progressing else "", generation, now),
            condition(current, "Degraded", degraded, reason if degraded else ok[2],
                      message if degraded else "", generation, now)]


METRICS_ADAPTER = "MetricsAdapter"


def adapter_condition(spec: InferenceServiceSpec, owner: Owner,
                      current: list[dict[str, Any]], generation: int,
                      now: str) -> dict[str, Any] | None:
    """`MetricsAdapter` for the pools an HPA scales (None without one): their metrics and the
    adapter to install."""
    hpas = [f"HorizontalPodAutoscaler {pool_name(owner, p)} reads the per-pod metric "
            f"{signal_for(p.spec.autoscaling.signal, p.role).hpa_metric}"
            for p in pools(spec)
            if p.spec.autoscaling is not None and p.spec.autoscaling.mode == "hpa"]
    if not hpas:
        return None
    message = ("; ".join(hpas) + " from the custom metrics API (custom.metrics.k8s.io), "
               "which needs Prometheus scraping the workers (monitoring.serviceMonitor) and "
               f"prometheus-adapter with Tandem's rules: {ADAPTER_INSTALL}")
    old = next((c for c in current if c.get("type") == METRICS_ADAPTER), None)
    since = old["lastTransitionTime"] if old and old.get("status") == "Unknown" and old.get(
        "lastTransitionTime") else now
    return {"type": METRICS_ADAPTER, "status": "Unknown", "reason": "CustomMetricsRequired",
            "message": message, "lastTransitionTime": since, "observedGeneration": generation}


def failed(current: Mapping[str, Any], generation: int, reason: str, message: str,
           now: str) -> dict[str, Any]:
    """Status for a spec that cannot be deployed (`InvalidSpec`) or an apply that failed."""
    retrying = reason != "InvalidSpec"
    conds = conditions(current.get("conditions") or [], generation, now, ready=False,
                       progressing=retrying, degraded=True, reason=reason, message=message)
    out: dict[str, Any] = {"conditions": conds}
    if not retrying:  # nothing will happen for this generation until the spec changes
        out["observedGeneration"] = generation
    return out


def observed(spec: InferenceServiceSpec, owner: Owner, current: Mapping[str, Any],
             deployments: Mapping[str, Mapping[str, Any]], generation: int,
             now: str, router_problem: str | None = None) -> dict[str, Any]:
    """Status from the children's workloads (name -> Deployment or LeaderWorkerSet, with
    its `kind`, as `reconcile.workloads` reads them); `router_problem`: why nothing routes
    to this attached service (not Ready, reason RouterNotFound)."""
    front = front_door_name(spec, owner)  # None: attached; NAME-epp: gateway mode
    # the router's URL; none for an EPP (clients use the gateway) or an attached service,
    # whose `router` names the InferenceService that serves it
    endpoint = router_endpoint(owner) if front == router_name(owner) else None
    out: dict[str, Any] = {"endpoint": endpoint, "router": spec.router.attach_to or owner.name,
                           "modelDigest": spec.model.sha256,
                           "prefill": {"replicas": 0, "readyReplicas": 0, "selector": None,
                                       "desiredReplicas": None, "lastScaleTime": None}}
    waiting = []
    for pool in pools(spec):
        name = pool_name(owner, pool)
        dep = deployments.get(name)
        wanted, ready, done = rollout(dep)
        st = (dep or {}).get("status") or {}
        old = current.get(STATUS_KEY[pool.name]) or {}
        entry = {"replicas": st.get("replicas") or 0, "readyReplicas": ready,
                 "selector": pool_selector(owner, pool)}
        if pool.spec.autoscaling is None or pool.spec.autoscaling.mode != "operator":
            entry |= {"desiredReplicas": None, "lastScaleTime": None}
        else:  # the autoscaler's own fields stay as it wrote them
            entry |= {k: old[k] for k in ("desiredReplicas", "lastScaleTime") if k in old}
        out[STATUS_KEY[pool.name]] = entry
        if not done:
            waiting.append(f"{name}: {ready}/{wanted} ready")
    if front is not None:
        wanted, ready, done = rollout(deployments.get(front))
        out["routerReadyReplicas"] = ready
        if not done:
            waiting.append(f"{front}: {ready}/{wanted} ready")
    else:
        out["routerReadyReplicas"] = None
    if router_problem:
        waiting.insert(0, router_problem)
    out["conditions"] = conditions(
        current.get("conditions") or [], generation, now, ready=not waiting,
        progressing=bool(waiting), degraded=False,
        reason="RouterNotFound" if router_problem else "ReplicasNotReady",
        message="; ".join(waiting))
    adapter = adapter_condition(spec, owner, current.get("conditions") or [], generation, now)
    if adapter is not None:
        out["conditions"].append(adapter)
    return out


def merge_patch(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns `current` into `wanted` for the keys of `wanted` (None
    deletes); empty when nothing differs. Lists and scalars are replaced whole."""
    out: dict[str, Any] = {}
    for key, value in wanted.items():
        have = current.get(key)
        if isinstance(value, Mapping) and isinstance(have, Mapping):
            sub = merge_patch(have, value)
            if sub:
                out[key] = sub
        elif value is None:
            if key in current:
                out[key] = None
        elif value != have:
            out[key] = ({k: v for k, v in value.items() if v is not None}
                        if isinstance(value, Mapping) else value)
    return out
