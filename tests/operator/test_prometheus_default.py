"""`monitoring.serviceMonitor: true` without `monitoring.prometheus`: the NetworkPolicies
admit the Prometheus Operator's Prometheus pods (app.kubernetes.io/name=prometheus) of the
namespace `monitoring` to the workers' http port and the routers' metrics port, so what the
ServiceMonitor asks Prometheus to scrape is not dropped (and the chart's dashboard has
data). An explicit `monitoring.prometheus` replaces that default; without a ServiceMonitor
no one is admitted unless named. Checked with the NetworkPolicy evaluator (tests.operator.
netpol) on the rendered policies."""

from __future__ import annotations

import kubernetes_validate

from tandem.operator.render import Owner, render_all
from tandem.operator.render.common import HTTP_PORT, METRICS_PORT
from tandem.operator.spec import parse_spec
from tests.operator.manifests import K8S, by_kind
from tests.operator.netpol import Pod, admitted, pods_of
from tests.operator.samples import spec
from tests.operator.test_render_security import OPERATOR

NS = "ml"
PROM = {"app.kubernetes.io/name": "prometheus", "prometheus": "kube-prometheus-stack"}
SCRAPERS = [Pod("monitoring/prometheus", "monitoring", PROM),
            Pod("monitoring/grafana", "monitoring", {"app.kubernetes.io/name": "grafana"}),
            Pod("observability/prometheus", "observability", PROM),
            Pod("ml/prometheus", NS, PROM)]


def scraped(raw: dict) -> dict[str, set[str]]:
    """Which of `SCRAPERS` reach each pool's http port and the router's metrics port."""
    docs = render_all(parse_spec(raw), Owner("demo", NS, "u-1"), image="t", operator=OPERATOR)
    policies = by_kind(docs, "NetworkPolicy")
    for p in policies:
        kubernetes_validate.validate(p, K8S, strict=True)
    pods = pods_of(docs, NS)
    out = {}
    for pod in pods:
        port = METRICS_PORT if pod.name.endswith("-router") else HTTP_PORT
        out[pod.name] = admitted(policies, SCRAPERS, pod, port)
    return out


def test_a_service_monitor_admits_the_prometheus_operators_pods_by_default() -> None:
    raw = spec("disaggregated")
    raw["monitoring"] = {"serviceMonitor": True}
    assert scraped(raw) == {name: {"monitoring/prometheus"} for name in (
        "ml/demo-router", "ml/demo-prefill", "ml/demo-decode")}


def test_an_explicit_prometheus_wins_over_the_default() -> None:
    raw = spec("disaggregated")
    raw["monitoring"] = {"serviceMonitor": True, "prometheus": {"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "observability"}}}}
    assert set(map(frozenset, scraped(raw).values())) == {
        frozenset({"observability/prometheus"})}


def test_without_a_service_monitor_no_scraper_is_admitted_unless_named() -> None:
    assert set(map(frozenset, scraped(spec("disaggregated")).values())) == {frozenset()}
