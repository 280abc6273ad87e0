"""Flow control's contract: what a front door hands the queue, and what it gets back.

A front door (the HTTP router's `stages.handle`, the gateway's endpoint picker) builds one
`FlowRequest` per request after authentication, parsing and the rate limit, and awaits
`FlowControl.acquire` before it picks a worker. `acquire` returns at once while some
candidate worker of the request's model has room (`Capacity.state`), else queues the request
(priority band, then fairness between tenants, then FCFS or earliest deadline within a
tenant's flow) until a worker frees up; it raises `APIError` 429 (shed: a band's bound, or the
request's TTL ran out in the queue) with `Retry-After` and `x-tandem-flow-reason`, or 503 when
the model has no endpoint at all (and none is starting). The returned `FlowTicket` is released
exactly once, when the answer is over (or never started), with the tokens it used, which
least-attained-service fairness charges to the tenant.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

REASON_HEADER = "x-tandem-flow-reason"  # why a request was shed: "band-full", "ttl", ...


class ModelCapacity(enum.Enum):
    """Whether a model's workers can take one more request now."""

    AVAILABLE = "available"  # some candidate worker is below its saturation thresholds
    SATURATED = "saturated"  # every candidate is saturated: queue
    STARTING = "starting"  # no routable worker yet, but one may come (scale from zero): queue
    NONE = "none"  # no endpoint serves the model and none is coming: 503


class Capacity(Protocol):
    """The routing core's view of a model's workers (`core.Router` implements it)."""

    def capacity(self, model: str, now: float) -> ModelCapacity: ...


@dataclass(frozen=True)
class FlowRequest:
    """One request as flow control sees it. `band`: its priority band (higher is served
    first; the tenant's policy, or the gateway's InferenceObjective); `cost`: its weighted
    tokens up front (prompt tokens + the output it may generate), for fairness and the
    byte/request bounds' accounting; `deadline`: monotonic seconds by which it must be
    dispatched (earliest-deadline ordering), None for FCFS only."""

    request_id: str
    tenant: str  # "anonymous" without API keys
    model: str
    band: int = 0
    cost: int = 1
    size_bytes: int = 0
    deadline: float | None = None


class FlowTicket(ABC):
    """A dispatched request's place in flow control, until `release`."""

    @abstractmethod
    def release(self, used_tokens: int | None = None) -> None:
        """The request is over (answered, failed or abandoned); `used_tokens`: prompt +
        generated tokens it used (None: unknown, its up-front cost counts). Idempotent."""


class FlowControl(ABC):
    """The queue in front of the workers (`flowcontrol.make_flow_control` builds one)."""

    @abstractmethod
    async def acquire(self, req: FlowRequest) -> FlowTicket:
        """Wait until `req` may be dispatched; APIError 429 / 503 when it may not (module
        doc). Cancelling the awaiting task removes the request from the queue."""

    @abstractmethod
    def kick(self) -> None:
        """Capacity may have changed (a load report, a worker joined or left): dispatch
        what now fits."""

    @abstractmethod
    async def close(self) -> None:
        """Stop: requests still queued are answered 503."""

    def bind_metrics(self, metrics: Any) -> None:  # noqa: B027 - optional, a no-op here
        """Count into the router's `RouterMetrics` (the app calls it once it has them)."""

    def queued(self, model: str) -> int:
        """Requests of `model` waiting in the queue now (the scaling signal's share)."""
        return 0

    def queued_by_band(self, model: str) -> dict[int, int]:
        """`queued(model)` per priority band: every band with bounds of its own in the
        settings (0 when empty, so a reader of one band always finds it) and every other band
        holding a request of `model`."""
        return {}
