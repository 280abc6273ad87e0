"""Continuous batching: every step rebuilds the batch under one token budget.

Running requests are served first (a decode token each, or their next prefill chunk), then
waiting requests join in (priority, arrival) order while budget, `max_num_seqs` and blocks
last. When blocks run out a running request is preempted by recompute: its blocks are freed
(full ones keep their hashes, so it usually returns through the prefix cache) and it goes
back to the waiting queue with its generated tokens kept.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """`num_new_tokens` tokens of `request` starting at position `start` run this step."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What the model runs this step. Decodes (one new token) come first in `scheduled`."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS-with-priority scheduler over a `KVCacheManager` (plain values, no torch)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int = 1 << 30) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (priority, seq, req)
        self._seq = itertools.count()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_unfinished_tokens(self) -> int:
        """Prompt + generated tokens of every running and waiting request."""
        return (sum(r.num_tokens for r in self.running)
                + sum(entry[2].num_tokens for entry in self._waiting))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running)

    def can_admit(self, n: int = 1) -> bool:
        return len(self._waiting) + n <= self.max_waiting

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.arrival_seq = next(self._seq)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        heapq.heappush(self._waiting, (req.priority, req.arrival_seq, req))

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove `req` (running or waiting) and free its blocks at once."""
        if req.request_id not in self.requests:
            return
        req.status = status
        del self.requests[req.request_id]
        if req in self.running:
            self.running.remove(req)
        else:
            self._waiting = [e for e in self._waiting if e[2] is not req]
            heapq.heapify(self._waiting)
        keep = req.keep_kv and status in (RequestStatus.FINISHED_STOPPED,
                                          RequestStatus.FINISHED_LENGTH)
        self.kv.free(req, keep=keep)

    # -- scheduling --------------------------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        heapq.heappush(self._waiting, (victim.priority, victim.arrival_seq, victim))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            ok = True
            while self.kv.allocate_slots(req, num_new) is None:
                # lowest priority, latest arrival is the victim (possibly `req` itself)
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_seq))
                j = self.running.index(victim)
                self._preempt(victim, out)
                for s in scheduled:
                    if s.request is victim:
                        budget += s.num_new_tokens
                scheduled = [s for s in scheduled if s.request is not victim]
                if victim is req:
                    ok = False
                    break
                if j < i:
                    i -= 1
            if ok:
                scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
                budget -= num_new
                i += 1

        if not out.preempted:
            while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self._waiting[0][2]
                computed, num_hit = self.kv.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_hit, budget)
                if self.kv.allocate_slots(req, num_new, computed) is None:
                    break
                heapq.heappop(self._waiting)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                req.num_computed_tokens = num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append(ScheduledRequest(req, num_hit, num_new))
                budget -= num_new

        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first, stable
        out.scheduled = scheduled
        out.num_batched_tokens = sum(s.num_new_tokens for s in scheduled)
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of every scheduled request (before sampled tokens are appended)."""
        for s in out.scheduled:
            s.request.num_computed_tokens = s.start + s.num_new_tokens
