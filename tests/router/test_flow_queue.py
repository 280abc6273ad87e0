"""Flow control's queue (`QueueFlowControl`) on one replica, pass by pass: through at once
while a worker has room, queued while all are saturated, priority bands strictly first,
fairness between tenants, FCFS / EDF within a flow, bounds, TTL, deadlines, cancellation,
scale from zero, shutdown; the routing core's `capacity`."""

from __future__ import annotations

import asyncio

import pytest

from tandem.protocol.web import APIError
from tandem.router.core import Router, RouterSettings
from tandem.router.flowcontrol.base import REASON_HEADER, ModelCapacity
from tandem.router.flowcontrol.settings import BandLimits
from tandem.router.workers import Worker, WorkerLoad
from tests.router.flow_fakes import Clock, Slots, make, req, settle


class Client:
    """Requests as tasks: `order` is the order in which they got through."""

    def __init__(self, fc, slots: Slots) -> None:
        self.fc, self.slots = fc, slots
        self.order: list[str] = []
        self.tickets: dict[str, object] = {}
        self.errors: dict[str, APIError] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def send(self, r) -> None:
        async def run() -> None:
            try:
                ticket = await self.fc.acquire(r)
            except APIError as exc:
                self.errors[r.request_id] = exc
                return
            self.order.append(r.request_id)
            self.tickets[r.request_id] = (ticket, r.model)
            self.slots.in_use[r.model] = self.slots.in_use.get(r.model, 0) + 1

        self.tasks[r.request_id] = asyncio.ensure_future(run())

    def finish(self, rid: str, used: int | None = None) -> None:
        ticket, model = self.tickets.pop(rid)
        self.slots.in_use[model] -= 1
        ticket.release(used)


def run(coro):
    return asyncio.run(coro)


def test_through_at_once_with_room_then_queued_and_released_one_by_one_in_order():
    async def go() -> None:
        slots = Slots(m=2)
        fc = make(slots)
        c = Client(fc, slots)
        for i in range(5):
            c.send(req(f"r{i}"))
        await settle(fc)
        assert c.order == ["r0", "r1"]
        assert fc.queued("m") == 3
        c.finish("r0")
        await settle(fc)
        assert c.order == ["r0", "r1", "r2"]
        c.finish("r1")
        c.finish("r2")
        await settle(fc, 3)
        assert c.order == ["r0", "r1", "r2", "r3", "r4"]
        assert fc.queued("m") == 0 and fc.outstanding == 2
        assert fc.stats["dispatched"] == 5

    run(go())


def test_a_higher_band_goes_first_and_a_newcomer_never_overtakes_its_band():
    async def go() -> None:
        slots = Slots(m=1)
        fc = make(slots)
        c = Client(fc, slots)
        c.send(req("busy"))
        await settle(fc)
        c.send(req("low1", band=-1))
        c.send(req("mid", band=0))
        c.send(req("high", band=5))
        c.send(req("low2", band=-1))
        await settle(fc)
        for done in ("busy", "high", "mid", "low1"):
            c.finish(done)
            await settle(fc)
        assert c.order == ["busy", "high", "mid", "low1", "low2"]

    run(go())


def test_queued_by_band_counts_each_band_of_the_model_and_every_configured_band():
    """Per band, per model (another model's queue apart); the bands router.yaml bounds are
    always there (0 when empty, so a KEDA trigger on one finds it), others only non-empty."""
    async def go() -> None:
        slots = Slots(m=1, other=1)
        fc = make(slots, bands={3: BandLimits(), -2: BandLimits()})
        c = Client(fc, slots)
        assert fc.queued_by_band("m") == {3: 0, -2: 0}
        c.send(req("busy"))
        c.send(req("busy-other", model="other"))
        await settle(fc)
        for rid, band in (("a", 0), ("b", 5), ("c", 5), ("d", -1)):
            c.send(req(rid, band=band, tenant=rid))
        c.send(req("o", model="other", band=7))
        await settle(fc)
        assert fc.queued_by_band("m") == {3: 0, -2: 0, 0: 1, 5: 2, -1: 1}
        assert sum(fc.queued_by_band("m").values()) == fc.queued("m") == 4
        assert fc.queued_by_band("other") == {3: 0, -2: 0, 7: 1}
        c.finish("busy")
        await settle(fc)  # band 5 first: one of its two out
        assert fc.queued_by_band("m") == {3: 0, -2: 0, 0: 1, 5: 1, -1: 1}
        assert fc.queued_by_band("nobody") == {3: 0, -2: 0}

    run(go())


