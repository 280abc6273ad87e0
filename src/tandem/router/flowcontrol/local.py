"""The queue in front of saturated workers (`QueueFlowControl`), on one router replica, with
its fairness state optionally shared by every replica through Redis (`shared.RedisLedger`).

`acquire` lets a request through at once while its model has a worker below saturation
(`Capacity`) and nothing of its model waits in its band or a higher one; otherwise it queues.
Queued requests wait per model, per priority band (higher first, strictly), per tenant
(fairness: `policies`), in order within the tenant's flow (FCFS or EDF). A dispatch pass runs
on every ticket release, every `kick` (load reports, membership changes) and every
`TICK_S` as a safety net; it lets out at most one request per model and waits until that
request has reached its worker (its `acquire` returned) before the next, so each decision
sees the load the previous one added.

Shedding (429, `Retry-After`, `x-tandem-flow-reason`): `band-full` when the band already
holds `max_requests` requests or `max_bytes` bytes (the new request is refused; nothing
queued is displaced, as in the Gateway API Inference Extension's flow control); `ttl` after
`ttl_s` queued (for a `served_models` model, counted from when a worker of it is up);
`deadline` past the client's deadline. 503 `no-endpoint` when no worker serves the model and
none is starting; 503 `start-timeout` when a `served_models` model got no worker within its
`start_timeout_s` (held that long, even past `ttl_s`, while its workers start); 503
`closing` at shutdown. A waiting request whose task is cancelled (its
client left) leaves the queue (`tandem_router_flow_shed_total{reason="cancelled"}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.protocol.web import APIError
from tandem.router.flowcontrol.base import (
    Capacity,
    FlowControl,
    FlowRequest,
    FlowTicket,
    ModelCapacity,
)
from tandem.router.flowcontrol.flows import START_RETRY_AFTER_S, Entry, FlowQueues, Ticket, shed
from tandem.router.flowcontrol.policies import FAIRNESS, ORDERINGS, LocalLedger
from tandem.router.flowcontrol.settings import FlowSettings

if TYPE_CHECKING:
    from tandem.router.flowcontrol.shared import RedisLedger
    from tandem.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
TICK_S = 0.05  # the dispatch pass's safety-net period (and TTL resolution)
class QueueFlowControl(FlowControl):
    """`FlowControl` with priority bands, fair flows and bounds (module doc). `clock`:
    monotonic seconds (tests pass their own); `autostart`: run the dispatch loop as a task
    (tests may drive `step` themselves)."""

    def __init__(self, settings: FlowSettings, capacity: Capacity,
                 metrics: RouterMetrics | None = None, shared: RedisLedger | None = None,
                 clock: Callable[[], float] = time.monotonic, autostart: bool = True) -> None:
        self.settings, self.capacity, self.metrics = settings, capacity, metrics
        self.fairness = FAIRNESS[settings.fairness]()
        self.ordering = ORDERINGS[settings.ordering]()
        self.ledger = LocalLedger()
        self.shared = shared
        self.clock, self.autostart = clock, autostart
        self.queues = FlowQueues(self.ordering)
        q = self.queues  # its state, by the names the dispatch reads
        self.flows, self.band_count, self.band_bytes = q.flows, q.band_count, q.band_bytes
        self.transit: Counter[str] = Counter()  # dispatched from the queue, not yet out
        self.outstanding = 0  # tickets not released
        self.stats: Counter[str] = Counter()  # dispatched, shed:<reason>, cancelled
        self._seq = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.closed = False

    # -- the contract ----------------------------------------------------------------------
    async def acquire(self, req: FlowRequest) -> FlowTicket:
        if self.closed:
            raise shed(503, "closing", "the router is shutting down")
        self._start()
        now = self.clock()
        cap = self.capacity.capacity(req.model, now)
        if cap is ModelCapacity.NONE:
            self._count_shed(req, "no-endpoint")
            raise shed(503, "no-endpoint", f"no worker serves model {req.model!r}")
        if cap is ModelCapacity.AVAILABLE and not self._ahead(req):
            return self._ticket(req, 0.0)
        seq = next(self._seq)  # its place in arrival order, before any Redis round trip
        if not await self._admit(req):
            self._count_shed(req, "band-full")
            raise shed(429, "band-full", f"too many requests queued at priority band "
                       f"{req.band}; retry later")
        entry = Entry(req, seq, now, asyncio.get_running_loop().create_future(),
                      ttl_from=None if cap is ModelCapacity.STARTING
                      and req.model in self.settings.served_models else now)
        self.queues.push(entry)
        self.kick()
        try:
            return await entry.future
        except asyncio.CancelledError:
            if entry.state == "queued":
                self._leave(entry, "cancelled")
            elif entry.state == "dispatched" and entry.future.done():
                entry.future.result().release()
            raise
        finally:
            if entry.state == "dispatched":
                self.transit[req.model] -= 1
                if self.transit[req.model] <= 0:
                    del self.transit[req.model]
                # after this request's task reaches its worker: the next pass sees its load
                asyncio.get_running_loop().call_soon(self.kick)

    def kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        self.closed = True
        for entry in list(self.queues.entries()):
            self._fail(entry, shed(503, "closing", "the router is shutting down"), "closing")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.shared is not None:
            await self.shared.close()

    def queued(self, model: str) -> int:
        return self.queues.model_count.get(model, 0)

    def queued_by_band(self, model: str) -> dict[int, int]:
        """This replica's queue (with `shared`, too: Redis keeps per-replica counts)."""
        out = dict.fromkeys(self.settings.bands, 0)
        for band, flows in self.flows.get(model, {}).items():
            out[band] = sum(len(heap) for heap in flows.values())
        return out

    def bind_metrics(self, metrics: RouterMetrics) -> None:
        """Count into `metrics` from now on (the app builds them after this object)."""
        self.metrics = self.queues.metrics = metrics
        if self.shared is not None:
            self.shared.metrics = metrics
            metrics.flow_shared.set(0 if self.shared.down else 1)

    # -- the dispatch loop -----------------------------------------------------------------
    def _start(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
            if self.autostart:
                self._task = asyncio.create_task(self._run())
            if self.shared is not None:
                self.shared.start(self.queues.snapshot)

    async def _run(self) -> None:
        assert self._wake is not None
        while not self.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            self._wake.clear()
            try:
                await self.step()
            except Exception:  # the loop must survive anything one pass meets
                logger.exception("flow control: dispatch pass failed")

    async def step(self) -> None:
        """One pass: expire what waited too long, then dispatch one request per model that
        has a worker below saturation."""
        now = self.clock()
        caps: dict[str, ModelCapacity] = {}
        for model in list(self.flows):
            caps[model] = self.capacity.capacity(model, now)
        self._expire(now, caps)
        for model, cap in caps.items():
            if model not in self.flows or self.transit.get(model):
                continue
            if cap is ModelCapacity.NONE:
                for entry in [e for e in self.queues.entries() if e.req.model == model]:
                    self._fail(entry, shed(503, "no-endpoint", f"no worker serves model "
                                           f"{model!r}"), "no-endpoint")
                continue
            if cap is ModelCapacity.AVAILABLE:
                await self._dispatch_one(model)

    async def _dispatch_one(self, model: str) -> None:
        band = max(self.flows[model])
        tenant = await self._choose(band, model, self.queues.heads(model, band))
        if tenant is None or tenant not in self.queues.tenants(model, band):
            return
        entry = self.queues.pop(model, band, tenant)
        entry.state = "dispatched"
        self.transit[model] += 1
        self.ledger.mark_served(band, model, entry.req.tenant)
        self.ledger.charge(band, model, entry.req.tenant, self._charge(entry.req))
        ticket = self._ticket(entry.req, self.clock() - entry.enqueued)
        ticket.charged = self.ledger.generation(band, model)
        entry.future.set_result(ticket)

    async def _choose(self, band: int, model: str, heads: dict[str, Entry]) -> str | None:
        """The tenant served next: the shared ledger's say while Redis answers (None: wait,
        another replica's tenant is due first), else this replica's."""
        if self.shared is not None:
            order = sorted(heads, key=lambda t: self.ledger.served.get(
                (band, model), {}).get(t, -1))
            verdict = await self.shared.dispatch(band, model, [
                (t, self._charge(heads[t].req), heads[t].req.size_bytes) for t in order])
            if verdict is not False:
                return verdict
        return self.ledger.choose(band, model, list(heads))

    def _expire(self, now: float, caps: dict[str, ModelCapacity]) -> None:
        s = self.settings
        for entry in list(self.queues.entries()):
            req = entry.req
            start = s.served_models.get(req.model)
            starting = caps.get(req.model) is ModelCapacity.STARTING
            if entry.ttl_from is None and not (starting and start is not None):
                entry.ttl_from = now  # its workers are up: its TTL runs from now
            if req.deadline is not None and now >= req.deadline:
                self._fail(entry, shed(429, "deadline", "the request's deadline passed while "
                                       "it waited for a worker"), "deadline")
            elif start is not None and starting:
                if now - entry.enqueued >= start:
                    self._fail(entry, shed(503, "start-timeout", f"model {req.model!r}: no "
                                           f"worker started within {start:g} s; retry later",
                                           START_RETRY_AFTER_S), "start-timeout")
            elif now - (entry.ttl_from if entry.ttl_from is not None else now) >= s.ttl_s:
                self._fail(entry, shed(429, "ttl", f"no worker had room within {s.ttl_s:g} "
                                       "s; retry later"), "ttl")

    # -- bookkeeping -----------------------------------------------------------------------
    def _ahead(self, req: FlowRequest) -> bool:
        """Something of `req`'s model waits in its band or a higher one, or is on its way."""
        return bool(self.transit.get(req.model)) or self.queues.waiting_at_or_above(
            req.model, req.band)

    async def _admit(self, req: FlowRequest) -> bool:
        """Room in `req`'s band: fleet-wide through the shared ledger while Redis answers,
        else on this replica; the fairness ledger learns the tenant is backlogged."""
        limits = self.settings.limits(req.band)
        others = self.queues.tenants(req.model, req.band)
        if req.tenant not in others:
            self.ledger.backlogged(req.band, req.model, req.tenant, others)
        if self.shared is not None:
            verdict = await self.shared.enqueue(req.band, req.model, req.tenant,
                                                req.size_bytes, limits)
            if verdict is not None:
                return verdict
        return (self.band_count[req.band] < limits.max_requests
                and self.band_bytes[req.band] + req.size_bytes <= limits.max_bytes)

    def _leave(self, entry: Entry, reason: str) -> None:
        """`entry` leaves the queue undispatched (shed or cancelled)."""
        req = entry.req
        self.queues.discard(entry)
        entry.state = "cancelled" if reason == "cancelled" else "shed"
        self._count_shed(req, reason)
        if self.shared is not None:
            self.shared.left(req.band, req.model, req.tenant, req.size_bytes)

    def _fail(self, entry: Entry, error: APIError, reason: str) -> None:
        self._leave(entry, reason)
        if not entry.future.done():
            entry.future.set_exception(error)

    def _charge(self, req: FlowRequest) -> float:
        return self.fairness.charge(req.cost, self.settings.weight(req.tenant))

    def _ticket(self, req: FlowRequest, waited: float) -> Ticket:
        self.outstanding += 1
        self.stats["dispatched"] += 1
        if self.metrics is not None:
            m = self.metrics
            m.child(m.flow_dispatched, str(req.band), req.tenant).inc()
            m.child(m.flow_wait, str(req.band)).observe(waited)
        return Ticket(self, req)

    def on_release(self, ticket: Ticket, used: int | None) -> None:
        self.outstanding -= 1
        req = ticket.req
        if used is not None and ticket.charged is not None:
            delta = self.fairness.settle(req.cost, used, self.settings.weight(req.tenant))
            if delta and ticket.charged == self.ledger.generation(req.band, req.model):
                self.ledger.charge(req.band, req.model, req.tenant, delta)
                if self.shared is not None:
                    self.shared.settle(req.band, req.model, req.tenant, delta)
        self.kick()

    def _count_shed(self, req: FlowRequest, reason: str) -> None:
        self.stats["cancelled" if reason == "cancelled" else f"shed:{reason}"] += 1
        if self.metrics is not None:
            self.metrics.child(self.metrics.flow_shed, str(req.band), req.tenant,
                               reason).inc()
