"""The chart and the operator's NetworkPolicies together, evaluated with NetworkPolicy
semantics (`tests.operator.netpol`) over the pods the chart renders (the operator, Redis)
and the pods the operator renders for two InferenceServices, as the chart's environment
(TANDEM_OPERATOR_NAMESPACE / TANDEM_OPERATOR_RELEASE) configures it: the workers admit the
release's operator to /metrics only, the routers' metrics port admits the Prometheus peer
alone (not the operator, which scrapes workers only), and Redis admits exactly this
release's routers."""

from __future__ import annotations

from typing import Any

from tandem.operator.render import Owner, render_all
from tandem.operator.render.security import operator_from_env
from tandem.operator.spec import parse_spec
from tests.chart.conftest import NAMESPACE, RELEASE, Helm, by_kind, one
from tests.operator.netpol import Pod, admitted, pods_of
from tests.operator.samples import spec

REDIS_PORT = 6379


def chart_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The operator container's environment as the kubelet resolves it in NAMESPACE."""
    (c,) = one(docs, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"][
        "containers"]
    return {e["name"]: e.get("value", NAMESPACE) for e in c["env"]
            if "value" in e or e["valueFrom"].get("fieldRef", {}).get("fieldPath")
            == "metadata.namespace"}


def cluster(helm: Helm, sets: tuple[str, ...] = (),
            sample: str = "disaggregated") -> tuple[list[dict], list[Pod]]:
    chart = helm.render(sets=("redis.enabled=true", *sets))
    operator = operator_from_env(chart_env(chart))
    docs, pods = list(chart), pods_of(chart, NAMESPACE)
    for ns, name, peer in (("ml", "alpha", operator), ("ml", "beta", operator),
                           ("elsewhere", "gamma", operator),
                           ("ml", "other", type(operator)(NAMESPACE, "another-release"))):
        out = render_all(parse_spec(spec(sample)), Owner(name, ns, f"u-{name}"),
                         image="t", operator=peer)
        docs += out
        pods += pods_of(out, ns)
    return by_kind(docs, "NetworkPolicy"), pods


def pod(pods: list[Pod], name: str) -> Pod:
    (p,) = [p for p in pods if p.name == name]
    return p


def test_the_workers_admit_the_charts_operator_to_metrics_only(helm: Helm) -> None:
    policies, pods = cluster(helm)
    decode = pod(pods, "ml/alpha-decode")
    assert admitted(policies, pods, decode, 8000) == {"ml/alpha-router",
                                                      f"{NAMESPACE}/{RELEASE}-operator"}
    assert f"{NAMESPACE}/{RELEASE}-operator" not in admitted(policies, pods, decode, 50051)
    assert f"{NAMESPACE}/{RELEASE}-redis" not in admitted(policies, pods, decode, 8000)


def test_redis_admits_exactly_the_routers_of_this_release(helm: Helm) -> None:
    policies, pods = cluster(helm)
    redis = pod(pods, f"{NAMESPACE}/{RELEASE}-redis")
    assert admitted(policies, pods, redis, REDIS_PORT) == {
        "ml/alpha-router", "ml/beta-router", "elsewhere/gamma-router",
        f"{NAMESPACE}/{RELEASE}-operator"}  # the operator: the ACL users
    assert admitted(policies, pods, redis, 8000) == set()
    # limited to the watched namespaces: a router elsewhere is out
    policies, pods = cluster(helm, ("watchNamespaces={ml}",))
    redis = pod(pods, f"{NAMESPACE}/{RELEASE}-redis")
    assert admitted(policies, pods, redis, REDIS_PORT) == {"ml/alpha-router", "ml/beta-router",
                                                           f"{NAMESPACE}/{RELEASE}-operator"}


def test_the_routers_metrics_port_admits_prometheus_only(helm: Helm) -> None:
    """`monitoring.prometheus` (the "secure" sample: namespace monitoring) reaches a router's
    keyless metrics port (9090); the chart's operator and Redis do not, nor does anything
    without that peer."""
    policies, pods = cluster(helm, sample="secure")
    prometheus = Pod("monitoring/prometheus", "monitoring",
                     {"app.kubernetes.io/name": "prometheus", "shard": "0"})
    pods.append(prometheus)
    router = pod(pods, "ml/alpha-router")
    assert admitted(policies, pods, router, 9090) == {"monitoring/prometheus"}
    policies, pods = cluster(helm)  # no Prometheus peer: no one
    assert admitted(policies, [*pods, prometheus], pod(pods, "ml/alpha-router"), 9090) == set()
