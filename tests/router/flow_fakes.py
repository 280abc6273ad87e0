"""Test doubles for flow control: a `Capacity` with a fixed number of slots per model, a
manual clock, and helpers that drive `QueueFlowControl` pass by pass."""

from __future__ import annotations

import asyncio

from tandem.router.flowcontrol.base import FlowRequest, ModelCapacity
from tandem.router.flowcontrol.local import QueueFlowControl
from tandem.router.flowcontrol.settings import FlowSettings


class Slots:
    """`slots[model]` requests may run at once; `in_use` is what runs; a model in
    `starting` with no slots is STARTING, one absent is NONE."""

    def __init__(self, **slots: int) -> None:
        self.slots = dict(slots)
        self.in_use: dict[str, int] = {}
        self.starting: set[str] = set()

    def capacity(self, model: str, now: float) -> ModelCapacity:
        if model not in self.slots:
            return ModelCapacity.STARTING if model in self.starting else ModelCapacity.NONE
        if self.slots[model] == 0 and model in self.starting:
            return ModelCapacity.STARTING
        if self.in_use.get(model, 0) < self.slots[model]:
            return ModelCapacity.AVAILABLE
        return ModelCapacity.SATURATED


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(slots: Slots, clock: Clock | None = None, **settings) -> QueueFlowControl:
    """A queue driven by hand (`settle`), on `clock`."""
    return QueueFlowControl(FlowSettings(enabled=True, **settings), slots, None,
                            clock=clock or Clock(), autostart=False)


def req(rid: str, tenant: str = "a", model: str = "m", band: int = 0, cost: int = 10,
        size: int = 100, deadline: float | None = None) -> FlowRequest:
    return FlowRequest(rid, tenant, model, band, cost, size, deadline)


async def settle(fc: QueueFlowControl, passes: int = 1) -> None:
    """Let the tasks run, then run `passes` dispatch passes, letting tasks run after each."""
    for _ in range(passes):
        for _ in range(5):
            await asyncio.sleep(0)
        await fc.step()
    for _ in range(5):
        await asyncio.sleep(0)
