"""KEDA autoscaling (`autoscaling.mode: keda`): a `ScaledObject` (`keda.sh/v1alpha1`) per
pool, on the router's own signal for the pool's role.

* `scaleTargetRef`: the pool's workload (`Workload.target`: a Deployment, or a multi-node
  pool's LeaderWorkerSet, whose scale subresource counts groups), rendered without
  `replicas` (KEDA's HPA owns the count, as for `mode: hpa`).
* The trigger: KEDA's `metrics-api` scaler reads `GET /scaling?model=<served name>&role=<role>`
  on the routers' metrics port (`METRICS_PORT`, no key; the NetworkPolicy admits
  `monitoring.keda` there) through the headless Service NAME-metrics. The role is `prefill`
  for a prefill pool and `decode` for decode and aggregated pools. `valueLocation` is the
  signal's field (`demand` by default: requests queued in the router's flow control plus
  those running and waiting on the role's workers), `metricType: AverageValue` with
  `targetValue` = `autoscaling.target` per replica (kvUtilization: `Value`, the role's mean),
  and `activationTargetValue: 0`: the first queued request wakes a pool at zero.
* A model served under more than one name (`hf://ORG/NAME`: NAME and ORG/NAME) gets one
  more `demand` trigger per other name (`demand1`, ...): with no worker up the router
  queues each name apart, and a request for any of them wakes the pool.
* `keda.kvUtilizationTarget`: a second trigger on `kv_utilization` (`metricType: Value`); its
  activation threshold (above 1, never reached) leaves waking to the first trigger, so KV
  pages cached by idle workers never hold a pool above zero.
* `keda.bandTargets` (band -> target): one more trigger per band on the band's queue,
  `valueLocation: queued_by_band.<band>` (`AverageValue`, activation 0), named `band<n>`
  (`bandm<n>` for a negative band). KEDA's metrics-api scaler errors on a missing key, so
  router.yaml lists each such band under `flow_control.bands` (`render.router`), which the
  router always reports, 0 when empty.
* `minReplicaCount` (0: scale to zero), `maxReplicaCount`, `idleReplicaCount`,
  `pollingInterval`, `cooldownPeriod` (idle this long before 0) and the scale-down
  stabilization window of KEDA's HPA from the pool's `autoscaling`.

No TriggerAuthentication: the routers' metrics port never asks for a key (the operator
starts them with `--metrics-port` and without `metrics_auth`); the NetworkPolicy is its gate.
The operator's own autoscaler reads the same URL for a pool in `mode: operator` with
`signal: demand` (`reads_scaling`), through the same Service, admitted the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from tandem.operator.render.common import METRICS_PORT, Owner, metadata
from tandem.operator.render.gateway import router_owner
from tandem.operator.render.workload import Workload
from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.spec_autoscaling import DEMAND, KEDA_VALUES, AutoscalingSpec
from tandem.protocol.labels import WORKER_COMPONENT

API_VERSION = "keda.sh/v1alpha1"
KIND = "ScaledObject"
TRIGGER = "metrics-api"
NEVER_ACTIVE = "1.01"  # above any KV utilization (a fraction): a trigger that never wakes


def scaling_role(role: str) -> str:
    """The `/scaling` role of a pool's role: aggregated workers serve decode."""
    return "prefill" if role == "prefill" else "decode"


def metrics_host(owner: Owner) -> str:
    """The routers' metrics port through the headless Service NAME-metrics
    (`render.monitoring.router_metrics_service`)."""
    return f"http://{owner.name}-metrics.{owner.namespace}.svc:{METRICS_PORT}"


def scaling_url(spec: InferenceServiceSpec, owner: Owner, role: str,
                model: str | None = None) -> str:
    """The router's `/scaling` answer for `model` (default: the model's served name) and
    `role`."""
    query = urlencode({"model": model or spec.model.served_name, "role": scaling_role(role)})
    # (an attached InferenceService: the routers of `router.attachTo`, which serve its model)
    return f"{metrics_host(router_owner(spec, owner))}/scaling?{query}"


