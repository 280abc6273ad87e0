"""InferenceObjectives from the cluster (`router.discovery.objectives`): the real `kubernetes`
client lists and watches them in kmock's API emulator (each object valid against the vendored
published CRD); the endpoint picker's band follows a watched objective over the static
router.yaml `objectives`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import kmock
import pytest
from kubernetes.client import CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from tandem.router.discovery import objectives as obj_mod
from tandem.router.discovery.objectives import (
    GROUP,
    PLURAL,
    VERSION,
    ObjectiveWatch,
    pool_priority,
)
from tandem.router.extproc.settings import ExtProcSettings
from tests.operator.crd_validate import validate
from tests.router.extproc_client import EppRouter, FlowDouble
from tests.router.stub_worker import StubWorker
from tests.router.test_discovery import NS, FakeKube, until_cancelled
from tests.serving.helpers import free_port

POOL = "chat"
RESOURCE = f"{GROUP}/{VERSION}/{PLURAL}"


class ObjectiveKube(FakeKube):
    """kmock serving InferenceObjectives (and, as FakeKube, EndpointSlices)."""

    async def _serve(self, started) -> None:  # noqa: ANN001
        async with kmock.KubernetesEmulator() as km, kmock.Server(km) as server:
            self.km, self.url = km, str(server.url).rstrip("/")
            self.loop, self._done = asyncio.get_running_loop(), asyncio.Event()
            km.resources["discovery.k8s.io/v1/endpointslices"] = {}
            km.resources[RESOURCE] = dict(kind="InferenceObjective", namespaced=True)
            started.set()
            await self._done.wait()

    def put_objective(self, name: str, pool: str = POOL, priority: int | None = None) -> None:
        spec: dict[str, Any] = {"poolRef": {"name": pool}}
        if priority is not None:
            spec["priority"] = priority
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceObjective",
                "metadata": {"name": name, "namespace": NS}, "spec": spec}
        validate(body)  # as the API server would admit it
        api = CustomObjectsApi(self.client())
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
        except ApiException as exc:
            assert exc.status == 409, exc
            api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, body)

    def delete_objective(self, name: str) -> None:
        CustomObjectsApi(self.client()).delete_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, name)


@pytest.fixture()
def kube():
    k = ObjectiveKube()
    yield k
    k.stop()


class Maps:
    def __init__(self) -> None:
        self.maps: list[dict[str, int]] = []

    def __call__(self, m: dict[str, int]) -> None:
        self.maps.append(m)

    async def until(self, want: dict[str, int], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.maps or self.maps[-1] != want:
            assert time.monotonic() < deadline, f"got {self.maps[-1:]}, want {want}"
            await asyncio.sleep(0.01)


def watch(kube: FakeKube) -> ObjectiveWatch:
    return ObjectiveWatch(NS, POOL, api_client=kube.client(), backoff_min_s=0.05,
                          backoff_max_s=0.2)


def test_list_add_modify_delete_and_other_pools_ignored(kube):
    kube.put_objective("critical", priority=10)
    kube.put_objective("theirs", pool="other", priority=99)

    async def scenario() -> Maps:
        seen = Maps()
        task = asyncio.create_task(watch(kube).run(seen))
        await seen.until({"critical": 10})  # listed; another pool's ignored
        kube.put_objective("batch")  # no priority: 0, as the reference reads it
        await seen.until({"critical": 10, "batch": 0})
        kube.put_objective("batch", priority=-5)
        await seen.until({"critical": 10, "batch": -5})
        kube.put_objective("critical", pool="other", priority=10)  # moved away: dropped
        await seen.until({"batch": -5})
        kube.put_objective("theirs", pool="other", priority=1)  # no change for this pool
        kube.delete_objective("batch")
        await seen.until({})
        await until_cancelled(task)
        return seen

    seen = asyncio.run(scenario())
    assert seen.maps == [{"critical": 10}, {"critical": 10, "batch": 0},
                         {"critical": 10, "batch": -5}, {"batch": -5}, {}]


def test_gone_relists_and_errors_back_off_keeping_the_last_map(kube):
    gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "code": 410,
                                        "status": "Failure", "reason": "Expired",
                                        "message": "too old resource version"}}

    def program(km: Any) -> None:
        km[kmock.action.WATCH][0:1] << (gone,)
        km[kmock.action.WATCH][1:2] << 500
    kube.on_server(program)
    kube.put_objective("a", priority=1)

    async def scenario() -> Maps:
        seen = Maps()
        task = asyncio.create_task(watch(kube).run(seen))
        await seen.until({"a": 1})
        deadline = time.monotonic() + 5
        while len(kube.requests(kmock.action.WATCH)) < 3:  # 410, 500, then a good one
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        kube.put_objective("b", priority=2)
        await seen.until({"a": 1, "b": 2})
        await until_cancelled(task)
        return seen

    seen = asyncio.run(scenario())
    assert all(seen.maps)  # never emptied by the failures
    assert len(kube.requests(kmock.action.LIST)) == 2  # the 410 re-listed; the 500 did not


def test_what_is_held_is_bounded(monkeypatch):
    assert pool_priority({"spec": {"poolRef": {"name": POOL}}}, POOL) == 0
    assert pool_priority({"spec": {"poolRef": {"name": POOL}, "priority": None}}, POOL) == 0
    assert pool_priority({"spec": {"poolRef": {"name": POOL, "kind": "Service"}}}, POOL) is None
    assert pool_priority({"spec": {"poolRef": {"name": POOL, "group": "x.io"}}}, POOL) is None
    assert pool_priority({"spec": {"poolRef": {"name": POOL}, "priority": 1 << 31}}, POOL) \
        is None
    assert pool_priority({"spec": {}}, POOL) is None
    monkeypatch.setattr(obj_mod, "MAX_OBJECTIVES", 3)
    assert obj_mod.bounded({n: i for i, n in enumerate("edcba")}) == {"a": 4, "b": 3, "c": 2}
    w = ObjectiveWatch(NS, POOL)
    assert w._entry({"metadata": {"name": "x" * 254}, "spec": {"poolRef": {"name": POOL}}}
                    )[1] is None


def test_the_pickers_band_follows_a_watched_objective(kube):
    worker = StubWorker(free_port())
    flow = FlowDouble(shed=True)
    kube.put_objective("critical", priority=7)
    ext = ExtProcSettings(port=0, host="127.0.0.1", objectives={"critical": 1, "static": 3},
                          inference_pool=POOL, watch=watch(kube))
    r = EppRouter([worker.url], ext=ext, flow_control=flow)
    header = "x-gateway-inference-objective"

    def band_of(objective: str) -> int:
        r.envoy.request("/v1/completions", b'{"model": "stub-model", "prompt": "x"}',
                        headers={header: objective})
        return flow.seen[-1].band

    def until(objective: str, want: int) -> None:
        deadline = time.monotonic() + 5
        while (got := band_of(objective)) != want:
            assert time.monotonic() < deadline, f"{objective}: band {got}, want {want}"
            time.sleep(0.05)

    try:
        r.wait_routable(1)
        until("critical", 7)  # the watched priority wins over router.yaml's 1
        assert band_of("static") == 3  # a static entry the cluster does not name still counts
        assert r.metric("tandem_router_extproc_objectives") == 1
        kube.put_objective("critical", priority=-2)
        until("critical", -2)
        kube.put_objective("static", priority=9)
        until("static", 9)
        kube.delete_objective("critical")
        until("critical", 1)  # gone from the cluster: router.yaml's again
        assert r.metric("tandem_router_extproc_objectives") == 1
    finally:
        r.stop()
        worker.stop()


def test_the_flag_and_router_yaml_name_the_pool():
    import argparse

    from tandem.router.config import RouterConfigError, check_config
    from tandem.router.main import add_router_args, ext_proc_settings

    p = argparse.ArgumentParser()
    add_router_args(p)
    got = ext_proc_settings(p.parse_args(
        ["--ext-proc-port", "9002", "--discovery", "kubernetes", "--namespace", "ns1",
         "--inference-pool", "chat"]), {})
    assert got.inference_pool == "chat" and got.watch.pool == "chat"
    assert got.watch.namespace == "ns1"
    cfg = check_config({"ext_proc_port": 9002, "discovery": "kubernetes", "namespace": "n2",
                        "inference_pool": "pool-a"})
    got = ext_proc_settings(p.parse_args([]), cfg)
    assert (got.watch.namespace, got.watch.pool) == ("n2", "pool-a")
    assert ext_proc_settings(p.parse_args(["--ext-proc-port", "9002"]), {}).watch is None
    for argv, message in ((["--inference-pool", "chat"], "need --ext-proc-port"),
                          (["--ext-proc-port", "9002", "--inference-pool", "chat"],
                           "needs --discovery kubernetes"),
                          (["--ext-proc-port", "9002", "--discovery", "kubernetes",
                            "--inference-pool", "Not_A_Name"], "not a Kubernetes object name")):
        with pytest.raises(SystemExit, match=message):
            ext_proc_settings(p.parse_args(argv), {})
    with pytest.raises(RouterConfigError, match="inference_pool"):
        check_config({"inference_pool": "x" * 254})


def test_random_event_traces_leave_exactly_this_pools_objectives():
    """Seeded random traces of watch events (adds, changes, moves between pools, deletes,
    bookmarks, no priority) applied one by one hold exactly what a fresh list would."""
    import random

    for seed in range(2000):
        rng = random.Random(seed)
        cluster: dict[str, dict] = {}  # name -> the object as the API server holds it
        held: dict[str, int] = {}
        for _ in range(rng.randrange(1, 30)):
            name = f"o{rng.randrange(6)}"
            kind = rng.choice(["ADDED", "MODIFIED", "DELETED", "BOOKMARK"])
            if kind == "DELETED":
                if name not in cluster:
                    continue
                obj = cluster.pop(name)
            elif kind == "BOOKMARK":
                obj = {"metadata": {"resourceVersion": str(seed)}}
            else:
                if (kind == "ADDED") == (name in cluster):
                    kind = "MODIFIED" if name in cluster else "ADDED"
                spec: dict[str, Any] = {"poolRef": {"name": rng.choice([POOL, "other"])}}
                if rng.random() < 0.8:
                    spec["priority"] = rng.randrange(-20, 20)
                obj = cluster[name] = {"metadata": {"name": name}, "spec": spec}
            obj_mod.apply(held, kind, obj, POOL)
        fresh = {n: p for n, o in cluster.items()
                 if (p := pool_priority(o, POOL)) is not None}
        assert held == fresh, seed


def test_the_watch_imports_kubernetes_only_when_it_runs():
    import subprocess
    import sys

    code = ("import sys\n"
            "import tandem.router.discovery.objectives, tandem.router.extproc.settings\n"
            "from tandem.router.discovery.objectives import ObjectiveWatch\n"
            "ObjectiveWatch('ns', 'pool')\n"
            "assert 'kubernetes' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
