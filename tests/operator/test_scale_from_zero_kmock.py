"""Scale from zero without KEDA, through the running operator (kopf against kmock's API
emulator, `test_operator_kmock`'s `Env`; an operator of its own, without Redis): pools in
`autoscaling.mode: operator` on `signal: demand` read the router's `GET /scaling`, played by
a real local HTTP server (`harness.FakeRouter`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import yaml

from tandem.operator.metrics import HttpScalingSource
from tandem.operator.reconcile import OperatorConfig
from tests.operator.harness import FakeMetrics, FakeRouter, operator_at, wait_for
from tests.operator.kube_emulator import FakeCluster
from tests.operator.samples import SHA
from tests.operator.test_operator_kmock import IMAGE, RESOURCES, Env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cluster = FakeCluster(RESOURCES, tmp_path_factory.mktemp("kube"))
    router, metrics = FakeRouter(), FakeMetrics()
    config = OperatorConfig(image=IMAGE, status_interval_s=0.3, autoscale_interval_s=0.2,
                            backoff_s=0.2, resync_interval_s=30.0, metrics=metrics,
                            scaling=HttpScalingSource(base=router.url))
    try:
        with operator_at(cluster.kubeconfig, config):
            yield Env(cluster, metrics, router)
    finally:
        cluster.stop()
        router.stop()


def test_operator_mode_scales_both_pd_roles_from_zero_and_back_on_the_routers_demand(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """P/D, both pools in the operator's own mode with minReplicas 0 (decode starting at 0),
    on the router's /scaling for their role (a real HTTP server answering for the router):
    no demand keeps decode at 0 while prefill scales on its own; demand wakes decode to
    ceil(demand / target) in one step; a /scaling that fails changes nothing, however long
    (no scale to zero on a read error, logged); demand gone → both at 0 only after the
    scale-down window. Replica history: decode 0, 3, 0; prefill 1, 2, 0."""
    zero = {"mode": "operator", "minReplicas": 0, "maxReplicas": 4, "target": 2,
            "scaleDownStabilizationSeconds": 1}
    spec = {"model": {"uri": "pvc://models/llama", "sha256": SHA, "name": "Acme/llama"},
            "prefill": {"replicas": 1, "autoscaling": dict(zero)},
            "decode": {"replicas": 0, "autoscaling": dict(zero)}}
    router, model = env.router, "Acme/llama"
    router.set(model, "decode", 0)
    router.set(model, "prefill", 3)
    env.create("zeta", spec)
    replicas = lambda pool: env.get("Deployment", f"zeta-{pool}")["spec"]["replicas"]  # noqa: E731
    roles = lambda: {(p, q["role"][0]) for _, p, q in router.requests  # noqa: E731
                     if q.get("model") == [model]}
    # the URL KEDA would read: the routers' metrics Service, the served name and the role
    wait_for(lambda: replicas("prefill") == 2 and roles() == {("/scaling", "decode"),
                                                              ("/scaling", "prefill")},
             timeout=30, interval=0.2, what="prefill scaled on its own demand")
    n = router.count()
    wait_for(lambda: router.count() >= n + 2, timeout=30, interval=0.2)  # decode read again
    assert replicas("decode") == 0  # no demand: it stays at zero
    router.set(model, "decode", 5)  # e.g. five held in the router's queue
    wait_for(lambda: replicas("decode") == 3, timeout=30, interval=0.2, what="decode woken")
    router.fail(503)  # the router unreadable: whatever the window, nothing changes
    router.set(model, "decode", 0)
    router.set(model, "prefill", 0)
    n, t_fail = router.count(), time.monotonic()
    wait_for(lambda: router.count() > n + 4 and time.monotonic() - t_fail > 1.5,
             timeout=30, interval=0.2)  # failed reads for longer than the window, both pools
    assert (replicas("decode"), replicas("prefill")) == (3, 2)
    assert any("/scaling unread" in r.getMessage() and "zeta-decode" in r.getMessage()
               for r in caplog.records)
    router.fail(None)
    busy = router.requests[-1][0]  # the last read that failed (or about to)
    wait_for(lambda: replicas("decode") == 0 and replicas("prefill") == 0, timeout=30,
             interval=0.2, what="both back to zero")
    assert time.monotonic() - busy >= 0.9, "scaled to zero inside the window"
    for pool, want in (("decode", [0, 3, 0]), ("prefill", [1, 2, 0])):
        counts = [v["spec"]["replicas"] for v in env.history("Deployment", f"zeta-{pool}")
                  if v]
        assert [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]] == want
    wait_for(lambda: env.status("zeta")["decode"]["desiredReplicas"] == 0
             and env.status("zeta")["prefill"]["desiredReplicas"] == 0, interval=0.2)
    cfg = yaml.safe_load(env.get("ConfigMap", "zeta-router-config")["data"]["router.yaml"])
    assert cfg["served_models"] == [{"name": model, "start_timeout_s": 300}]
