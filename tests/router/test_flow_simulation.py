"""Flow control's invariants over thousands of seeded random traces (arrivals in random
bands, tenants and models; completions with random usage; cancellations; clock jumps past
TTLs and deadlines; workers coming and going), with every policy combination:

* every request that reaches the queue is dispatched, shed or cancelled exactly once, and
  every ticket handed out is released (nothing outstanding once the trace is over);
* a band never holds more than its `max_requests` requests or `max_bytes` bytes;
* a request never goes while one of a higher band of its model waits;
* under least-attained fairness with equal weights, the attained service of the tenants
  backlogged in a band stays within one request's cost of each other.
"""

from __future__ import annotations

import asyncio
import random

from tandem.protocol.web import APIError
from tandem.router.flowcontrol.local import QueueFlowControl
from tandem.router.flowcontrol.settings import BandLimits, FlowSettings
from tests.router.flow_fakes import Clock, Slots, req

TRACES = 1500
STEPS = 30
MAX_COST = 50


class Checked(QueueFlowControl):
    """Checks the band-order invariant at every grant."""

    violations: list[str]
    granted: str | None = None  # the request of the latest grant

    def _ticket(self, r, waited):  # noqa: ANN001, ANN202 - the override's types are the base's
        self.granted = r.request_id
        higher = [b for b in self.flows.get(r.model, {}) if b > r.band]
        if higher:
            self.violations.append(f"{r.request_id} (band {r.band}) went before band "
                                   f"{max(higher)}")
        return super()._ticket(r, waited)


async def settle(fc: QueueFlowControl) -> None:
    for _ in range(3):
        await asyncio.sleep(0)
    await fc.step()
    for _ in range(3):
        await asyncio.sleep(0)


async def trace(seed: int) -> None:
    rng = random.Random(seed)
    fairness = rng.choice(["least-attained", "round-robin"])
    models = ["m", "n"][:rng.randint(1, 2)]
    slots, clock = Slots(**{m: rng.randint(1, 3) for m in models}), Clock()
    settings = FlowSettings(
        enabled=True, fairness=fairness, ordering=rng.choice(["fcfs", "edf"]), ttl_s=10.0,
        default_band=BandLimits(rng.randint(2, 6), rng.randint(200, 2000)),
        bands={1: BandLimits(rng.randint(1, 4), 10_000)})
    fc = Checked(settings, slots, clock=clock, autostart=False)
    fc.violations = []
    outcomes: dict[str, list[str]] = {}
    running: dict[str, tuple] = {}
    tasks: dict[str, asyncio.Task] = {}

    def send(r) -> None:
        async def run() -> None:
            try:
                ticket = await fc.acquire(r)
            except APIError as exc:
                outcomes[r.request_id].append(f"shed {exc.status}")
                return
            except asyncio.CancelledError:
                outcomes[r.request_id].append("cancelled")
                raise
            outcomes[r.request_id].append("dispatched")
            running[r.request_id] = (ticket, r)
            slots.in_use[r.model] = slots.in_use.get(r.model, 0) + 1

        outcomes[r.request_id] = []
        tasks[r.request_id] = asyncio.ensure_future(run())

    def finish(rid: str) -> None:
        ticket, r = running.pop(rid)
        slots.in_use[r.model] -= 1
        ticket.release(rng.choice([None, rng.randint(0, r.cost)]))

    for i in range(STEPS):
        action = rng.random()
        if action < 0.45:
            deadline = clock.t + rng.uniform(1, 20) if rng.random() < 0.3 else None
            send(req(f"r{i}", tenant=rng.choice("abc"), model=rng.choice(models),
                     band=rng.choice([-1, 0, 0, 1]), cost=rng.randint(1, MAX_COST),
                     size=rng.randint(10, 400), deadline=deadline))
        elif action < 0.75 and running:
            finish(rng.choice(sorted(running)))
        elif action < 0.82:
            waiting = [rid for rid, t in tasks.items() if not t.done()]
            if rng.random() < 0.5 and running:  # a slot frees; cancel the one let out for it
                finish(rng.choice(sorted(running)))
                fc.granted = None
                await fc.step()
                waiting = [fc.granted] if fc.granted in waiting else waiting
            if waiting:
                tasks[rng.choice(waiting)].cancel()
        elif action < 0.92:
            clock.t += rng.choice([0.5, 3.0, 11.0])
        else:
            model = rng.choice(models)
            slots.slots[model] = max(0, slots.slots[model] + rng.choice([-1, 1]))
        await settle(fc)
        for band in fc.band_count:
            limits = settings.limits(band)
            assert fc.band_count[band] <= limits.max_requests, (seed, band)
            assert fc.band_bytes[band] <= limits.max_bytes, (seed, band)
        if fairness == "least-attained":
            for model, bands in fc.flows.items():
                for band, flows in bands.items():
                    vt = fc.ledger.attained(band, model)
                    held = [vt.get(t, 0.0) for t in flows]
                    assert max(held) - min(held) <= MAX_COST + 1e-9, (seed, vt, list(flows))
    for rid in sorted(running):
        finish(rid)
    await fc.close()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert not fc.violations, (seed, fc.violations)
    for rid, seen in outcomes.items():
        assert len(seen) == 1, (seed, rid, seen)
    assert fc.outstanding == 0, seed
    assert fc.queued("m") == fc.queued("n") == 0
    counted = sum(fc.stats.values()) - fc.stats["shed:closing"]
    assert counted + fc.stats["shed:closing"] == len(outcomes), (seed, fc.stats)


def test_invariants_hold_over_thousands_of_random_traces():
    async def go() -> None:
        for seed in range(TRACES):
            await trace(seed)

    asyncio.run(go())
