"""Leases: pins of KV blocks held for a reader outside the engine, released by their holder
or, once `lease_s` has passed without a renewal, by expiry.

A lease takes over one reference on each of its blocks (a finished `keep_kv` request's, or
a pin the caller took) and drops it exactly once: `release`, or `expire` once its deadline
has passed. A released or expired lease's handle is refused (`LeaseError`, naming which)
by every call but `release`, which answers False, so a late acknowledgement is harmless.
Plain Python (no torch, no clock of its own): times are the caller's `now`, so the engine
thread decides when leases expire and a test can drive a fake clock.
"""

from __future__ import annotations

import heapq
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from tandem.engine.kv_cache.block_pool import BlockPool, KVBlock

MAX_LEASE_S = 600.0  # the longest lease anyone may ask for


class LeaseError(ValueError):
    """A lease handle that is unknown, released or expired was used. `expired`: it ran out
    of time (a transport reports that as a deadline, the others as its own error)."""

    def __init__(self, message: str, expired: bool = False) -> None:
        super().__init__(message)
        self.expired = expired


@dataclass(frozen=True)
class PageLease:
    """A handle on pinned blocks: `block_ids` in position order, held for `owner` until
    `expires` (the clock of whoever passes `now`) unless renewed or released first."""

    lease_id: str
    owner: str
    block_ids: tuple[int, ...]
    expires: float


@dataclass(frozen=True)
class LeaseStats:
    """`active` leases now; `released` by their holders and `expired` since start."""

    active: int
    released: int
    expired: int


class LeaseBook:
    """The leases on one `BlockPool`'s blocks (engine thread only)."""

    def __init__(self, pool: BlockPool, remember: int = 4096) -> None:
        """`remember`: how many ended leases keep their cause for `LeaseError`'s message."""
        self.pool = pool
        self._leases: dict[str, tuple[PageLease, list[KVBlock]]] = {}
        self._by_owner: dict[str, str] = {}
        self._deadlines: list[tuple[float, str]] = []  # a heap; stale entries are skipped
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._remember = remember
        self.released = 0
        self.expired = 0

    def stats(self) -> LeaseStats:
        return LeaseStats(len(self._leases), self.released, self.expired)

    def add(self, owner: str, blocks: list[KVBlock], lease_s: float, now: float) -> PageLease:
        """Lease `blocks` (position order; each must be referenced) for `owner`, taking over
        the caller's reference on each. Raises ValueError for a bad `lease_s`, an owner that
        holds a lease already, or a block nobody references."""
        _check_lease_s(lease_s)
        if owner in self._by_owner:
            raise ValueError(f"{owner!r} holds a lease already")
        if any(b.ref_cnt <= 0 for b in blocks):
            raise ValueError("a lease can only take over references that are held")
        lease = PageLease(uuid.uuid4().hex, owner, tuple(b.block_id for b in blocks),
                          now + lease_s)
        self._leases[lease.lease_id] = (lease, list(blocks))
        self._by_owner[owner] = lease.lease_id
        heapq.heappush(self._deadlines, (lease.expires, lease.lease_id))
        return lease

    def get(self, lease_id: str) -> PageLease:
        """The live lease `lease_id`; `LeaseError` if it was released or expired."""
        return self._held(lease_id)[0]

    def blocks(self, lease_id: str) -> list[KVBlock]:
        """The leased blocks, position order; `LeaseError` as `get`."""
        return list(self._held(lease_id)[1])

    def of_owner(self, owner: str) -> PageLease | None:
        lease_id = self._by_owner.get(owner)
        return None if lease_id is None else self._leases[lease_id][0]

    def renew(self, lease_id: str, lease_s: float, now: float) -> PageLease:
        """Extend the lease to `now + lease_s` (or shorten it); `LeaseError` as `get`."""
        _check_lease_s(lease_s)
        lease, blocks = self._held(lease_id)
        lease = PageLease(lease.lease_id, lease.owner, lease.block_ids, now + lease_s)
        self._leases[lease_id] = (lease, blocks)
        heapq.heappush(self._deadlines, (lease.expires, lease_id))
        return lease

    def release(self, lease_id: str) -> bool:
        """Unpin the lease's blocks (tail first); False when it had ended or never was."""
        if lease_id not in self._leases:
            return False
        self._end(lease_id, "was released")
        self.released += 1
        return True

    def expire(self, now: float) -> list[PageLease]:
        """Unpin every lease whose deadline is at or before `now`; the leases expired."""
        gone: list[PageLease] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            expires, lease_id = heapq.heappop(self._deadlines)
            held = self._leases.get(lease_id)
            if held is None or held[0].expires != expires:  # ended, or renewed since
                continue
            gone.append(held[0])
            self._end(lease_id, "expired")
            self.expired += 1
        return gone

    def _held(self, lease_id: str) -> tuple[PageLease, list[KVBlock]]:
        held = self._leases.get(lease_id)
        if held is None:
            why = self._ended.get(lease_id, "is unknown")
            raise LeaseError(f"lease {lease_id[:32]} {why}: its pages are no longer pinned",
                             expired=why == "expired")
        return held

    def _end(self, lease_id: str, why: str) -> None:
        lease, blocks = self._leases.pop(lease_id)
        del self._by_owner[lease.owner]
        self.pool.free_blocks(reversed(blocks))
        self._ended[lease_id] = why
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)


def _check_lease_s(lease_s: float) -> None:
    if not 0 < lease_s <= MAX_LEASE_S:
        raise ValueError(f"lease_s must be in (0, {MAX_LEASE_S:g}], got {lease_s!r}")
