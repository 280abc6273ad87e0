"""The routers' /metrics on a port of their own: with API keys, /metrics on the front door
needs a key (which Prometheus does not send), so the operator runs every router with
`--metrics-port 9090` (a container port named `metrics`), points the pod's scrape
annotations and the ServiceMonitor (through a headless `NAME-metrics` Service, never the
front-door Service) at it, and its NetworkPolicy admits `monitoring.prometheus` alone to
that port. The rendered flags, run by the real router process, serve /metrics there without
a key and nowhere else."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx
import kubernetes_validate
import pytest
import yaml

from tandem.operator.render.common import METRICS_PORT
from tandem.operator.spec import MAX_NAME, parse_spec
from tandem.serving.ports import free_port
from tests.operator.manifests import K8S, arg, by_kind, container, matches, one, render
from tests.operator.netpol import Pod, admitted, selects, sends
from tests.operator.samples import SPECS, spec
from tests.operator.test_render_security import by_name, two_services

ROUTER = "demo-router"


def router_ports(docs: list[dict]) -> dict[str, int]:
    return {p["name"]: p["containerPort"]
            for p in container(one(docs, "Deployment", ROUTER))["ports"]}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_router_serves_metrics_on_the_named_metrics_port(name):
    docs = render(name)
    router = one(docs, "Deployment", ROUTER)
    args = container(router)["args"]
    assert arg(args, "--metrics-port") == "9090" == str(METRICS_PORT)
    assert router_ports(docs) == {"http": 8000, "metrics": 9090}
    assert router["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    for d in by_kind(docs, "Deployment"):
        if d["metadata"]["name"] != ROUTER:  # workers: /metrics on http, as before
            assert d["spec"]["template"]["metadata"]["annotations"][
                "prometheus.io/port"] == "8000"
            assert "metrics" not in {p["name"] for p in container(d)["ports"]}
    # the real router's parser and front-door settings: the side port, with no key there
    from tandem.router.main import add_router_args, front_door

    p = argparse.ArgumentParser(exit_on_error=False)
    add_router_args(p)
    parsed = p.parse_args(args[1:])
    cfg = yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])
    door = front_door(parsed, cfg)
    assert door.metrics_port == router_ports(docs)["metrics"] != parsed.port
    assert door.metrics_auth is None  # off on the metrics port, whatever the keys


def test_the_rendered_router_serves_metrics_without_a_key_on_its_metrics_port_only(tmp_path):
    """The rendered flags (keys on; file paths and ports moved to this machine, EndpointSlice
    discovery swapped for a static list) run by `tandem router`: /metrics answers on the
    metrics port without a key, and is gone from the front door, key or not."""
    docs = render("disaggregated")  # API keys and admin keys
    args = container(one(docs, "Deployment", ROUTER))["args"]
    assert args[0] == "router" and "--api-keys" in args
    cfg = yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])
    for local in ("tokenizers", "redis", "index", "redis_key_prefix"):  # no Redis, no files
        cfg.pop(local, None)
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "keys").write_text("sk-tenant acme\n")
    (tmp_path / "admins").write_text("sk-admin ops\n")
    key = tmp_path / "worker.key"
    key.touch(mode=0o600)
    key.write_bytes(os.urandom(32))
    port, metrics_port = free_port(), free_port()
    local = {"--host": "127.0.0.1", "--port": str(port), "--metrics-port": str(metrics_port),
             "--discovery": "static", "--config": str(tmp_path / "router.yaml"),
             "--api-keys": str(tmp_path / "keys"), "--admin-api-keys": str(tmp_path / "admins"),
             "--worker-auth-key-file": str(key)}
    argv = list(args[1:])
    for i, a in enumerate(argv[:-1]):
        if a in local:
            argv[i + 1] = local[a]
    assert not [a for a in argv if a.startswith("/etc/")]  # nothing left pointing into the pod
    log = tmp_path / "router.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "router", *argv,
             "--workers", "http://127.0.0.1:9"], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    main, side = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                httpx.get(main + "/health", timeout=1)
                r = httpx.get(side + "/metrics", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert r.status_code == 200 and "tandem_router_" in r.text, r.text
        key_header = {"Authorization": "Bearer sk-tenant"}
        assert httpx.get(main + "/metrics", timeout=5).status_code == 404
        assert httpx.get(main + "/metrics", headers=key_header, timeout=5).status_code == 404
        assert httpx.get(main + "/v1/models", timeout=5).status_code == 401  # keys in force
        assert httpx.get(side + "/v1/models", timeout=5).status_code == 404
    finally:
        proc.kill()
        proc.wait(timeout=10)


# ---- how Prometheus finds the routers --------------------------------------------------

def scraped(docs: list[dict]) -> set[tuple[str, str]]:
    """(Service, port name) pairs the ServiceMonitor's endpoints scrape: the Prometheus
    Operator keeps, per endpoint, the selected Services that have a port of its name."""
    (sm,) = by_kind(docs, "ServiceMonitor")
    out = set()
    for svc in by_kind(docs, "Service"):
        if not selects(sm["spec"]["selector"], svc["metadata"]["labels"]):
            continue
        names = {p["name"] for p in svc["spec"]["ports"]}
        out |= {(svc["metadata"]["name"], e["port"]) for e in sm["spec"]["endpoints"]
                if e["port"] in names}
    return out


def test_the_service_monitor_scrapes_the_routers_metrics_port_not_the_front_door():
    docs = render("gpu")  # monitoring.serviceMonitor
    assert scraped(docs) == {("demo-prefill", "http"), ("demo-decode", "http"),
                             ("demo-metrics", "metrics")}
    svc = one(docs, "Service", "demo-metrics")
    kubernetes_validate.validate(svc, K8S, strict=True)
    assert svc["spec"]["clusterIP"] == "None"  # endpoints only: never a LoadBalancer
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics",
                                     "protocol": "TCP"}]
    templates = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
                 for d in by_kind(docs, "Deployment")}
    assert [n for n, labels in templates.items()
            if matches(svc["spec"]["selector"], labels)] == [ROUTER]
    # the front door keeps its one port, and the router's EndpointSlice discovery (workers
    # only) does not pick the metrics Service up
    assert [p["name"] for p in one(docs, "Service", ROUTER)["spec"]["ports"]] == ["http"]
    from tandem.router.discovery.k8s import worker_selector

    selector = dict(kv.split("=") for kv in worker_selector("demo").split(","))
    assert not matches(selector, svc["metadata"]["labels"])


def test_the_metrics_service_exists_only_with_a_service_monitor_and_fits_a_dns_label():
    assert "demo-metrics" not in {s["metadata"]["name"] for s in by_kind(render("secure"),
                                                                         "Service")}
    longest = "x" * MAX_NAME
    from tandem.operator.render import Owner, render_all

    docs = render_all(parse_spec(spec("gpu")), Owner(longest, "ml", "u"), image="t")
    for svc in by_kind(docs, "Service"):
        assert len(svc["metadata"]["name"]) <= 63
        kubernetes_validate.validate(svc, K8S, strict=True)


# ---- who reaches the metrics port ------------------------------------------------------

def _without_clients() -> dict:
    raw = spec("secure")
    del raw["router"]["allowedClients"]
    return raw


@pytest.mark.parametrize("raw", [spec("secure"), _without_clients()],
                         ids=["allowed-clients", "open-front-door"])
def test_prometheus_alone_reaches_the_routers_metrics_port(raw):
    policies, pods = two_services(raw)
    for svc in ("alpha", "beta"):
        router = by_name(pods, f"ml/{svc}-router")
        # not the operator (it scrapes workers only), clients, workers, the other routers,
        # nor a Prometheus-labelled pod outside the peer's namespace
        assert admitted(policies, pods, router, 9090) == {"monitoring/prometheus"}
        assert admitted(policies, pods, router, 9091) == set()


@pytest.mark.parametrize("raw", [spec("secure"), _without_clients()],
                         ids=["allowed-clients", "open-front-door"])
def test_prometheus_reaches_nothing_else_new(raw):
    """Where Prometheus may connect: the routers' metrics port (new) and what it reached
    before (the workers' http; the front door, which admits it with allowedClients and
    everyone without)."""
    policies, pods = two_services(raw)
    prom = by_name(pods, "monitoring/prometheus")
    ports = (8000, 9090, 50051, 6379, 29500)
    reached = {(t.name, port) for t in pods for port in ports
               if t is not prom and prom.name in admitted(policies, [prom], t, port)}
    ours = {p.name for p in pods if p.name.startswith(("ml/alpha-", "ml/beta-"))}
    want = set()
    for svc in ("alpha", "beta"):
        want |= {(f"ml/{svc}-router", 8000), (f"ml/{svc}-router", 9090),
                 (f"ml/{svc}-prefill", 8000), (f"ml/{svc}-decode", 8000)}
    assert {(n, p) for n, p in reached if n in ours} == want


def test_without_a_prometheus_peer_no_one_reaches_the_metrics_port():
    policies, pods = two_services(spec("disaggregated"))
    router = by_name(pods, "ml/alpha-router")
    assert router.ports["metrics"] == 9090
    assert admitted(policies, pods, router, 9090) == set()
    assert admitted(policies, pods, router, 8000) == {p.name for p in pods} - {router.name}


def test_no_rendered_pod_sends_to_a_routers_metrics_port():
    """Egress: the routers' and workers' own policies open no way to a metrics port (the
    Prometheus pods are not theirs to govern)."""
    policies, pods = two_services(spec("secure"))
    ours = [p for p in pods if p.name.startswith(("ml/alpha-", "ml/beta-"))]
    for target in (by_name(pods, "ml/alpha-router"), by_name(pods, "ml/beta-router")):
        for source in ours:
            if source is not target:
                assert not sends(policies, source, target, 9090), (source.name, target.name)
    outsider = Pod("monitoring/prometheus", "monitoring", {})
    assert sends(policies, outsider, by_name(pods, "ml/alpha-router"), 9090)  # ungoverned
