"""Worker discovery. `KubernetesDiscovery` runs the real `kubernetes` client against kmock's
Kubernetes API emulator over real HTTP (EndpointSlices are written through that API too, as
the EndpointSlice controller would); the end-to-end test puts the router app from
`tandem.router.main.build` in front of stub OpenAI workers and moves them through slices."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import kmock
import pytest
from kubernetes.client import ApiClient, Configuration, DiscoveryV1Api
from kubernetes.client.exceptions import ApiException

from tandem.protocol.labels import COMPONENT_LABEL, ROLE_LABEL, SERVICE_LABEL, WORKER_COMPONENT
from tandem.router.discovery import (
    KubernetesDiscovery,
    StaticDiscovery,
    WorkerEndpoint,
    worker_selector,
)
from tandem.router.discovery import k8s as k8s_discovery
from tandem.router.discovery.k8s import slice_endpoints
from tandem.router.main import add_router_args, build

from .test_router_app import Served, stub_openai

NS = "tandem"
SERVICE = "demo"


def endpoint_slice(name: str, port: int, addresses: list[tuple[str, bool | None]], *,
                   role: str | None = None, port_name: str = "http",
                   other_ports: tuple[dict, ...] = (), address_type: str = "IPv4") -> dict:
    """An EndpointSlice as the controller writes it for a worker Service (whose labels it
    copies); `ready` None leaves `conditions.ready` out (which means ready)."""
    labels = {COMPONENT_LABEL: WORKER_COMPONENT, SERVICE_LABEL: SERVICE,
              "kubernetes.io/service-name": f"{SERVICE}-{name}"}
    if role is not None:
        labels[ROLE_LABEL] = role
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "addressType": address_type,
        "endpoints": [{"addresses": [a], "conditions": {} if r is None else {"ready": r}}
                      for a, r in addresses],
        "ports": [*other_ports, {"name": port_name, "port": port, "protocol": "TCP"}],
    }


class FakeKube:
    """kmock's Kubernetes emulator on a real port, on its own event loop in a thread."""

    def __init__(self) -> None:
        started = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(started),),
                                        daemon=True)
        self._thread.start()
        assert started.wait(10), "kmock did not start"
        self.api = DiscoveryV1Api(self.client())

    async def _serve(self, started: threading.Event) -> None:
        async with kmock.KubernetesEmulator() as km, kmock.Server(km) as server:
            self.km, self.url = km, str(server.url).rstrip("/")
            self.loop, self._done = asyncio.get_running_loop(), asyncio.Event()
            km.resources["discovery.k8s.io/v1/endpointslices"] = {}  # served while empty
            started.set()
            await self._done.wait()

    def client(self) -> ApiClient:
        return ApiClient(Configuration(host=self.url))

    def on_server(self, fn: Callable[[Any], None]) -> None:
        """Run `fn(km)` on the emulator's own loop (to program reactions)."""
        async def call() -> None:
            fn(self.km)

        asyncio.run_coroutine_threadsafe(call(), self.loop).result(5)

    def put(self, body: dict) -> None:
        try:
            self.api.create_namespaced_endpoint_slice(NS, body)
        except ApiException as exc:
            assert exc.status == 409, exc
            self.api.patch_namespaced_endpoint_slice(body["metadata"]["name"], NS, body)

    def delete(self, name: str) -> None:
        self.api.delete_namespaced_endpoint_slice(name, NS)

    def requests(self, action: kmock.action) -> list:
        return list(self.km[action])

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)


@pytest.fixture()
def kube() -> Iterator[FakeKube]:
    k = FakeKube()
    yield k
    k.stop()


class Reports:
    """The complete sets a discovery reported, in order."""

    def __init__(self) -> None:
        self.sets: list[dict[str, WorkerEndpoint]] = []

    def __call__(self, endpoints: dict[str, WorkerEndpoint]) -> None:
        self.sets.append(endpoints)

    async def until(self, *endpoints: WorkerEndpoint, timeout: float = 5.0) -> None:
        want = {ep.url: ep for ep in endpoints}
        deadline = time.monotonic() + timeout
        while not self.sets or self.sets[-1] != want:
            assert time.monotonic() < deadline, f"reported {self.sets[-1:]}, want {want}"
            await asyncio.sleep(0.01)


def discovery(kube: FakeKube) -> KubernetesDiscovery:
    return KubernetesDiscovery(NS, worker_selector(SERVICE), api_client=kube.client(),
                               backoff_min_s=0.05, backoff_max_s=0.2)


