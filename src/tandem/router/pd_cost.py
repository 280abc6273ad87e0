"""The cost-based P/D decision (`--pd-decision cost`): prefill a request on a prefill worker
only when that is estimated to cost less than prefilling it on its decode worker.

Estimates, in seconds, from the rates the workers measure (`WorkerLoad`):

* disaggregated TTFT `remote_s = ahead(P) x r_P + u_P x r_P + transfer + step_D`: the tokens
  the prefill worker P computes before this prompt is done (its `pending_prefill_tokens`,
  plus what this router sent it since its last load report, `PrefillLedger`; with P's
  per-request chunk cap a short prompt waits for one capped chunk of each request ahead, not
  for their whole prompts: `ahead`), this prompt's tokens P lacks at P's `prefill_s_per_token`,
  the page transfer (blocks x the decode worker's measured `peer_pull_s_per_block`, else
  `kv_block_bytes` / `TRANSFER_BYTES_PER_S`, else `PRIOR_BLOCK_S`), and the decode worker's
  step computing the last token (`decode_step_s`);
* local TTFT `local_s = ahead(D) x r_D + u_D x r_D + step_D` on the decode worker D;
* what the local prefill costs D's running streams: each of them waits `u_D x r_D` longer
  for its next token, `itl_cost_s = itl_weight x streams x u_D x r_D`.

Disaggregate when `remote_s <= local_s + itl_cost_s`: the remote TTFT may exceed the local
one by at most the stall it spares the running streams (weighted), and a local prefill is
chosen only when its TTFT plus that stall is lower. Aggregated, the reason names why:
`prefill_backlog` (P's queue alone makes the difference: without it the request would be
disaggregated) or `local_faster` (even an idle P would not win, e.g. a slow transfer or a
slower P). A prompt lacking more than `pd_max_local_prefill` tokens is never prefilled
locally.

The stall budget (`pd_stall_budget` b > 0): each local prefill stalls the decode worker's
next `ceil(u_D / chunk)` steps (chunk: its per-request cap, else its step's token budget,
else the whole prompt), and every stream running then gets one long gap per stalled step.
Whatever the number of streams, the share of the decode worker's inter-token gaps that are
stalls is the share of its steps that carry a local prefill, so the gap percentiles above
`1 - b` are protected exactly when that share stays at most b. `StallLedger` keeps, per
decode worker, the steps its local prefills stalled in the last `STALL_WINDOW_S` (x its
measured `decode_step_s`, over the window); a local verdict that would take the share past
b while the worker has running streams is overruled (disaggregated, `over_budget`). An
idle decode worker (no stream to stall) prefills locally whatever its budget.

A prefill worker that has not measured its rate yet: no verdict (the caller uses the
threshold rule); a decode worker that has prefilled nothing yet is costed at P's rate (the
same model). All inputs are bounded (`workers.bounded_costs`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tandem.router.workers import Worker, WorkerLoad

TRANSFER_BYTES_PER_S = 1.0e9  # prior: gRPC pages measured at 1.07-2.13 GB/s (bench/kvtransfer)
PRIOR_BLOCK_S = 1e-3  # prior per block when its size is not reported: ~1 MiB at 1 GB/s
LEDGER_TTL_S = 5.0  # a send not seen in a load report within this long is forgotten
LEDGER_MAX = 1024  # sends remembered per prefill worker
STALL_WINDOW_S = 30.0  # the stall budget's window
STALL_MAX = 4096  # local prefills remembered per decode worker


@dataclass(frozen=True)
class Estimate:
    """One request's costed options, in seconds, and the verdict."""

    remote_s: float  # TTFT if disaggregated
    local_s: float  # TTFT if prefilled on the decode worker
    itl_cost_s: float  # the local prefill's weighted stall of the decode worker's streams
    backlog_s: float  # the part of remote_s spent waiting for the prefill worker's queue
    disaggregate: bool
    reason: str = ""  # aggregated: prefill_backlog | local_faster; disaggregated: ""
    over_budget: bool = False  # disaggregated although local won: the stall budget is spent
    stalled_steps: int = 0  # decode steps a local prefill would stall


