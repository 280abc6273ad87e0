"""One autoscaler tick on `signal: demand` (`reconcile.scale_pool`), without a cluster: the
router's answers for every served name of the model are combined (with no worker up the
router queues each name apart), a pool at zero wakes to ceil(demand / target), and a failed
read patches nothing and holds the scale-down window open."""

from __future__ import annotations

from typing import Any

from tandem.operator.metrics import Scaling, ScalingError
from tandem.operator.reconcile import PoolState, scale_pool
from tandem.operator.render import pools
from tandem.operator.render.keda import scaling_urls
from tandem.operator.spec import parse_spec
from tests.operator.manifests import OWNER

SPEC = parse_spec({"model": {"uri": "hf://Org/Model-7B@main"}, "decode": {
    "replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 8, "target": 2,
                                   "scaleDownStabilizationSeconds": 60}}})
BASE = "http://demo-metrics.ml.svc:9090/scaling"


class Kube:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    def patch(self, kind: str, namespace: str, name: str, body: dict[str, Any],
              manager: str) -> None:
        self.patches.append((kind, name, body))


class Answers:
    """A `ScalingSource`: URL -> answer, or ScalingError for a URL in `failing`."""

    def __init__(self, answers: dict[str, Scaling], failing: tuple[str, ...] = ()) -> None:
        self.answers, self.failing = answers, failing
        self.read_urls: list[str] = []

    def read(self, url: str) -> Scaling:
        self.read_urls.append(url)
        if url in self.failing:
            raise ScalingError(f"{url}: refused")
        return self.answers[url]


def tick(source: Answers, replicas: int, state: PoolState, now: float) -> Kube:
    kube = Kube()
    (pool,) = pools(SPEC)
    scale_pool(kube, None, OWNER, pool, {"kind": "Deployment", "spec": {"replicas": replicas}},
               state, now, scaling=source, urls=scaling_urls(SPEC, OWNER, pool.role))
    return kube


def test_every_served_name_is_read_and_an_alias_queue_wakes_the_pool():
    short, hub = f"{BASE}?model=Model-7B&role=decode", f"{BASE}?model=Org%2FModel-7B&role=decode"
    assert scaling_urls(SPEC, OWNER, "both") == [short, hub]
    source = Answers({short: Scaling(1.0, queued=1), hub: Scaling(4.0, queued=4)})
    kube = tick(source, 0, PoolState(), 1000.0)
    assert source.read_urls == [short, hub]
    assert kube.patches == [("Deployment", "demo-worker", {"spec": {"replicas": 3}})]


def test_a_failed_read_patches_nothing_and_holds_the_window():
    short, hub = f"{BASE}?model=Model-7B&role=decode", f"{BASE}?model=Org%2FModel-7B&role=decode"
    idle = {short: Scaling(0.0), hub: Scaling(0.0)}
    state = PoolState()
    assert tick(Answers(idle), 3, state, 1000.0).patches == []  # the window starts at 3
    assert tick(Answers(idle, failing=(hub,)), 3, state, 1050.0).patches == []
    assert state.history[-1] == (1050.0, 3)  # unread: counts as what runs
    # 61 s after the first tick but only 20 after the failed one: still held
    assert tick(Answers(idle), 3, state, 1070.0).patches == []
    kube = tick(Answers(idle), 3, state, 1111.0)  # a whole window of idle readings
    assert kube.patches == [("Deployment", "demo-worker", {"spec": {"replicas": 0}})]