def scaling_urls(spec: InferenceServiceSpec, owner: Owner, role: str) -> list[str]:
    """`scaling_url` for every name the model is served under (an `hf://ORG/NAME` model is
    NAME and ORG/NAME too): with no worker up the router queues each name apart."""
    return [scaling_url(spec, owner, role, name) for name in spec.model.served_names]


def _number(value: float) -> str:
    return f"{value:g}"


def _trigger(name: str, url: str, location: str, metric_type: str, target: float,
             activation: str) -> dict[str, Any]:
    return {"type": TRIGGER, "name": name, "metricType": metric_type, "metadata": {
        "url": url, "format": "json", "valueLocation": location,
        "targetValue": _number(target), "activationTargetValue": activation}}


def triggers(spec: InferenceServiceSpec, owner: Owner, role: str,
             auto: AutoscalingSpec) -> list[dict[str, Any]]:
    url = scaling_url(spec, owner, role)
    kind = "Value" if auto.signal == "kvUtilization" else "AverageValue"
    out = [_trigger(auto.signal.lower(), url, KEDA_VALUES[auto.signal], kind, auto.target,
                    "0")]
    if auto.signal == DEMAND:  # with no worker up the router queues an alias apart
        out += [_trigger(f"demand{i}", alias, "demand", kind, auto.target, "0")
                for i, alias in enumerate(scaling_urls(spec, owner, role)[1:], 1)]
    kv = auto.keda.kv_utilization_target
    if kv is not None and auto.signal != "kvUtilization":
        out.append(_trigger("kvutilization", url, KEDA_VALUES["kvUtilization"], "Value", kv,
                            NEVER_ACTIVE))
    for band, target in auto.keda.band_targets:
        out.append(_trigger(f"band{band.replace('-', 'm')}", url, f"queued_by_band.{band}",
                            "AverageValue", target, "0"))
    return out


def scaled_object(spec: InferenceServiceSpec, owner: Owner,
                  workload: Workload) -> dict[str, Any]:
    """The ScaledObject of one pool in keda mode, named as its workload (NAME-POOL)."""
    auto = workload.pool.spec.autoscaling
    assert auto is not None and auto.mode == "keda"
    so: dict[str, Any] = {
        "scaleTargetRef": workload.target,
        "pollingInterval": auto.keda.polling_interval_seconds,
        "cooldownPeriod": auto.keda.cooldown_period_seconds,
        "minReplicaCount": auto.min_replicas,
        "maxReplicaCount": auto.max_replicas,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
            "stabilizationWindowSeconds": auto.scale_down_stabilization_seconds}}}},
        "triggers": triggers(spec, owner, workload.role, auto)}
    if auto.keda.idle_replicas is not None:
        so["idleReplicaCount"] = auto.keda.idle_replicas
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": metadata(owner, workload.name, WORKER_COMPONENT, workload.role),
            "spec": so}


def reads_scaling(auto: AutoscalingSpec | None) -> bool:
    """Does the pool's autoscaler read the router's `/scaling` (keda; operator on demand)?"""
    return auto is not None and (auto.mode == "keda" or (
        auto.mode == "operator" and auto.signal == DEMAND))


def scaling_workloads(workloads: Sequence[Workload]) -> list[Workload]:
    """The pools whose autoscaler reads the router's `/scaling` (`reads_scaling`)."""
    return [w for w in workloads if reads_scaling(w.pool.spec.autoscaling)]


def keda_workloads(workloads: Sequence[Workload]) -> list[Workload]:
    return [w for w in workloads
            if w.pool.spec.autoscaling is not None and w.pool.spec.autoscaling.mode == "keda"]


def scaled_objects(spec: InferenceServiceSpec, owner: Owner,
                   workloads: Sequence[Workload]) -> list[dict[str, Any]]:
    return [scaled_object(spec, owner, w) for w in keda_workloads(workloads)]
