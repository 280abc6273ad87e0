"""Leader election (`tandem operator --leader-elect`, `tandem.operator.leader`) against the
emulated API server (`kube_emulator`: PUT with resourceVersion conflicts, every write logged
with the client's token).

* Electors under a seeded storm of partitions (requests dropped before or after the server
  applied them): never two leaders at any instant, and leadership does change hands.
* Three real `tandem operator --leader-elect` processes, one token each: only the leader
  writes; SIGKILL it and a standby leads within lease duration + retry period and reconciles
  a change; SIGTERM releases the Lease (the next takes over at once); a leader that cannot
  renew exits 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
from kubernetes.client import ApiClient, Configuration, CustomObjectsApi

from tandem.operator.leader import Elector, KubeLease, LeaseConfig, LeaseNotLeader
from tandem.serving.ports import free_port
from tests.operator.harness import wait_for
from tests.operator.kube_emulator import FakeCluster
from tests.operator.test_operator_kmock import RESOURCES

TANDEM = Path(sys.executable).with_name("tandem")
NS = "tandem-system"
LEASES = "coordination.k8s.io/v1/leases"
WITH_LEASES = {**RESOURCES, LEASES: dict(kind="Lease", namespaced=True,
                                         verbs={"get", "create", "update", "patch"})}


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[FakeCluster]:
    c = FakeCluster(WITH_LEASES, tmp_path)
    yield c
    c.stop()


def test_lease_config_checks_its_timings() -> None:
    LeaseConfig("l", NS, "me", 15, 10.0, 2.0)
    for bad in ((10, 10.0, 2.0), (15, 2.0, 2.0), (15, 10.0, 0.0)):
        with pytest.raises(ValueError, match="lease duration > renew deadline"):
            LeaseConfig("l", NS, "me", *bad)


class Flaky(KubeLease):
    """A KubeLease whose requests fail while `down`: dropped before reaching the server, or
    (`after`) after the server applied them, the answer lost."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.down, self.after = False, False

    def _guard(self, call: Any, *args: Any) -> Any:
        if self.down and not self.after:
            raise OSError("partitioned")
        out = call(*args)
        if self.down:
            raise OSError("answer lost")
        return out

    def get(self) -> dict[str, Any] | None:
        return self._guard(super().get)

    def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return self._guard(super().create, body)

    def replace(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return self._guard(super().replace, body)


@pytest.mark.parametrize("seed", [1, 2])
def test_no_two_leaders_under_random_partitions(cluster: FakeCluster, seed: int) -> None:
    """Three electors (1 s lease, 0.6 s renew deadline, 0.15 s retry), each partitioned at
    random for up to twice the lease duration: sampled every few milliseconds, at most one
    says it leads (`leading()`, the fence of its writes); the lease changes hands several
    times; once healed, one leader holds it."""
    rng = random.Random(seed)
    electors = []
    for i in range(3):
        cfg = LeaseConfig("tandem-operator", NS, f"op{i}", 1, 0.6, 0.15)
        api = ApiClient(Configuration(host=cluster.url))
        electors.append(Elector(Flaky(api, cfg)))

    async def candidate(e: Elector, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if await e.acquire(stop):
                await e.keep(stop)

    async def storm() -> tuple[int, set[str]]:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(candidate(e, stop)) for e in electors]
        overlaps, leaders, deadline = 0, set(), time.monotonic() + 8
        next_fault = time.monotonic()
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_fault:
                for e in electors:
                    e.lease.down = rng.random() < 0.4
                    e.lease.after = rng.random() < 0.5
                next_fault = now + rng.uniform(0.1, 2.0)
            leading = [e.config.identity for e in electors if e.leading()]
            overlaps += len(leading) > 1
            leaders.update(leading)
            await asyncio.sleep(0.003)

        async def sample_until(done: Any, timeout: float) -> bool:
            nonlocal overlaps
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                leading = [e.config.identity for e in electors if e.leading()]
                overlaps += len(leading) > 1
                leaders.update(leading)
                if done():
                    return True
                await asyncio.sleep(0.003)
            return False

        for e in electors:
            e.lease.down = False
        healed = await sample_until(lambda: sum(e.leading() for e in electors) == 1, 10.0)
        # then, whatever the storm did on this machine's timing, cut the leader off: the
        # lease must change hands (liveness), still never with two leaders (safety)
        moved = False
        if healed:
            (cut,) = [e for e in electors if e.leading()]
            cut.lease.down = True
            moved = await sample_until(
                lambda: any(e.leading() for e in electors if e is not cut), 10.0)
            cut.lease.down = False
            healed = await sample_until(lambda: sum(e.leading() for e in electors) == 1, 10.0)
        stop.set()
        await asyncio.gather(*tasks)
        assert healed, "no single leader after the partitions healed"
        assert moved, "a partitioned leader's lease was never taken over"
        return overlaps, leaders

    overlaps, leaders = asyncio.run(storm())
    assert overlaps == 0, f"{overlaps} samples with two leaders"
    assert len(leaders) >= 2, f"leadership never changed hands: {leaders}"
    holders = [(v or {}).get("spec", {}).get("holderIdentity")
               for v in cluster.history(LEASES, NS, "tandem-operator")]
    changes = sum(1 for a, b in zip(holders, holders[1:], strict=False) if a != b)
    assert changes >= len(leaders) - 1 >= 1, holders  # the Lease says so too


async def wait_async(fn: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        await asyncio.sleep(0.02)
    return False


def test_the_fence_refuses_writes_once_the_deadline_passed(cluster: FakeCluster) -> None:
    clock = [100.0]
    cfg = LeaseConfig("fence", NS, "op0", 3, 2.0, 0.5)
    e = Elector(KubeLease(ApiClient(Configuration(host=cluster.url)), cfg),
                clock=lambda: clock[0])
    with pytest.raises(LeaseNotLeader):
        e.fence()
    assert e._attempt()
    e.fence()  # leading
    clock[0] += 1.99
    e.fence()
    clock[0] += 0.02
    with pytest.raises(LeaseNotLeader, match="op0 does not hold the lease"):
        e.fence()


# ---- real processes ------------------------------------------------------------------------

LEASE_S, DEADLINE_S, RETRY_S = 2, 1.2, 0.3
TAKEOVER_BOUND_S = LEASE_S + RETRY_S * 1.2 + 2.0  # + kopf's start and the test's polling


class Operator:
    def __init__(self, cluster: FakeCluster, token: str) -> None:
        self.token, self.port = token, free_port()
        self.log = cluster.kubeconfig.with_name(f"{token}.log")
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig_as(token)),
               "TANDEM_OPERATOR_NAMESPACE": NS, "TANDEM_IMAGE": "registry.example/tandem:ha"}
        self.proc = subprocess.Popen(
            [str(TANDEM), "operator", "--standalone", "--all-namespaces", "--leader-elect",
             "--lease-duration", str(LEASE_S), "--renew-deadline", str(DEADLINE_S),
             "--retry-period", str(RETRY_S), "--status-interval", "0.5",
             f"--liveness=http://127.0.0.1:{self.port}/healthz"], env=env,
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def health(self) -> dict[str, Any]:
        with urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as resp:
            return json.load(resp)

    def leading(self) -> bool:
        try:
            return self.health()["leader"]
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self.log.read_text()


def child_writes(cluster: FakeCluster, since: float = 0.0) -> dict[str, list[float]]:
    """Successful writes of anything but the Lease, by operator token, after `since` (the
    test's own client, playing kubectl, sends none)."""
    out: dict[str, list[float]] = {}
    for w in cluster.writes():
        if w.auth and w.plural != "leases" and w.status < 300 and w.at >= since:
            out.setdefault(w.auth.removeprefix("Bearer "), []).append(w.at)
    return out


def lease_writes(cluster: FakeCluster) -> dict[str, list[float]]:
    """Successful writes of the Lease, by operator token."""
    out: dict[str, list[float]] = {}
    for w in cluster.writes():
        if w.auth and w.plural == "leases" and w.status < 300:
            out.setdefault(w.auth.removeprefix("Bearer "), []).append(w.at)
    return out


def test_one_writer_failover_on_kill_release_on_term(cluster: FakeCluster) -> None:
    ops = [Operator(cluster, f"op{i}") for i in range(3)]
    try:
        wait_for(lambda: all(o.health()["ok"] for o in ops), timeout=60, what="three /healthz",
                 errors=(OSError,))
        first = wait_for(lambda: [o for o in ops if o.leading()], timeout=30)
        assert len(first) == 1
        leader = first[0]
        api = CustomObjectsApi(ApiClient(Configuration(host=cluster.url)))
        api.create_namespaced_custom_object(
            "tandem.dev", "v1alpha1", "ml", "inferenceservices",
            {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "ha", "namespace": "ml"},
             "spec": {"model": {"uri": "SmolLM2-135M-Instruct"}, "decode": {"replicas": 1}}})
        wait_for(lambda: cluster.history("apps/v1/deployments", "ml", "ha-worker"),
                 timeout=30, what="the worker Deployment")
        time.sleep(1.0)  # a few status ticks
        assert set(child_writes(cluster)) == {leader.token}  # the standbys wrote nothing

        # SIGKILL: no release; a standby takes over once the lease expires
        killed = time.monotonic()
        leader.proc.kill()
        leader.proc.wait(10)
        second = wait_for(lambda: [o for o in ops if o is not leader and o.leading()],
                          timeout=3 * TAKEOVER_BOUND_S, interval=0.05)
        took = time.monotonic() - killed
        assert len(second) == 1 and took <= TAKEOVER_BOUND_S, took
        new = second[0]
        api.patch_namespaced_custom_object("tandem.dev", "v1alpha1", "ml", "inferenceservices",
                                           "ha", {"spec": {"decode": {"replicas": 3}}})
        wait_for(lambda: cluster.history("apps/v1/deployments", "ml", "ha-worker")[-1][
            "spec"]["replicas"] == 3, timeout=30, what="the new leader's reconcile")
        after = child_writes(cluster, since=killed)
        assert set(after) == {new.token}, after
        assert max(child_writes(cluster)[leader.token]) < killed

        # SIGTERM: the leader stops, releases the lease, exits 0; the last one leads at once
        third = next(o for o in ops if o not in (leader, new))
        termed = time.monotonic()
        code, out = new.stop()
        assert code == 0, out[-3000:]
        wait_for(third.leading, timeout=10, interval=0.05)
        # released, not expired: the third took it soon after the leader's last Lease write
        # (its release), measured on the emulator's clock, not counting the process's exit
        released = max(lease_writes(cluster)[new.token])
        taken = min(t for t in lease_writes(cluster)[third.token] if t > released)
        assert released >= termed and taken - released < LEASE_S, (
            "waited for expiry: not released", taken - released)
        assert set(child_writes(cluster, since=time.monotonic())) <= {third.token}

        # a leader that cannot renew stops within its deadline and exits 1
        cluster.set_faults(leases=503)
        code, out = third.proc.wait(timeout=DEADLINE_S + 10), third.log.read_text()
        assert code == 1, out[-3000:]
        assert "leadership lost" in out
    finally:
        cluster.set_faults()
        for o in ops:
            o.stop(signal.SIGKILL)
