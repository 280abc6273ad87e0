"""One router over several InferenceServices in Kubernetes: `--inference-service a,b` selects
the worker slices of both (`tandem.dev/inference-service in (a,b)`), `--router-group NAME`
those labelled `tandem.dev/router-group=NAME`; the real client sends that selector to
kmock's API emulator, and the router app built from the flags routes each model to its
service's workers."""

from __future__ import annotations

import time

import httpx
import kmock
import pytest

from tandem.protocol.labels import (
    COMPONENT_LABEL,
    ROUTER_GROUP_LABEL,
    SERVICE_LABEL,
    WORKER_COMPONENT,
)
from tandem.router.discovery import KubernetesDiscovery, worker_selector
from tandem.router.main import build
from tandem.router.scorers.session import SESSION_HEADER
from tests.router.stub_worker import StubWorker
from tests.router.test_discovery import NS, FakeKube, _args, endpoint_slice, kube  # noqa: F401
from tests.router.test_router_app import Served
from tests.serving.helpers import free_port

WORKERS = f"{COMPONENT_LABEL}={WORKER_COMPONENT}"


def test_the_selector_for_several_services_or_a_router_group():
    assert worker_selector() == WORKERS
    assert worker_selector("chat") == f"{WORKERS},{SERVICE_LABEL}=chat"
    assert worker_selector("embed, chat,chat") == f"{WORKERS},{SERVICE_LABEL} in (chat,embed)"
    assert worker_selector(router_group="team-a") == f"{WORKERS},{ROUTER_GROUP_LABEL}=team-a"
    assert worker_selector("chat", "team-a") == (
        f"{WORKERS},{SERVICE_LABEL}=chat,{ROUTER_GROUP_LABEL}=team-a")
    for bad in ("a b", "-a", "x" * 64, "a,(b)"):
        with pytest.raises(ValueError, match="is not a Kubernetes label value"):
            worker_selector(bad)
    with pytest.raises(ValueError, match="'team a'"):
        worker_selector(router_group="team a")


def test_flags_and_router_yaml_select_several_services(tmp_path):
    _, _, server = build(_args("--discovery", "kubernetes", "--namespace", NS,
                               "--inference-service", "beta,alpha"))
    assert server.discovery.label_selector == f"{WORKERS},{SERVICE_LABEL} in (alpha,beta)"
    cfg = tmp_path / "router.yaml"
    cfg.write_text("discovery: kubernetes\nnamespace: tandem\nrouter_group: shared\n")
    _, _, server = build(_args("--config", str(cfg)))
    assert server.discovery.label_selector == f"{WORKERS},{ROUTER_GROUP_LABEL}=shared"
    with pytest.raises(SystemExit, match="--router-group: 'no good' is not"):
        build(_args("--config", str(cfg), "--router-group", "no good"))


def _slice(name: str, service: str, port: int, group: str | None = None) -> dict:
    body = endpoint_slice(name, port, [("127.0.0.1", True)])
    body["metadata"]["labels"][SERVICE_LABEL] = service
    if group is not None:
        body["metadata"]["labels"][ROUTER_GROUP_LABEL] = group
    return body


def test_one_router_discovers_and_routes_two_services(kube, tmp_path, monkeypatch):  # noqa: F811
    alpha, beta = StubWorker(free_port(), model="alpha"), StubWorker(free_port(), model="beta")
    kube.put(_slice("alpha-w", "alpha", alpha.port, "shared"))
    kube.put(_slice("beta-w", "beta", beta.port, "shared"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{kube.url}'}}}}]\n"
        "users: [{name: test, user: {token: test-token}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: test}}]\n")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    app, _, server = build(_args("--discovery", "kubernetes", "--namespace", NS,
                                 "--router-group", "shared"))
    assert isinstance(server.discovery, KubernetesDiscovery)
    router = Served(app)
    try:
        deadline = time.monotonic() + 10
        while httpx.get(router.url + "/ready", timeout=5).json()["ready_workers"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for model, worker in (("alpha", alpha), ("beta", beta), ("alpha", alpha)):
            r = httpx.post(router.url + "/v1/completions", timeout=10,
                           json={"model": model, "prompt": "hi"})
            assert r.status_code == 200 and r.json()["model"] == model
            assert worker.bodies[-1]["model"] == model and SESSION_HEADER in r.headers
        assert (len(alpha.bodies), len(beta.bodies)) == (2, 1)
        models = httpx.get(router.url + "/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == ["alpha", "beta"]
    finally:
        router.stop()
        alpha.stop()
        beta.stop()
    for request in (*kube.requests(kmock.action.LIST), *kube.requests(kmock.action.WATCH)):
        assert request.params["labelSelector"] == f"{WORKERS},{ROUTER_GROUP_LABEL}=shared"