async def until_cancelled(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_list_then_watch_follows_joins_readiness_and_removals(kube):
    kube.put(endpoint_slice("a", 8000, [("10.0.0.1", None), ("10.0.0.2", False)]))
    a1, a2 = "http://10.0.0.1:8000", "http://10.0.0.2:8000"

    async def scenario() -> Reports:
        seen = Reports()
        task = asyncio.create_task(discovery(kube).run(seen))
        await seen.until(WorkerEndpoint(a1, "both", True), WorkerEndpoint(a2, "both", False))
        kube.put(endpoint_slice("b", 8001, [("10.0.0.3", True)], role="decode"))  # joins
        b = WorkerEndpoint("http://10.0.0.3:8001", "decode", True)
        await seen.until(WorkerEndpoint(a1, ready=True), WorkerEndpoint(a2, ready=False), b)
        kube.put(endpoint_slice("a", 8000, [("10.0.0.1", False), ("10.0.0.2", True)]))
        await seen.until(WorkerEndpoint(a1, ready=False), WorkerEndpoint(a2, ready=True), b)
        kube.delete("b")
        await seen.until(WorkerEndpoint(a1, ready=False), WorkerEndpoint(a2, ready=True))
        kube.put(endpoint_slice("a", 8000, [("10.0.0.2", True)]))  # leaves its slice
        await seen.until(WorkerEndpoint(a2, ready=True))
        await until_cancelled(task)
        deadline = time.monotonic() + 5  # cancelling stops the watch thread too
        while any(t.name == f"discovery-{NS}" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the watch thread outlived its discovery"
            await asyncio.sleep(0.01)
        return seen

    seen = asyncio.run(scenario())
    assert all(x != y for x, y in zip(seen.sets, seen.sets[1:], strict=False))  # changes only
    [listed] = kube.requests(kmock.action.LIST)  # one list, then one watch from its version
    [watched] = kube.requests(kmock.action.WATCH)
    for request in (listed, watched):
        assert request.namespace == NS
        assert request.params["labelSelector"] == (
            f"{COMPONENT_LABEL}={WORKER_COMPONENT},{SERVICE_LABEL}={SERVICE}")
    assert watched.params["allowWatchBookmarks"] == "true"
    assert "resourceVersion" in watched.params and "timeoutSeconds" in watched.params


def test_named_port_ipv6_and_role_labels(kube):
    extra = ({"name": "grpc", "port": 50051}, {"name": "metrics", "port": 9090})
    kube.put(endpoint_slice("v6", 8000, [("fd00::7", True)], address_type="IPv6",
                            role="prefill", other_ports=extra))
    kube.put(endpoint_slice("unnamed", 9000, [("10.0.0.9", True)], port_name="web"))
    kube.put(endpoint_slice("odd", 8000, [("10.0.0.5", True)], role="astrology"))

    async def scenario() -> None:
        seen = Reports()
        task = asyncio.create_task(discovery(kube).run(seen))
        await seen.until(WorkerEndpoint("http://[fd00::7]:8000", "prefill"),  # named port
                         WorkerEndpoint("http://10.0.0.9:9000", "both"),  # no "http": first
                         WorkerEndpoint("http://10.0.0.5:8000", "both"))  # unknown role
        await until_cancelled(task)

    asyncio.run(scenario())


def test_slice_edge_cases():
    assert slice_endpoints({"metadata": {"name": "x"}, "ports": [], "endpoints": [
        {"addresses": ["10.0.0.1"]}]}) == []  # no port: nothing to reach
    assert slice_endpoints({"ports": [{"name": "http", "port": 1}], "endpoints": None}) == []
    two = slice_endpoints({"ports": [{"name": "http", "port": 80}], "endpoints": [
        {"addresses": ["10.0.0.1", "10.0.0.2"], "conditions": {"ready": None}}]},
        scheme="https")
    assert two == [WorkerEndpoint("https://10.0.0.1:80"), WorkerEndpoint("https://10.0.0.2:80")]


def test_gone_relists_and_errors_back_off_keeping_the_last_set(kube):
    gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "code": 410,
                                        "status": "Failure", "reason": "Expired",
                                        "message": "too old resource version"}}

    def program(km: Any) -> None:
        km[kmock.action.WATCH][0:1] << (gone,)  # the first watch expires at once
        km[kmock.action.WATCH][1:2] << 500  # the next one fails: back off
    kube.on_server(program)
    kube.put(endpoint_slice("a", 8000, [("10.0.0.1", True)]))
    a = WorkerEndpoint("http://10.0.0.1:8000")

    async def scenario() -> Reports:
        seen = Reports()
        task = asyncio.create_task(discovery(kube).run(seen))
        await seen.until(a)
        deadline = time.monotonic() + 5
        while len(kube.requests(kmock.action.WATCH)) < 3:  # 410, 500, then a good one
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        kube.put(endpoint_slice("b", 8000, [("10.0.0.2", True)]))
        await seen.until(a, WorkerEndpoint("http://10.0.0.2:8000"))
        await until_cancelled(task)
        return seen

    seen = asyncio.run(scenario())
    assert all(seen.sets)  # never emptied by the failures
    assert len(kube.requests(kmock.action.LIST)) == 2  # the 410 re-listed; the 500 did not


def test_static_reports_its_list_once():
    async def scenario() -> Reports:
        seen = Reports()
        task = asyncio.create_task(StaticDiscovery(["http://a:1", "", "http://b:2"]).run(seen))
        await asyncio.sleep(0.05)
        await until_cancelled(task)
        return seen

    seen = asyncio.run(scenario())
    assert seen.sets == [{"http://a:1": WorkerEndpoint("http://a:1"),
                          "http://b:2": WorkerEndpoint("http://b:2")}]


