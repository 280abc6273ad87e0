"""Continuous batching: every step rebuilds the batch under one token budget.

Running requests are served first, in (priority, arrival) order (a decode token each, or
their next prefill chunk), then waiting requests join in the same order while budget,
`max_num_seqs` and blocks last. With `long_prefill_token_threshold` (vLLM's option of that
name) no request's prefill chunk exceeds that many tokens per step, so a long prompt leaves
budget to the requests behind it: they start next step instead of after its whole prefill.
Such long chunks are scheduled after the waiting prompts, and sit out a step that finishes
another prompt's prefill (for at most the cap's worth of tokens in a row; see
`_schedule_deferred`).

When blocks run out a running request is preempted by recompute: its blocks are freed
(the full ones it computed keep their hashes, so it usually returns through the prefix
cache) and it goes back to the waiting queue with its generated tokens kept. A victim is
never a request already scheduled in this step: the running pass serves requests in the
order victims are taken from the back, and the deferred pass takes none that ran.

With LoRA (`max_loras` > 0) the running requests use at most `max_loras` distinct adapters:
a waiting request whose adapter would exceed it is passed over (the requests behind it
may start) until a running adapter's last request leaves. A request whose structured-output
grammar still compiles is passed over the same way until it is ready
(`structured_manager.waiting_for_grammar`).

A step computes prompt logprobs (`[rows, vocab]` float32 logits) for at most
`prompt_logprobs_rows` prompt positions, over all its requests: a request asking for them
gets a shorter prefill chunk (or none this step) when the step's rows are taken, so the
memory of any prompt-logprobs request stays within what the profiling step reserves.

Admission stops at the first waiting request that does not fit, except for P/D requests
whose imported blocks are pinned with a block for their last token (they need no free one);
a step that would run nothing admits the first request that fits.

With a KV connector (`kv.connector`, `engine/kv_connector`), an admission asks it how many
tokens after the local prefix hit it can load (`get_num_new_matched_tokens`), at most up to
the last prompt token (and no position whose prompt logprobs are due): one token is always
computed, so the request samples. Those tokens take blocks (the connector is told which:
`update_state_after_alloc`) but no budget; they count as computed from admission on and are
loaded in the same step, before each layer attends (the step's `ConnectorMetadata`, built
once per step into `SchedulerOutput.kv_connector_meta`). Asynchronous loads are refused.
`tokens_loaded` and `tokens_computed` count the tokens of completed steps.

Blocks join the prefix cache in `update_after_step`, after the forward that computed (or
loaded) them.

With a sliding-window model (`KVCacheManager.sliding_window`) each step's scheduling begins
by releasing the running requests' blocks that no future query reads
(`KVCacheManager.free_out_of_window`), so a request holds a bounded number of blocks
(`max_blocks`) however long it grows: a prompt longer than the pool runs in chunks.
A waiting request whose prefix continues into blocks this step computes for another
request (n > 1 samples, a burst sharing a system prompt) waits a step and then hits them
instead of computing them twice, when they are at least half of its chunk.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.structured_manager import waiting_for_grammar

if TYPE_CHECKING:
    from tandem.engine.kv_connector.base import ConnectorMetadata

STALL_LOOKAHEAD = 64  # waiting requests a stalled step looks at
PROMPT_LOGPROBS_MIN_ROWS = 256


def prompt_logprobs_rows(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Prompt positions whose logprobs one step computes, at most: max(max_num_seqs, 256)
    within the token budget. `memory.profile_steps` profiles a step with this many."""
    return min(max_num_batched_tokens, max(max_num_seqs, PROMPT_LOGPROBS_MIN_ROWS))


