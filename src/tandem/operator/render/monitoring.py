"""Optional extras: a ServiceMonitor (Prometheus Operator) for the workers' Services (their
`http` port) and the routers' metrics Service (`router_metrics_service`: their `metrics`
port, where /metrics needs no key; never the router's front-door Service), and per pool
with `autoscaling.mode: hpa` a HorizontalPodAutoscaler on the pool's signal, read per pod
through a custom-metrics adapter (names in `tandem.operator.spec.SIGNALS`). A
multi-node pool's HPA scales its LeaderWorkerSet's groups (their scale subresource selects
the leaders, whose metrics are the group's)."""

from __future__ import annotations

from typing import Any

from tandem.operator.render.common import (
    HTTP_PORT_NAME,
    METRICS_PORT,
    METRICS_PORT_NAME,
    Owner,
    labels,
    metadata,
)
from tandem.operator.render.workload import Workload
from tandem.operator.spec import AutoscalingSpec, InferenceServiceSpec, signal_for
from tandem.protocol.labels import (
    COMPONENT_LABEL,
    ROUTER_COMPONENT,
    SERVICE_LABEL,
    WORKER_COMPONENT,
)

ROUTER_METRICS_COMPONENT = "router-metrics"  # the label of the routers' metrics Service
# what serves an HPA's per-pod metrics (custom.metrics.k8s.io): prometheus-adapter with the
# chart's rules (one per `SIGNALS` metric; a test holds the file to the workers' metrics)
ADAPTER_VALUES = "charts/tandem/examples/prometheus-adapter/values.yaml"
ADAPTER_INSTALL = ("helm install prometheus-adapter prometheus-community/prometheus-adapter "
                   f"-n monitoring -f {ADAPTER_VALUES}")


def router_metrics_service(owner: Owner) -> dict[str, Any]:
    """Headless, the routers' `metrics` port only: what the ServiceMonitor finds them by
    (NAME-metrics: as long as NAME-prefill, within a DNS label for every valid NAME)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, f"{owner.name}-metrics", ROUTER_METRICS_COMPONENT),
            "spec": {"clusterIP": "None", "selector": labels(owner, ROUTER_COMPONENT),
                     "ports": [{"name": METRICS_PORT_NAME, "port": METRICS_PORT,
                                "targetPort": METRICS_PORT_NAME, "protocol": "TCP"}]}}


def service_monitor(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any]:
    """Scrapes `/metrics` on the `http` port of the worker Services and on the `metrics`
    port of `router_metrics_service` (each endpoint keeps only the Services with a port of
    its name); the router's front-door Service is not selected. `monitoring.labels` are
    added to its labels (the ones a Prometheus's serviceMonitorSelector matches), never in
    place of the operator's own (`parse_spec` refuses those keys)."""
    meta = metadata(owner, owner.name, "metrics")
    own = meta["labels"]
    own.update({k: v for k, v in spec.monitoring_labels.items() if k not in own})
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": meta,
            "spec": {"selector": {
                         "matchLabels": {SERVICE_LABEL: owner.name},
                         "matchExpressions": [{
                             "key": COMPONENT_LABEL, "operator": "In",
                             "values": [WORKER_COMPONENT, ROUTER_METRICS_COMPONENT]}]},
                     "namespaceSelector": {"matchNames": [owner.namespace]},
                     "endpoints": [{"port": port, "path": "/metrics",
                                    "interval": spec.scrape_interval}
                                   for port in (HTTP_PORT_NAME, METRICS_PORT_NAME)]}}


def quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as they are, else in thousandths ("800m")."""
    return str(int(value)) if value == int(value) else f"{round(value * 1000)}m"


def hpa(owner: Owner, workload: Workload, auto: AutoscalingSpec) -> dict[str, Any]:
    """Scales `workload` (its `target`: a Deployment's pods, a LeaderWorkerSet's groups)."""
    metric = signal_for(auto.signal, workload.role).hpa_metric
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": metadata(owner, workload.name, WORKER_COMPONENT, workload.role),
            "spec": {
                "scaleTargetRef": workload.target,
                "minReplicas": auto.min_replicas, "maxReplicas": auto.max_replicas,
                "metrics": [{"type": "Pods", "pods": {
                    "metric": {"name": metric},
                    "target": {"type": "AverageValue", "averageValue": quantity(auto.target)}}}],
                "behavior": {"scaleDown": {
                    "stabilizationWindowSeconds": auto.scale_down_stabilization_seconds}}}}