@pytest.mark.parametrize("fairness", ["round-robin", "least-attained"])
def test_a_heavy_tenant_does_not_starve_a_light_one(fairness):
    async def go() -> list[str]:
        slots = Slots(m=1)
        fc = make(slots, fairness=fairness)
        c = Client(fc, slots)
        c.send(req("busy", tenant="x"))
        await settle(fc)
        for i in range(6):
            c.send(req(f"a{i}", tenant="a"))
        for i in range(2):
            c.send(req(f"b{i}", tenant="b"))
        await settle(fc)
        prev = "busy"
        for _ in range(8):
            c.finish(prev)
            await settle(fc)
            prev = c.order[-1]
        return c.order[1:]

    assert run(go()) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_least_attained_charges_the_tokens_used_and_weights_divide_them():
    async def go() -> None:
        slots = Slots(m=1)
        fc = make(slots, fairness="least-attained", tenant_weights={"gold": 4.0})
        c = Client(fc, slots)
        c.send(req("busy", tenant="x"))
        await settle(fc)
        for i in range(5):
            c.send(req(f"g{i}", tenant="gold", cost=200))
            c.send(req(f"s{i}", tenant="std", cost=200))
        await settle(fc)
        prev = "busy"
        for _ in range(6):
            c.finish(prev, used=100)  # charged 200 up front, settled to the 100 used
            await settle(fc)
            prev = c.order[-1]
        # gold pays 100 / 4 per request, std 100: gold gets four for each of std's (a tie
        # goes to the tenant served longest ago)
        assert c.order[1:] == ["g0", "s0", "g1", "g2", "g3", "s1"]
        vt = fc.ledger.attained(0, "m")  # s1 is charged, not yet settled
        assert vt["gold"] == pytest.approx(100.0) and vt["std"] == pytest.approx(300.0)

    run(go())


def test_edf_serves_the_earliest_deadline_first_and_fcfs_arrival():
    async def go(ordering: str) -> list[str]:
        slots, clock = Slots(m=1), Clock()
        fc = make(slots, clock, ordering=ordering)
        c = Client(fc, slots)
        c.send(req("busy"))
        await settle(fc)
        c.send(req("none"))
        c.send(req("late", deadline=clock.t + 20))
        c.send(req("soon", deadline=clock.t + 5))
        await settle(fc)
        prev = "busy"
        for _ in range(3):
            c.finish(prev)
            await settle(fc)
            prev = c.order[-1]
        return c.order[1:]

    assert run(go("edf")) == ["soon", "late", "none"]
    assert run(go("fcfs")) == ["none", "late", "soon"]


def test_a_full_band_sheds_the_newcomer_with_429_and_other_bands_still_queue():
    async def go() -> None:
        slots = Slots(m=1)
        fc = make(slots, default_band=BandLimits(max_requests=2, max_bytes=250),
                  bands={3: BandLimits(max_requests=1, max_bytes=10_000)})
        c = Client(fc, slots)
        c.send(req("busy"))
        await settle(fc)
        c.send(req("q1"))
        c.send(req("q2"))
        c.send(req("over"))  # a third request
        c.send(req("h1", band=3, size=5000))
        c.send(req("h2", band=3))
        await settle(fc)
        for rid in ("over", "h2"):
            err = c.errors[rid]
            assert err.status == 429 and err.headers[REASON_HEADER] == "band-full"
            assert err.headers["Retry-After"] == "1"
        assert fc.queued("m") == 3
        c.finish("busy")
        await settle(fc)
        c.send(req("big", size=200))  # 100 + 200 bytes > 250
        await settle(fc)
        assert c.errors["big"].headers[REASON_HEADER] == "band-full"
        assert fc.stats["shed:band-full"] == 3

    run(go())


def test_ttl_and_deadline_shed_with_429_and_their_reasons():
    async def go() -> None:
        slots, clock = Slots(m=1), Clock()
        fc = make(slots, clock, ttl_s=10.0)
        c = Client(fc, slots)
        c.send(req("busy"))
        await settle(fc)
        c.send(req("old"))
        c.send(req("hurried", deadline=clock.t + 2))
        await settle(fc)
        clock.t += 2.5
        await settle(fc)
        assert c.errors["hurried"].headers[REASON_HEADER] == "deadline"
        assert "old" not in c.errors
        clock.t += 7.6
        await settle(fc)
        err = c.errors["old"]
        assert err.status == 429 and err.headers[REASON_HEADER] == "ttl"
        assert err.headers["Retry-After"] == "1"
        assert fc.queued("m") == 0

    run(go())


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_goes():
    async def go() -> None:
        slots = Slots(m=1)
        fc = make(slots)
        c = Client(fc, slots)
        c.send(req("busy"))
        await settle(fc)
        c.send(req("gone"))
        c.send(req("next"))
        await settle(fc)
        c.tasks["gone"].cancel()
        await settle(fc)
        assert fc.queued("m") == 1 and fc.stats["cancelled"] == 1
        c.finish("busy")
        await settle(fc)
        assert c.order == ["busy", "next"]

    run(go())