@dataclass
class ScheduledRequest:
    """`num_new_tokens` tokens of `request` starting at position `start` run this step; the
    last `len(spec_token_ids)` of them are proposed tokens to verify (speculative decoding:
    the request's last known token, then its drafts). `num_external_tokens`: the tokens
    just before `start` that the KV connector loads in this step (its admission)."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    draft_probs: object | None = None  # [len(spec_token_ids), V] or None (point masses)
    num_external_tokens: int = 0

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        return (self.start + self.num_new_tokens - len(self.spec_token_ids)
                == self.request.num_tokens)


@dataclass
class SchedulerOutput:
    """What the model runs this step. Decodes (one new token) come first in `scheduled`."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # the KV connector's work for this step (None: no connector)
    kv_connector_meta: ConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS-with-priority scheduler over a `KVCacheManager` (plain values, no torch)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int = 1 << 30, long_prefill_token_threshold: int = 0,
                 max_loras: int = 0) -> None:
        self.kv = kv
        # distinct LoRA adapters among the running requests, at most `max_loras` (0: no
        # LoRA): so every step's adapters fit the device slots
        self.max_loras = max_loras
        self.running_loras: Counter[str] = Counter()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prompt_logprobs_rows = prompt_logprobs_rows(max_num_seqs,
                                                             max_num_batched_tokens)
        self._plp_left = self.max_prompt_logprobs_rows  # this step's rows not yet taken
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: no cap
        self.max_waiting = max_waiting
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (priority, seq, req)
        self._seq = itertools.count()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._yielded: dict[str, int] = {}  # request id -> tokens of steps it sat out
        # tokens of completed steps: loaded by the KV connector, computed by the forward
        self.tokens_loaded = 0
        self.tokens_computed = 0

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

    def waiting_requests(self) -> list[Request]:
        """Queued requests, in no particular order."""
        return [entry[2] for entry in self._waiting]

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
            self._drop_lora(req)
        else:
            self._waiting = [e for e in self._waiting if e[2] is not req]
            heapq.heapify(self._waiting)
        normal = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        self.kv.free(req, keep=req.keep_kv and normal, finished=normal)

    # -- scheduling --------------------------------------------------------------------------
    def _chunk(self, remaining: int, budget: int, req: Request | None = None) -> int:
        """Tokens to run this step of a request with `remaining` uncomputed tokens; for `req`
        asking for prompt logprobs, also within the step's prompt-logprobs rows left (0: it
        cannot run this step)."""
        cap = self.long_prefill_token_threshold
        n = min(remaining, budget, cap) if cap > 0 else min(remaining, budget)
        if req is not None and req.prompt_logprobs_pos is not None:
            start = req.num_tokens - remaining
            # positions [first, num_prompt_tokens - 1) still need their row (position p
            # gives prompt token p + 1's logprob)
            first = max(start, req.prompt_logprobs_pos)
            if first + self._plp_left < req.num_prompt_tokens - 1:
                n = min(n, first + self._plp_left - start)
        return n

    def _take_rows(self, req: Request, start: int, num_new: int) -> None:
        """`num_new` tokens of `req` from `start` run this step: their prompt-logprobs rows
        are taken from the step's."""
        if req.prompt_logprobs_pos is not None:
            first = max(start, req.prompt_logprobs_pos)
            self._plp_left -= max(0, min(start + num_new, req.num_prompt_tokens - 1) - first)

    def _drop_lora(self, req: Request) -> None:
        if req.lora_name is not None:
            self.running_loras[req.lora_name] -= 1
            if self.running_loras[req.lora_name] <= 0:
                del self.running_loras[req.lora_name]

    def _lora_blocked(self, req: Request) -> bool:
        """Admitting `req` would take the running requests past `max_loras` adapters."""
        name = req.lora_name
        return (name is not None and self.max_loras > 0 and name not in self.running_loras
                and len(self.running_loras) >= self.max_loras)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self._drop_lora(victim)
        self.kv.free(victim)
        self._yielded.pop(victim.request_id, None)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids, victim.spec_draft_probs = [], None
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        heapq.heappush(self._waiting, (victim.priority, victim.arrival_seq, victim))

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for `num_new` more tokens of running `req` (running pass), preempting from
        the back of `running` (lowest priority, latest arrival) while the pool is short.
        Everything behind `req` there is unscheduled this step. False when `req` itself was
        the victim."""
        while self.kv.allocate_slots(req, num_new) is None:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _make_room_deferred(self, req: Request, num_new: int, ran: set[str],
                            out: SchedulerOutput) -> bool:
        """As `_make_room` for a deferred long prefill, but victims are only requests behind
        `req` that did not run this step. When none is left, `req` sits the step out (False)
        rather than lose its own progress, unless nothing else runs this step: then it gives
        its blocks back as the running pass would (pins held for others must not wedge it)."""
        key = (req.priority, req.arrival_seq)
        while self.kv.allocate_slots(req, num_new) is None:
            victim = next((r for r in reversed(self.running) if r.request_id not in ran
                           and (r.priority, r.arrival_seq) > key), None)
            if victim is None:
                if ran:
                    return False
                victim = req
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _speculate(self, req: Request, remaining: int, budget: int) -> ScheduledRequest | None:
        """A decode with its proposed tokens, as many as budget and free blocks allow without
        preempting anyone (drafts are optional work); None: run it as a plain decode. The
        drafts are taken off the request either way."""
        drafts, probs = req.spec_token_ids, req.spec_draft_probs
        req.spec_token_ids, req.spec_draft_probs = [], None
        k = min(len(drafts), budget - 1)
        if remaining != 1 or k <= 0 or self.kv.allocate_slots(req, 1 + k) is None:
            return None
        if probs is not None and k < len(drafts):
            probs = probs[:k]
        return ScheduledRequest(req, req.num_computed_tokens, 1 + k, drafts[:k], probs)

    def _admit(self, req: Request) -> None:
        """A waiting request starts running: `running` stays in (priority, arrival) order."""
        bisect.insort(self.running, req, key=lambda r: (r.priority, r.arrival_seq))
        if req.lora_name is not None:
            self.running_loras[req.lora_name] += 1

    def max_blocks(self, num_tokens: int, keep: bool = False) -> int:
        """The most KV blocks a request of `num_tokens` tokens (prompt + max_tokens) holds at
        once (`keep`: a `keep_kv` request): all of them, or fewer with a sliding window
        (`KVCacheManager.max_blocks`, a step running at most `max_num_batched_tokens`)."""
        return self.kv.max_blocks(num_tokens, self.max_num_batched_tokens, keep)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.new_step()
        if self.kv.frees_blocks:  # before anything is allocated this step
            for req in self.running:
                self.kv.free_out_of_window(req)
        cap = self.long_prefill_token_threshold
        scheduled: list[ScheduledRequest] = []
        deferred: list[Request] = []  # long prefills: their chunk comes after waiting prompts
        budget = self.max_num_batched_tokens
        self._plp_left = self.max_prompt_logprobs_rows
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
            if req.spec_token_ids and (s := self._speculate(req, remaining, budget)):
                scheduled.append(s)
                budget -= s.num_new_tokens
                continue
            num_new = self._chunk(remaining, budget, req)
            if num_new == 0:
                continue  # the step's prompt-logprobs rows are taken: next step
            if self._make_room(req, num_new, out):
                self._take_rows(req, req.num_computed_tokens, num_new)
                scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
                budget -= num_new
                if long:  # a due one: it starts sitting out afresh
                    self._yielded.pop(req.request_id, None)

        if not out.preempted:
            budget = self._schedule_waiting(scheduled, budget)

        yielding = self._schedule_deferred(deferred, scheduled, out)
        if not scheduled and self._waiting:
            self._admit_when_stalled(scheduled, out.preempted)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first, stable
        out.scheduled = scheduled
        out.num_batched_tokens = sum(s.num_new_tokens for s in scheduled)
        for req in yielding:
            if req.status is RequestStatus.RUNNING:  # not preempted later in this step
                self._yielded[req.request_id] = (self._yielded.get(req.request_id, 0)
                                                 + out.num_batched_tokens)
        if self.kv.connector is not None:
            out.kv_connector_meta = self.kv.connector.build_connector_meta()
        return out

    def _external(self, req: Request, num_hit: int) -> int:
        """Tokens of waiting `req` after its `num_hit` local ones that the KV connector
        loads on admission: its answer, cut to leave the last token (and the positions whose
        prompt logprobs are due) to compute. Asked only at a block boundary (a staged P/D
        tail ends the hit inside the prompt's last block)."""
        conn = self.kv.connector
        if conn is None or num_hit % self.kv.block_size:
            return 0
        limit = req.num_tokens - 1
        if req.prompt_logprobs_pos is not None:
            limit = min(limit, req.prompt_logprobs_pos)
        if limit <= num_hit:
            return 0
        match = conn.get_num_new_matched_tokens(req, num_hit)
        if match.num_tokens and match.load_async:
            raise ConfigError(
                f"the KV connector answered load_async for {req.request_id!r}: this engine "
                "loads external KV synchronously only (in the step that admits a request)")
        return min(match.num_tokens, limit - num_hit)

    def _with_external(self, req: Request, num_hit: int, num_new: int,
                       budget: int) -> tuple[int, int]:
        """(tokens the connector loads, tokens to compute) for admitting `req` this step."""
        ext = self._external(req, num_hit)
        if ext:
            n = self._chunk(req.num_tokens - num_hit - ext, budget, req)
            if n:
                return ext, n
        return 0, num_new

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Admit waiting requests in (priority, arrival) order while budget, seats and blocks
        last; returns the budget left.

        - One whose prefix continues into blocks this step computes for another request,
          at least half of the chunk it would run, waits a step instead and then hits them
          (n > 1 samples, a burst sharing a long system prompt): a step of waiting costs it
          no more than computing them, and nobody computes them twice.
        - The first that does not fit stops admission (no overtaking under pressure), except
          for requests with a staged block (P/D imports, `KVCacheManager.import_blocks`):
          they take no free block, so they cannot delay the one that did not fit, and their
          pinned pages would otherwise hold the pool while they wait behind it.
        """
        passed: list[tuple[int, int, Request]] = []
        blocked = False
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._waiting[0][2]
            # its adapter waits for a slot, or its grammar compiles: others go ahead
            if self._lora_blocked(req) or waiting_for_grammar(req):
                passed.append(heapq.heappop(self._waiting))
                continue
            computed, num_hit = self.kv.get_computed_blocks(req)
            num_new = self._chunk(req.num_tokens - num_hit, budget, req)
            if num_new == 0 or 2 * self.kv.pending_run(req, num_hit // self.kv.block_size
                                                       ) >= num_new:
                passed.append(heapq.heappop(self._waiting))  # half its chunk is being computed
                continue
            ext, num_new = self._with_external(req, num_hit, num_new, budget)
            if self.kv.allocate_slots(req, ext + num_new, computed,
                                      num_external_tokens=ext) is None:
                blocked = True
                break
            heapq.heappop(self._waiting)
            budget = self._start(req, num_hit, num_new, scheduled, budget, ext)
        for entry in passed:
            heapq.heappush(self._waiting, entry)
        if blocked:
            budget = self._admit_staged(scheduled, budget)
        return budget

    def _admit_staged(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Admit the waiting requests with a staged block that fit without a free block."""
        ids = self.kv.staged_request_ids()
        if not ids:
            return budget
        staged = sorted((e for e in self._waiting
                         if e[2].request_id in ids or e[2].parent_id in ids),
                        key=lambda e: e[:2])
        admitted = []
        for _, _, req in staged:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._lora_blocked(req) or waiting_for_grammar(req):
                continue
            computed, num_hit = self.kv.get_computed_blocks(req)
            num_new = self._chunk(req.num_tokens - num_hit, budget, req)
            if num_new == 0:
                continue
            ext, num_new = self._with_external(req, num_hit, num_new, budget)
            if self.kv.allocate_slots(req, ext + num_new, computed, max_free=0,
                                      num_external_tokens=ext) is None:
                continue
            admitted.append(req)
            budget = self._start(req, num_hit, num_new, scheduled, budget, ext)
        if admitted:
            gone = set(map(id, admitted))
            self._waiting = [e for e in self._waiting if id(e[2]) not in gone]
            heapq.heapify(self._waiting)
        return budget

    def _admit_when_stalled(self, scheduled: list[ScheduledRequest],
                            preempted: list[Request]) -> None:
        """Nothing runs this step, yet requests wait: the first (in order, within
        `STALL_LOOKAHEAD`, not preempted in this step) that fits is admitted, though one
        before it does not. Blocks pinned outside the scheduler (a prefill role's leased
        pages, imports still in flight) must not idle the engine while some request could
        run."""
        for _, _, req in heapq.nsmallest(STALL_LOOKAHEAD, self._waiting):
            if req in preempted or self._lora_blocked(req) or waiting_for_grammar(req):
                continue
            computed, num_hit = self.kv.get_computed_blocks(req)
            num_new = self._chunk(req.num_tokens - num_hit, self.max_num_batched_tokens, req)
            if not num_new:
                continue
            ext, num_new = self._with_external(req, num_hit, num_new,
                                               self.max_num_batched_tokens)
            if self.kv.allocate_slots(req, ext + num_new, computed,
                                      num_external_tokens=ext) is not None:
                self._waiting = [e for e in self._waiting if e[2] is not req]
                heapq.heapify(self._waiting)
                self._start(req, num_hit, num_new, scheduled, 0, ext)
                return

    def _start(self, req: Request, num_hit: int, num_new: int,
               scheduled: list[ScheduledRequest], budget: int, ext: int = 0) -> int:
        """`req` (its blocks allocated) leaves the waiting queue for `running`: `num_hit`
        tokens hit locally, then `ext` loaded by the connector in this step count as
        computed; `num_new` run."""
        self.kv.record_admission(req, num_hit)
        req.note_admitted(num_hit + ext)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        start = num_hit + ext
        req.num_computed_tokens = start
        req.status = RequestStatus.RUNNING
        self._admit(req)
        self._take_rows(req, start, num_new)
        scheduled.append(ScheduledRequest(req, start, num_new, num_external_tokens=ext))
        return budget - num_new

    def _schedule_deferred(self, deferred: list[Request], scheduled: list[ScheduledRequest],
                           out: SchedulerOutput) -> list[Request]:
        """Chunks of the long prefills held back from the running pass; returns those that
        sat this step out.

        Invariants (`cap` = `long_prefill_token_threshold` > 0):
        - `_yielded[r]` exists only for a running request `r` that has more than `cap`
          prompt tokens left and sat out every step since it last ran; it holds the
          scheduled tokens of those steps. Running a chunk, preemption and finishing drop it.
        - `r` is *due* once `_yielded[r] >= cap`: the running pass then serves it like any
          request (it may preempt), so it sits out at most `cap` tokens of steps in a row
          (plus the one step that crosses the mark); under a stream of short prompts it
          still gets about half of the worker.
        - Otherwise it runs here, after the waiting prompts, unless this step finishes some
          prompt's prefill (a CPU step costs in proportion to its tokens, so its chunk
          would delay that prompt's first token) or no budget is left: then it sits out.
        - Its victims are only requests behind it that did not run this step; with none
          left it sits out, unless nothing else runs this step: then it gives its own
          blocks back (preempted, like the running pass's last resort), so it cannot hold
          blocks that pins of others leave too few of while nothing moves.
        """
        if not deferred:
            return []
        cap = self.long_prefill_token_threshold
        finishing = any(s.samples and s.start < s.request.num_prompt_tokens
                        for s in scheduled)
        ran = {s.request.request_id for s in scheduled}
        yielding = []
        for req in deferred:
            if req.status is not RequestStatus.RUNNING:
                continue
            budget = self._left(scheduled)
            if finishing or budget <= 0:
                yielding.append(req)
                continue
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, min(cap, budget), req)
            if num_new and self._make_room_deferred(req, num_new, ran, out):
                self._take_rows(req, req.num_computed_tokens, num_new)
                scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
                ran.add(req.request_id)
                self._yielded.pop(req.request_id, None)
            else:
                yielding.append(req)
        return yielding

    def _left(self, scheduled: list[ScheduledRequest]) -> int:
        return self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)

    def update_after_step(self, out: SchedulerOutput,
                          accepted: Mapping[str, Sequence[int]] | None = None) -> None:
        """The step's forward completed: advance every scheduled request's progress (before
        sampled tokens are appended) and register the blocks it completed in the prefix
        cache. `accepted`: request id -> its verified drafts; the KV of the rejected ones is
        rolled back (not computed: overwritten by a later step, never cached). Requests
        finished since the step was scheduled are skipped (their blocks are freed)."""
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # async_scheduling: ended by the previous step's tokens
                continue
            self.tokens_loaded += s.num_external_tokens
            self.tokens_computed += s.num_new_tokens
            rejected = len(s.spec_token_ids) - len((accepted or {}).get(req.request_id, ()))
            req.num_computed_tokens = s.start + s.num_new_tokens - rejected
            req.note_computed(s.start, req.num_computed_tokens)
            self.kv.commit_computed(req)
