"""`serving.drain.Drain` on its own, seeded and randomized: every request in flight ends
exactly once, whatever mix of queued, partly started, running and finishing requests the
stop meets. A request none of whose engine requests started is handed back at once; one
with any started runs on until it finishes or the drain times out, and is then cut; one
that finished is never cut. (Real workers: `test_worker_drain.py`.)"""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.serving import drain as drain_mod
from tandem.serving.drain import Drain, WorkerDraining


class Stream:
    """An engine output stream's `fail`, recorded."""

    def __init__(self) -> None:
        self.failures: list[BaseException] = []

    def fail(self, exc: BaseException) -> None:
        self.failures.append(exc)


class Engine:
    alive = True

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting

    async def unstarted_request_ids(self) -> set[str]:
        return set(self.waiting)


@pytest.mark.parametrize("seed", range(40))
def test_every_request_ends_once_and_only_unstarted_ones_are_handed_back(seed, monkeypatch):
    monkeypatch.setattr(drain_mod, "POLL_S", 0.001)
    rng = random.Random(seed)
    d = Drain()
    streams: dict[str, list[Stream]] = {}
    waiting = {f"not-tracked-{i}-0" for i in range(rng.randint(0, 2))}  # admitted, untracked
    unstarted = set()
    for r in range(rng.randint(0, 12)):
        rid = f"cmpl-{r}"
        streams[rid] = [Stream() for _ in range(rng.randint(1, 3))]
        d.track(rid, streams[rid])  # type: ignore[arg-type]
        started = [rng.random() < 0.5 for _ in streams[rid]]
        waiting.update(f"{rid}-{i}" for i, s in enumerate(started) if not s)
        if not any(started):
            unstarted.add(rid)
    finishing = [rid for rid in streams if rid not in unstarted and rng.random() < 0.6]
    rng.shuffle(finishing)
    finished = set()

    def in_flight() -> int:  # each poll, the next running request's reader ends
        if finishing and (rid := finishing.pop()) in d.requests:
            finished.add(rid)
            d.untrack(rid)
        return len(d.requests)

    timeout = rng.choice([0.0, 0.005, 0.05])
    asyncio.run(d.run(Engine(waiting), timeout, in_flight, lambda: 0))  # type: ignore[arg-type]

    assert not d.requests
    for rid, queues in streams.items():
        for q in queues:
            if rid in finished:
                assert q.failures == [], rid
                continue
            assert len(q.failures) == 1 and isinstance(q.failures[0], WorkerDraining), rid
            why = str(q.failures[0])
            assert ("not started" in why) == (rid in unstarted), (rid, why)
            assert ("drain timeout" in why) == (rid not in unstarted), (rid, why)
