"""Flow control's plug-ins: fairness between tenants' flows, ordering within a flow.

Fairness is a virtual-time rule: each (band, model) keeps every tenant's attained service
divided by its weight (`vt`); the backlogged tenant with the least `vt` is served next
(ties: the one served longest ago). A policy says what one dispatch adds to it:

* `least-attained`: the request's weighted tokens (`cost / weight`), settled to the tokens it
  really used at release (least-attained service over weighted tokens);
* `round-robin`: one request (`1 / weight`): tenants take turns, weighted.

A tenant that becomes backlogged starts at the least `vt` among those already backlogged
(no credit saved up while idle: the queue is work-conserving), and when no tenant is
backlogged the band's history is dropped. The same rule runs on one replica (`LocalLedger`)
and across replicas in Redis (`shared.RedisLedger`).

Ordering picks the next request of a flow: `fcfs` (arrival) or `edf` (earliest deadline
first, requests without a deadline after those with one, each by arrival).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Protocol


class Fairness(ABC):
    """How much one dispatch adds to its tenant's virtual time."""

    name = ""

    @abstractmethod
    def charge(self, cost: int, weight: float) -> float:
        """Virtual time a dispatched request of `cost` tokens adds for its tenant."""

    @abstractmethod
    def settle(self, cost: int, used: int, weight: float) -> float:
        """Correction at release, once the request used `used` tokens (not `cost`)."""


class LeastAttained(Fairness):
    name = "least-attained"

    def charge(self, cost: int, weight: float) -> float:
        return cost / weight

    def settle(self, cost: int, used: int, weight: float) -> float:
        return (used - cost) / weight


class RoundRobin(Fairness):
    name = "round-robin"

    def charge(self, cost: int, weight: float) -> float:
        return 1.0 / weight

    def settle(self, cost: int, used: int, weight: float) -> float:
        return 0.0


FAIRNESS: dict[str, type[Fairness]] = {p.name: p for p in (LeastAttained, RoundRobin)}


class Queued(Protocol):
    """What an ordering reads of a queued request."""

    seq: int  # arrival order on this replica
    deadline: float | None  # monotonic seconds


class Ordering(ABC):
    """The order of requests within one tenant's flow: smallest `key` first."""

    name = ""

    @abstractmethod
    def key(self, item: Queued) -> tuple[float, int]: ...


class FCFS(Ordering):
    name = "fcfs"

    def key(self, item: Queued) -> tuple[float, int]:
        return (0.0, item.seq)


class EDF(Ordering):
    name = "edf"

    def key(self, item: Queued) -> tuple[float, int]:
        return (math.inf if item.deadline is None else item.deadline, item.seq)


ORDERINGS: dict[str, type[Ordering]] = {p.name: p for p in (FCFS, EDF)}


class LocalLedger:
    """The fairness state of one replica: per (band, model), each tenant's virtual time and
    when it was last served. `Ledger` methods are what `shared.RedisLedger` shares."""

    def __init__(self) -> None:
        self.vt: dict[tuple[int, str], dict[str, float]] = {}
        self.served: dict[tuple[int, str], dict[str, int]] = {}
        self.generations: dict[tuple[int, str], int] = {}  # bumped when history is dropped
        self._turn = 0

    def generation(self, band: int, model: str) -> int:
        """Which history of (band, model) holds now (a settlement applies only to its own)."""
        return self.generations.get((band, model), 0)

    def backlogged(self, band: int, model: str, tenant: str, others: set[str]) -> None:
        """`tenant` has its first queued request in (band, model); `others` already had
        theirs. It starts at their least virtual time (none: the band's history goes)."""
        key = (band, model)
        if not others:
            self.vt.pop(key, None)
            self.served.pop(key, None)
            self.generations[key] = self.generations.get(key, 0) + 1
            return
        vt = self.vt.setdefault(key, {})
        floor = min(vt.get(t, 0.0) for t in others)
        vt[tenant] = max(vt.get(tenant, 0.0), floor)

    def choose(self, band: int, model: str, tenants: list[str]) -> str:
        """The backlogged tenant served next: least virtual time, then served longest ago."""
        vt = self.vt.get((band, model), {})
        served = self.served.get((band, model), {})
        return min(tenants, key=lambda t: (vt.get(t, 0.0), served.get(t, -1), t))

    def charge(self, band: int, model: str, tenant: str, amount: float) -> None:
        """Add `amount` to `tenant`'s virtual time (a dispatch, or its settlement)."""
        vt = self.vt.setdefault((band, model), {})
        vt[tenant] = vt.get(tenant, 0.0) + amount

    def mark_served(self, band: int, model: str, tenant: str) -> None:
        self._turn += 1
        self.served.setdefault((band, model), {})[tenant] = self._turn

    def attained(self, band: int, model: str) -> dict[str, float]:
        """Each tenant's virtual time in (band, model) (tests, the simulation's invariants)."""
        return dict(self.vt.get((band, model), {}))
