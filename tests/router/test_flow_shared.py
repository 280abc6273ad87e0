"""Fleet-wide flow control through a real redis-server: two `QueueFlowControl` replicas
sharing one `RedisLedger` state take turns fairly even when each holds only one tenant, a
band's bound holds across both, a replica that dies leaks nothing once its lease is over,
and a replica whose Redis goes away queues on its own, then shares again when it is back."""

from __future__ import annotations

import asyncio
import subprocess
import uuid

from tandem.router.flowcontrol.base import REASON_HEADER
from tandem.router.flowcontrol.local import QueueFlowControl
from tandem.router.flowcontrol.settings import BandLimits, FlowSettings
from tandem.router.flowcontrol.shared import RedisLedger
from tandem.router.metrics import RouterMetrics
from tests.conftest import start_redis
from tests.router.flow_fakes import Clock, Slots, req, settle
from tests.router.test_flow_queue import Client


def replica(url: str, prefix: str, slots: Slots, clock: Clock | None = None,
            **settings) -> QueueFlowControl:
    ledger = RedisLedger(url, prefix=prefix, timeout_s=2.0, lease_s=1.0, heartbeat_s=0.2)
    return QueueFlowControl(FlowSettings(enabled=True, shared=True, **settings), slots,
                            shared=ledger, clock=clock or Clock(), autostart=False)


async def pass_of(*replicas: QueueFlowControl) -> None:
    """A dispatch pass on each replica in turn, with time for their Redis round trips."""
    for fc in replicas:
        await asyncio.sleep(0.05)
        await settle(fc)
        await asyncio.sleep(0.05)


def test_two_replicas_take_turns_though_each_holds_one_tenant(redis_url):
    async def go(shared: bool) -> list[str]:
        slots, prefix = Slots(m=1), f"t{uuid.uuid4().hex[:8]}:"
        if shared:
            r1, r2 = replica(redis_url, prefix, slots), replica(redis_url, prefix, slots)
        else:
            r1 = QueueFlowControl(FlowSettings(enabled=True), slots, clock=Clock(),
                                  autostart=False)
            r2 = QueueFlowControl(FlowSettings(enabled=True), slots, clock=Clock(),
                                  autostart=False)
        c1, c2 = Client(r1, slots), Client(r2, slots)
        c1.send(req("busy", tenant="x"))
        await pass_of(r1)
        for i in range(4):
            c1.send(req(f"a{i}", tenant="a"))
        for i in range(2):
            c2.send(req(f"b{i}", tenant="b"))
        await pass_of(r1, r2)
        order: list[str] = []
        prev, owner = "busy", c1
        for _ in range(6):
            owner.finish(prev)
            await pass_of(r1, r2)  # replica 1 always looks first
            got = [(c, rid) for c in (c1, c2) for rid in c.tickets]
            assert len(got) == 1, got
            owner, prev = got[0]
            order.append(prev)
        for fc in (r1, r2):
            await fc.close()
        return order

    assert asyncio.run(go(False)) == ["a0", "a1", "a2", "a3", "b0", "b1"]  # each on its own
    assert asyncio.run(go(True)) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_a_band_bound_holds_across_replicas_and_a_dead_replica_leaks_nothing(redis_url):
    async def go() -> None:
        slots, prefix = Slots(m=0), f"t{uuid.uuid4().hex[:8]}:"
        bound = {"default_band": BandLimits(max_requests=3, max_bytes=1 << 20)}
        r1, r2 = replica(redis_url, prefix, slots, **bound), replica(redis_url, prefix,
                                                                     slots, **bound)
        c1, c2 = Client(r1, slots), Client(r2, slots)
        for c, fc, rid in ((c1, r1, "a0"), (c1, r1, "a1"), (c2, r2, "b0"), (c2, r2, "b1")):
            c.send(req(rid))  # b1: the fleet's fourth
            await pass_of(fc)
        err = c2.errors["b1"]
        assert err.status == 429 and err.headers[REASON_HEADER] == "band-full"
        assert r1.queued("m") == 2 and r2.queued("m") == 1, (c1.errors, c2.errors)
        # replica 1 dies: no close, no heartbeat; its lease (1 s) runs out
        assert r1.shared is not None and r1.shared._beat is not None
        r1.shared._beat.cancel()
        c2.send(req("b2"))
        await pass_of(r2)
        assert c2.errors["b2"].headers[REASON_HEADER] == "band-full"
        await asyncio.sleep(1.3)
        c2.send(req("b3"))
        c2.send(req("b4"))
        await pass_of(r2)
        assert "b3" not in c2.errors and "b4" not in c2.errors and r2.queued("m") == 3
        await r2.close()
        await r1.close()  # its Redis client, left open, would be finalized in a later test

    asyncio.run(go())


def test_redis_gone_means_local_decisions_then_shared_again(tmp_path):
    proc, url, port = start_redis(tmp_path)

    async def go() -> None:
        nonlocal proc
        slots, prefix = Slots(m=0), f"t{uuid.uuid4().hex[:8]}:"
        bound = {"default_band": BandLimits(max_requests=2, max_bytes=1 << 20)}
        r1, r2 = replica(url, prefix, slots, **bound), replica(url, prefix, slots, **bound)
        metrics = RouterMetrics()
        r1.bind_metrics(metrics)
        assert r1.shared is not None
        r1.shared.timeout_s = r1.shared.retry_after_s = 0.3
        c1, c2 = Client(r1, slots), Client(r2, slots)
        for rid in ("b0", "b1"):
            c2.send(req(rid))
            await pass_of(r2)
        c1.send(req("a0"))  # the fleet's band is full
        await pass_of(r1)
        assert c1.errors["a0"].headers[REASON_HEADER] == "band-full"
        proc.kill()
        proc.wait()
        for rid in ("a1", "a2", "a3"):  # Redis is gone: replica 1's own bound (2) decides
            c1.send(req(rid))
            await pass_of(r1)
        assert r1.queued("m") == 2 and c1.errors["a3"].headers[REASON_HEADER] == "band-full"
        assert metrics.flow_shared._value.get() == 0
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--dir", str(tmp_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):  # its heartbeat finds Redis again and rewrites its counts
            await asyncio.sleep(0.1)
            if not r1.shared.down and r2.shared is not None and not r2.shared.down:
                break
        assert metrics.flow_shared._value.get() == 1
        await asyncio.sleep(0.5)  # both heartbeats: 2 + 2 queued, fleet-wide
        c1.send(req("a4"))
        await pass_of(r1)
        assert c1.errors["a4"].headers[REASON_HEADER] == "band-full"
        for fc in (r1, r2):
            await fc.close()

    try:
        asyncio.run(go())
    finally:
        proc.kill()
        proc.wait()