def test_the_router_imports_kubernetes_only_to_discover_with_it():
    code = ("import sys\n"
            "import tandem.router.app, tandem.router.main, tandem.router.discovery\n"
            "assert 'kubernetes' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


def test_flags_and_yaml_choose_the_discovery(tmp_path, monkeypatch):
    _, _, server = build(_args("--workers", "http://a:1"))
    assert isinstance(server.discovery, StaticDiscovery)
    assert server.discovery.urls == ["http://a:1"]
    ns_file = tmp_path / "namespace"
    ns_file.write_text("from-the-pod\n")
    monkeypatch.setattr(k8s_discovery, "NAMESPACE_FILE", ns_file)
    _, _, server = build(_args("--discovery", "kubernetes", "--inference-service", "demo"))
    d = server.discovery
    assert isinstance(d, KubernetesDiscovery) and d.namespace == "from-the-pod"
    assert d.label_selector == f"{COMPONENT_LABEL}={WORKER_COMPONENT},{SERVICE_LABEL}=demo"
    assert d.port_name == "http"
    cfg = tmp_path / "router.yaml"
    cfg.write_text("discovery: kubernetes\nnamespace: serving\nlabel_selector: app=w\n"
                   "worker_port_name: api\n")
    _, _, server = build(_args("--config", str(cfg)))
    d = server.discovery
    assert (d.namespace, d.label_selector, d.port_name) == ("serving", "app=w", "api")
    _, _, server = build(_args("--config", str(cfg), "--namespace", "flag-wins"))
    assert server.discovery.namespace == "flag-wins"
    with pytest.raises(SystemExit, match="static"):
        build(_args("--discovery", "kubernetes", "--workers", "http://a:1"))
    monkeypatch.setattr(k8s_discovery, "NAMESPACE_FILE", tmp_path / "absent")
    _, _, server = build(_args("--discovery", "kubernetes"))
    assert server.discovery.namespace == "default"


def test_router_without_a_kubeconfig_fails_at_start(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    app, _, _ = build(_args("--discovery", "kubernetes", "--namespace", NS))

    async def start() -> None:
        async with app.app.router.lifespan_context(app.app):
            pass

    with pytest.raises(Exception, match="(?i)config"):
        asyncio.run(start())


def test_router_follows_worker_endpoint_slices(kube, tmp_path, monkeypatch):
    """A worker whose slice appears gets traffic; one that leaves its slice or turns not
    ready gets none (even though it still answers the router's own probe)."""
    seen: list = []
    stubs = [Served(stub_openai(f"stub{i}", seen)) for i in range(3)]
    ports = [s.port for s in stubs]

    def slice_for(i: int, ready: bool | None = True, present: bool = True) -> dict:
        return endpoint_slice(f"w{i}", ports[i], [("127.0.0.1", ready)] if present else [])

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{kube.url}'}}}}]\n"
        "users: [{name: test, user: {token: test-token}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: test}}]\n")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    kube.put(slice_for(0))
    app, _, _ = build(_args("--discovery", "kubernetes", "--namespace", NS,
                            "--inference-service", SERVICE, "--policy", "round-robin"))
    router = Served(app)

    def wait_ready(n: int) -> None:
        deadline = time.monotonic() + 5
        while httpx.get(router.url + "/ready", timeout=5).json()["ready_workers"] != n:
            assert time.monotonic() < deadline, f"never {n} ready worker(s)"
            time.sleep(0.02)

    def served_by(n: int = 6) -> set[str]:
        names = set()
        for i in range(n):
            r = httpx.post(router.url + "/v1/completions", timeout=10,
                           json={"model": "stub-model", "prompt": f"q{time.monotonic()}{i}"})
            assert r.status_code == 200, r.text
            names.add(r.json()["choices"][0]["text"])
        return names

    try:
        wait_ready(1)
        assert served_by() == {"stub0"}
        kube.put(slice_for(1))  # joins
        wait_ready(2)
        assert served_by() == {"stub0", "stub1"}
        kube.put(slice_for(2, ready=False))  # known, not ready
        kube.put(slice_for(0, present=False))  # leaves its slice
        wait_ready(1)
        time.sleep(1.2)  # past a probe interval: stub2 answers probes, stays out all the same
        assert served_by() == {"stub1"}
        kube.put(slice_for(2, ready=True))
        wait_ready(2)
        assert served_by() == {"stub1", "stub2"}
        kube.put(slice_for(1, ready=False))  # turns not ready
        wait_ready(1)
        assert served_by() == {"stub2"}
        kube.delete("w2")
        wait_ready(0)
        r = httpx.post(router.url + "/v1/completions", timeout=10,
                       json={"model": "stub-model", "prompt": "nobody"})
        assert r.status_code in (404, 503)
    finally:
        router.stop()
        for s in stubs:
            s.stop()
