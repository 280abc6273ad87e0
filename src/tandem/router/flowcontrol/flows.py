"""The waiting requests of one replica (`FlowQueues`: per model, per priority band, per
tenant, a heap in the flow's order, `policies.Ordering`, with the counts the bounds and the
scaling signal read), a dispatched request's `Ticket`, and the shed answer (`shed`). Plain
state on the event loop; `local.QueueFlowControl` decides what leaves the queue."""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tandem.protocol.web import APIError
from tandem.router.flowcontrol.base import REASON_HEADER, FlowRequest, FlowTicket
from tandem.router.flowcontrol.policies import Ordering

if TYPE_CHECKING:
    from tandem.router.metrics import RouterMetrics

RETRY_AFTER_S = 1  # a shed request's Retry-After
START_RETRY_AFTER_S = 5  # ... when its model's workers did not start in time


def shed(status: int, reason: str, message: str, retry_after: int = RETRY_AFTER_S) -> APIError:
    """The answer for a request flow control will not serve: `reason` in the header."""
    return APIError(status, message, headers={"Retry-After": str(retry_after),
                                              REASON_HEADER: reason})


class Releaser(Protocol):
    def on_release(self, ticket: Ticket, used: int | None) -> None: ...


@dataclass(eq=False)
class Ticket(FlowTicket):
    fc: Releaser
    req: FlowRequest
    released: bool = field(default=False)
    # the ledger generation it was charged in (None: let through at once, never charged)
    charged: int | None = None

    def release(self, used_tokens: int | None = None) -> None:
        if self.released:
            return
        self.released = True
        self.fc.on_release(self, used_tokens)


@dataclass(eq=False)
class Entry:
    """A queued request; `state`: queued -> dispatched | shed | cancelled (exactly once)."""

    req: FlowRequest
    seq: int
    enqueued: float
    future: asyncio.Future
    state: str = "queued"
    # when its TTL started: its arrival, or when its model's workers stopped starting
    ttl_from: float | None = None

    @property
    def deadline(self) -> float | None:
        return self.req.deadline


class FlowQueues:
    """`flows[model][band][tenant]`: a heap of (ordering key, Entry); `band_count` /
    `band_bytes`: requests and body bytes queued per band; `model_count` per model;
    `tandem_router_flow_queued` follows them once `metrics` is set."""

    def __init__(self, ordering: Ordering) -> None:
        self.ordering = ordering
        self.flows: dict[str, dict[int, dict[str, list]]] = {}
        self.band_count: Counter[int] = Counter()
        self.band_bytes: Counter[int] = Counter()
        self.model_count: Counter[str] = Counter()
        self.metrics: RouterMetrics | None = None

    def push(self, entry: Entry) -> None:
        req = entry.req
        flow = self.flows.setdefault(req.model, {}).setdefault(req.band, {}).setdefault(
            req.tenant, [])
        heapq.heappush(flow, (self.ordering.key(entry), entry))
        self.band_count[req.band] += 1
        self.band_bytes[req.band] += req.size_bytes
        self.model_count[req.model] += 1
        if self.metrics is not None:
            self.metrics.child(self.metrics.flow_queued, str(req.band), req.tenant).inc()

    def pop(self, model: str, band: int, tenant: str) -> Entry:
        """The head of (model, band, tenant)'s flow, out of the queue."""
        _, entry = heapq.heappop(self.flows[model][band][tenant])
        self._counted_out(entry)
        return entry

    def discard(self, entry: Entry) -> None:
        """`entry` out of the queue from wherever it is in its flow."""
        req = entry.req
        flow = self.flows[req.model][req.band][req.tenant]
        flow.remove((self.ordering.key(entry), entry))
        heapq.heapify(flow)
        self._counted_out(entry)

    def _counted_out(self, entry: Entry) -> None:
        """Counts down for a request leaving the queue (its heap entry already gone)."""
        req = entry.req
        bands = self.flows[req.model]
        if not bands[req.band][req.tenant]:
            del bands[req.band][req.tenant]
            if not bands[req.band]:
                del bands[req.band]
                if not bands:
                    del self.flows[req.model]
        for counter, key, n in ((self.band_count, req.band, 1),
                                (self.band_bytes, req.band, req.size_bytes),
                                (self.model_count, req.model, 1)):
            counter[key] -= n
            if counter[key] <= 0:
                del counter[key]
        if self.metrics is not None:
            self.metrics.child(self.metrics.flow_queued, str(req.band), req.tenant).dec()

    def heads(self, model: str, band: int) -> dict[str, Entry]:
        """Each backlogged tenant's next request in (model, band)."""
        return {t: heap[0][1] for t, heap in self.flows[model][band].items()}

    def tenants(self, model: str, band: int) -> set[str]:
        return set(self.flows.get(model, {}).get(band, {}))

    def waiting_at_or_above(self, model: str, band: int) -> bool:
        return any(b >= band for b in self.flows.get(model, {}))

    def entries(self) -> list[Entry]:
        return [e for bands in self.flows.values() for flows in bands.values()
                for heap in flows.values() for _, e in heap]

    def snapshot(self) -> list[tuple[int, str, str, int, int]]:
        """(band, model, tenant, requests, bytes) queued here, for the shared ledger's
        resync."""
        return [(band, model, tenant, len(heap), sum(e.req.size_bytes for _, e in heap))
                for model, bands in self.flows.items() for band, flows in bands.items()
                for tenant, heap in flows.items()]
