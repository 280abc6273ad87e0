"""Continuous batching: every step rebuilds the batch under one token budget.

Running requests are served first (a decode token each, or their next prefill chunk), then
waiting requests join in (priority, arrival) order while budget, `max_num_seqs` and blocks
last. With `long_prefill_token_threshold` (vLLM's option of that name) no request's prefill
chunk exceeds that many tokens per step, so a long prompt leaves budget to the requests
behind it: they start next step instead of after its whole prefill. Such long chunks are
scheduled after the waiting prompts, and sit out a step that finishes another prompt's
prefill (for at most the cap's worth of tokens in a row; see `_schedule_deferred`).

When blocks run out a running request is preempted by recompute: its blocks are freed
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
                 max_waiting: int = 1 << 30, long_prefill_token_threshold: int = 0) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: no cap
        self.max_waiting = max_waiting
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (priority, seq, req)
        self._seq = itertools.count()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._yielded: dict[str, int] = {}  # request id -> tokens of steps it sat out

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
        self._yielded.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        else:
            self._waiting = [e for e in self._waiting if e[2] is not req]
            heapq.heapify(self._waiting)
        keep = req.keep_kv and status in (RequestStatus.FINISHED_STOPPED,
                                          RequestStatus.FINISHED_LENGTH)
        self.kv.free(req, keep=keep)

    # -- scheduling --------------------------------------------------------------------------
    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to run this step of a request with `remaining` uncomputed tokens."""
        cap = self.long_prefill_token_threshold
        return min(remaining, budget, cap) if cap > 0 else min(remaining, budget)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        self._yielded.pop(victim.request_id, None)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        heapq.heappush(self._waiting, (victim.priority, victim.arrival_seq, victim))

    def _make_room(self, req: Request, num_new: int, scheduled: list[ScheduledRequest],
                   out: SchedulerOutput) -> bool:
        """Blocks for `num_new` more tokens of running `req`, preempting the lowest-priority,
        latest request while the pool is short (dropping it from `scheduled`). False when
        `req` itself was the victim."""
        while self.kv.allocate_slots(req, num_new) is None:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_seq))
            self._preempt(victim, out)
            scheduled[:] = [s for s in scheduled if s.request is not victim]
            if victim is req:
                return False
        return True

    def _left(self, scheduled: list[ScheduledRequest]) -> int:
        return self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        cap = self.long_prefill_token_threshold
        scheduled: list[ScheduledRequest] = []
        deferred: list[Request] = []  # long prefills: their chunk comes after waiting prompts
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier request this step
            remaining = req.num_tokens - req.num_computed_tokens
            long = 0 < cap < remaining
            if long and self._yielded.get(req.request_id, 0) < cap:
                deferred.append(req)  # a long prefill not yet due: after the waiting prompts
                continue
            num_new = self._chunk(remaining, budget)
            preempted = len(out.preempted)
            if self._make_room(req, num_new, scheduled, out):
                scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
                if long:  # a due one: it starts sitting out afresh
                    self._yielded.pop(req.request_id, None)
            # without a preemption `req` got its chunk; with one, victims' chunks came back
            budget = (budget - num_new if len(out.preempted) == preempted
                      else self._left(scheduled))

        if not out.preempted:
            while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self._waiting[0][2]
                computed, num_hit = self.kv.get_computed_blocks(req)
                num_new = self._chunk(req.num_tokens - num_hit, budget)
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

        yielding = self._schedule_deferred(deferred, scheduled, out)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first, stable
        out.scheduled = scheduled
        out.num_batched_tokens = sum(s.num_new_tokens for s in scheduled)
        for req in yielding:
            self._yielded[req.request_id] = (self._yielded.get(req.request_id, 0)
                                             + out.num_batched_tokens)
        return out

    def _schedule_deferred(self, deferred: list[Request], scheduled: list[ScheduledRequest],
                           out: SchedulerOutput) -> list[Request]:
        """Chunks of the long prefills held back from the running pass. While this step
        finishes some prompt's prefill, a long one yields it to that prompt (a CPU step costs
        in proportion to its tokens, so its chunk would delay that prompt's first token); it
        also sits out a step the waiting prompts filled. Once it has sat out
        `long_prefill_token_threshold` tokens of steps in a row it is due, and the running
        pass serves it first: under a stream of short prompts it still gets about half of
        the worker. Returns the requests that sat out this step."""
        cap = self.long_prefill_token_threshold
        finishing = any(s.samples and s.start < s.request.num_prompt_tokens
                        for s in scheduled)
        yielding = []
        for req in deferred:
            if req.status is not RequestStatus.RUNNING:
                continue
            budget = self._left(scheduled)
            if finishing or budget <= 0:
                yielding.append(req)
                continue
            num_new = min(cap, budget)
            if self._make_room(req, num_new, scheduled, out):
                scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
                self._yielded.pop(req.request_id, None)
        return yielding

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of every scheduled request (before sampled tokens are appended)."""
        for s in out.scheduled:
            s.request.num_computed_tokens = s.start + s.num_new_tokens