class PrefillLedger:
    """Prompt tokens this router sent each prefill worker that its last load report cannot
    count yet: kept until the worker's `load` object is replaced (a new report) or for
    LEDGER_TTL_S, at most LEDGER_MAX per worker."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[WorkerLoad, deque[tuple[float, int]]]] = {}

    def record(self, worker: Worker, tokens: int, now: float) -> None:
        self._entries(worker, now).append((now, max(tokens, 0)))

    def unseen(self, worker: Worker, now: float) -> tuple[int, int]:
        """(tokens, requests) sent to `worker` since its last load report."""
        sends = self._entries(worker, now)
        return sum(t for _, t in sends), len(sends)

    def _entries(self, worker: Worker, now: float) -> deque[tuple[float, int]]:
        held = self._sent.get(worker.id)
        if held is None or held[0] is not worker.load:
            held = self._sent[worker.id] = (worker.load, deque(maxlen=LEDGER_MAX))
        sends = held[1]
        while sends and now - sends[0][0] > LEDGER_TTL_S:
            sends.popleft()
        return sends

    def forget(self, worker_id: str) -> None:
        self._sent.pop(worker_id, None)


class StallLedger:
    """Per decode worker, the local prefills this router sent it (their stalled steps) in
    the last STALL_WINDOW_S, at most STALL_MAX: the share of its steps they stall."""

    def __init__(self) -> None:
        self._sent: dict[str, deque[tuple[float, int]]] = {}

    def record(self, worker: Worker, steps: int, now: float) -> None:
        self._entries(worker.id, now).append((now, max(steps, 0)))

    def share(self, worker: Worker, now: float) -> float:
        """The share of `worker`'s steps (at its measured step time; none measured: 0) that
        the recorded local prefills stall over the window."""
        step = worker.load.decode_step_s
        if step <= 0:
            return 0.0
        steps = sum(n for _, n in self._entries(worker.id, now))
        return steps * step / STALL_WINDOW_S

    def _entries(self, worker_id: str, now: float) -> deque[tuple[float, int]]:
        sends = self._sent.get(worker_id)
        if sends is None:
            sends = self._sent[worker_id] = deque(maxlen=STALL_MAX)
        while sends and now - sends[0][0] > STALL_WINDOW_S:
            sends.popleft()
        return sends

    def forget(self, worker_id: str) -> None:
        self._sent.pop(worker_id, None)


def stalled_steps(decode: Worker, tokens: int) -> int:
    """Decode steps a local prefill of `tokens` stalls: one per chunk (the worker's
    per-request cap, else its step's token budget, else the whole prompt in one)."""
    if tokens <= 0:
        return 0
    chunk = decode.prefill_chunk_cap or decode.max_batched_tokens or tokens
    if decode.max_batched_tokens:
        chunk = min(chunk, decode.max_batched_tokens)
    return math.ceil(tokens / max(chunk, 1))


def ahead_tokens(backlog: int, others: int, own: int, chunk_cap: int | None,
                 batch_tokens: int | None) -> int:
    """Tokens a worker computes for the requests ahead before a prompt of `own` tokens is
    done. Without a per-request chunk cap (None or 0: first come, first served) the whole
    `backlog`; with cap `c` the prompt runs in ceil(own / c) steps beside the `others`
    requests, each of which advances at most `c` tokens a step (and all of them at most
    the step's `batch_tokens` budget less this prompt's chunk)."""
    if not chunk_cap or own <= 0:
        return backlog
    steps = math.ceil(own / chunk_cap)
    per_step = chunk_cap * max(others, 0)
    if batch_tokens:
        per_step = min(per_step, max(batch_tokens - min(own, chunk_cap), 0))
    return min(backlog, steps * per_step)


def transfer_s(decode: Worker, blocks: int) -> float:
    """Seconds to move `blocks` KV blocks to `decode`: its measured per-block pull cost,
    else the reported block size over TRANSFER_BYTES_PER_S, else PRIOR_BLOCK_S a block."""
    load = decode.load
    if load.peer_pull_s_per_block > 0:
        return blocks * load.peer_pull_s_per_block
    if load.kv_block_bytes > 0:
        return blocks * load.kv_block_bytes / TRANSFER_BYTES_PER_S
    return blocks * PRIOR_BLOCK_S


def estimate(decode: Worker, prefill: Worker, uncached_decode: int, uncached_prefill: int,
             unseen: tuple[int, int], itl_weight: float, max_local: int = 0,
             stall_share: float = 0.0, stall_budget: float = 0.0) -> Estimate | None:
    """The costed options for one request (module doc); None while the prefill worker has
    not measured its prefill rate. `uncached_*`: prompt tokens each worker lacks; `unseen`:
    (tokens, requests) sent to `prefill` since its last load report; `max_local` > 0: a
    prompt lacking more tokens than that is never prefilled locally; `stall_budget` > 0:
    the share of the decode worker's steps local prefills may stall while it has streams,
    of which `stall_share` is spent (`StallLedger.share`)."""
    p, d = prefill.load, decode.load
    r_p = p.prefill_s_per_token
    if r_p <= 0:
        return None
    r_d = d.prefill_s_per_token or r_p
    step_d = d.decode_step_s
    sent_tokens, sent_requests = unseen
    backlog = ahead_tokens(p.pending_prefill_tokens + sent_tokens,
                           p.num_running + p.num_waiting + sent_requests, uncached_prefill,
                           prefill.prefill_chunk_cap, prefill.max_batched_tokens)
    backlog_s = backlog * r_p
    blocks = math.ceil(uncached_prefill / decode.kv_block_size)
    remote = backlog_s + uncached_prefill * r_p + transfer_s(decode, blocks) + step_d
    unseen_d = max(decode.local_in_flight - d.num_running - d.num_waiting, 0)
    local_ahead = ahead_tokens(d.pending_prefill_tokens, d.num_running + d.num_waiting,
                               uncached_decode, decode.prefill_chunk_cap,
                               decode.max_batched_tokens)
    stall = uncached_decode * r_d
    local = local_ahead * r_d + stall + step_d
    streams = d.num_running + unseen_d
    itl_cost = itl_weight * streams * stall
    steps = stalled_steps(decode, uncached_decode)
    if remote <= local + itl_cost or 0 < max_local < uncached_decode:
        return Estimate(remote, local, itl_cost, backlog_s, True, stalled_steps=steps)
    if stall_budget > 0 and streams > 0 and d.decode_step_s > 0 \
            and stall_share + steps * d.decode_step_s / STALL_WINDOW_S > stall_budget:
        return Estimate(remote, local, itl_cost, backlog_s, True, over_budget=True,
                        stalled_steps=steps)
    reason = "prefill_backlog" if remote - backlog_s <= local + itl_cost else "local_faster"
    return Estimate(remote, local, itl_cost, backlog_s, False, reason, stalled_steps=steps)