def test_no_endpoint_is_503_at_once_and_for_those_queued_when_the_workers_go():
    async def go() -> None:
        slots = Slots(m=1)
        fc = make(slots)
        c = Client(fc, slots)
        c.send(req("x", model="unknown"))
        c.send(req("busy"))
        await settle(fc)
        c.send(req("waiting"))
        await settle(fc)
        assert c.errors["x"].status == 503
        assert c.errors["x"].headers[REASON_HEADER] == "no-endpoint"
        del slots.slots["m"]
        await settle(fc)
        assert c.errors["waiting"].status == 503
        assert c.errors["waiting"].headers[REASON_HEADER] == "no-endpoint"

    run(go())


def test_a_served_model_is_held_past_the_ttl_while_it_starts_then_503_start_timeout():
    async def go() -> None:
        slots, clock = Slots(), Clock()
        slots.starting = {"cold", "warm"}
        fc = make(slots, clock, ttl_s=5.0, served_models={"cold": 20.0, "warm": 60.0})
        c = Client(fc, slots)
        c.send(req("c", model="cold"))
        c.send(req("w", model="warm"))
        await settle(fc)
        clock.t += 10  # past the TTL: still held, its workers are starting
        await settle(fc)
        assert not c.errors and fc.queued("cold") == 1
        slots.slots["warm"] = 1  # a worker is up
        await settle(fc)
        assert c.order == ["w"]
        clock.t += 10.5
        await settle(fc)
        err = c.errors["c"]
        assert err.status == 503 and err.headers[REASON_HEADER] == "start-timeout"
        assert "cold" in err.message and err.headers["Retry-After"] == "5"

    run(go())


def test_close_answers_every_waiter_503():
    async def go() -> None:
        slots = Slots(m=1)
        fc = make(slots)
        c = Client(fc, slots)
        c.send(req("busy"))
        await settle(fc)
        c.send(req("w1"))
        await settle(fc)
        await fc.close()
        await settle(fc)
        assert c.errors["w1"].status == 503
        assert c.errors["w1"].headers[REASON_HEADER] == "closing"
        with pytest.raises(APIError):
            await fc.acquire(req("late"))

    run(go())


def test_the_dispatch_loop_runs_on_its_own_and_a_release_lets_the_next_one_out():
    async def go() -> None:
        slots = Slots(m=1)
        from tandem.router.flowcontrol.local import QueueFlowControl
        from tandem.router.flowcontrol.settings import FlowSettings

        fc = QueueFlowControl(FlowSettings(enabled=True), slots)
        c = Client(fc, slots)
        c.send(req("a"))
        c.send(req("b"))
        await asyncio.sleep(0.01)
        assert c.order == ["a"]
        c.finish("a")
        await asyncio.sleep(0.01)  # well under the safety-net tick: the release kicked it
        assert c.order == ["a", "b"]
        await fc.close()

    run(go())


def test_router_capacity_follows_waiting_kv_in_flight_starting_and_served_models():
    router = Router(RouterSettings(flow_saturation_waiting=2, flow_saturation_kv=0.8,
                                   served_models={"cold": 30.0}), lambda m: None)
    now = 1.0
    assert router.capacity("m", now) is ModelCapacity.NONE
    assert router.capacity("cold", now) is ModelCapacity.STARTING
    w = Worker("http://a", model="m")
    router.add_worker(w)
    assert router.capacity("m", now) is ModelCapacity.STARTING  # known, not ready
    w.ready = True
    assert router.capacity("m", now) is ModelCapacity.AVAILABLE
    w.load = WorkerLoad(num_running=8, num_waiting=2)
    assert router.capacity("m", now) is ModelCapacity.SATURATED
    w.load = WorkerLoad(num_running=8, num_waiting=1, kv_cache_usage=0.85)
    assert router.capacity("m", now) is ModelCapacity.SATURATED
    w.load = WorkerLoad(num_running=3, num_waiting=0)
    w.local_in_flight = 4  # one beyond the running it reported: not yet saturated
    assert router.capacity("m", now) is ModelCapacity.AVAILABLE
    w.local_in_flight = 5
    assert router.capacity("m", now) is ModelCapacity.SATURATED
    assert router.saturated("m") == {"http://a"}
    router.add_worker(Worker("http://b", model="m", ready=True))
    assert router.capacity("m", now) is ModelCapacity.AVAILABLE
    assert router.saturated("m") == {"http://a"}  # a request goes to b, where there is room
    router.add_worker(Worker("http://p", model="p", role="prefill", ready=True))
    assert router.capacity("p", now) is ModelCapacity.NONE  # no decode side
