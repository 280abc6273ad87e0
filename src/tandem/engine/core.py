"""The engine's request lifecycle without a model: admission, steps, aborts and failures.

`EngineCore` owns the scheduler (and through it the KV manager), the output processor and a
`Runner` (anything with `execute` and `release`); `LLMEngine` builds the model and its
`ModelRunner` and inherits the rest. Tests drive the core with fake runners. Torch-free.

One step: schedule → `runner.execute` → on success `update_after_step` (progress, then the
completed blocks join the prefix cache) → sampled tokens, stop checks, outputs. A step whose
forward raises fails exactly the requests it ran (finish reason "error"); nothing it was
about to compute reaches the cache, and the engine goes on with the others.

With `async_scheduling` (vLLM's flag) the engine thread keeps only what decides the next
schedule: it commits token ids, applies the token-id stops (EOS, stop tokens, `max_tokens`,
`min_tokens`) and frees blocks, then hands the step's `OutputOp`s to an output thread that
detokenizes, checks stop strings and assembles the `RequestOutput`s while the next step
runs (torch releases the GIL in its kernels). A stop string found there ends its sample in
the outputs at once and in the engine at the next step boundary; the tokens computed past
it are dropped. Outputs equal the serial loop's, token for token; `step()` returns the
previous step's outputs (or hands them to `output_sink` as soon as they are made).

With a runner that has `execute_async` (the model runner) the overlapped loop is also
optimistic, as vLLM's async scheduling: a step whose sampled ids can stay on the device is
committed at the next step. Its sampling requests that may go on get a placeholder token
(`Request.num_placeholders`; none for one whose in-flight token is its `max_tokens`-th), so
the next step is scheduled and launched (its input ids gathered on the device) before they
are known; then they are committed and their token-id stops applied. A request that
stopped there (EOS, stop ids, a stop string, an abort) has the next step's token dropped:
never emitted or counted, its blocks freed at once. Prompt logprobs, LoRA, `min_tokens`,
seeds and preemption run optimistically. A step resolves at once (its requests get no
placeholder) when any sampling row wants logprobs or a repetition, presence or frequency
penalty (they read output ids on the host), or under tensor parallelism; an engine with
speculative decoding (drafts and hidden states are read on the host) never runs
optimistically, as in vLLM's first version. A step whose sampling rows include one under
a structured-output grammar also resolves at once (its matchers advance on the host).

Structured outputs (`structured_manager.py`): a request's grammar compiles off this thread;
it waits unscheduled meanwhile (`_poll_grammars` at every step boundary hands out matchers
and fails the requests whose grammar cannot compile), each committed token advances its
sample's matcher, and a terminated grammar ends the sample ("stop").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.engine.core_types import (  # re-exported: the core's contracts
    EngineState,
    EngineStats,
    Runner,
    RunnerOutput,
    StepPathCount,
)
from tandem.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    UnknownAdapterError,
)
from tandem.engine.lora.request import LoRARequest
from tandem.engine.output_processor import (
    Applied,
    Emit,
    Ended,
    Failed,
    OutputOp,
    OutputProcessor,
    OutputThread,
    PromptLogprobs,
    Tokens,
    token_stop,
)
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request, RequestStatus, ResumeState, TokenizedPrompt
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tandem.engine.spec_decode.speculator import Speculator
from tandem.engine.step_costs import StepCosts, pending_prefill_tokens, split_tokens
from tandem.engine.structured_manager import (
    StructuredOutputManager,
    StructuredOutputsCore,
    accept_token,
)
from tandem.protocol.block_hash import request_hash_keys
from tandem.protocol.kv_events import KVEvent

if TYPE_CHECKING:
    from tandem.engine.kv_tiers.store import TierStore
    from tandem.engine.lora.manager import LoRAManager
    from tandem.engine.lora.peft import LoRAAdapter
    from tandem.engine.staging import PendingOutput

__all__ = ["EngineCore", "EngineState", "EngineStats", "Runner", "RunnerOutput",
           "StepPathCount"]
logger = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = 1 << 20  # hard bound on what a client can hand us, before model limits
GRAMMAR_WAIT_S = 0.005  # an otherwise idle step waits this long for a compiling grammar


class EngineCore(StructuredOutputsCore):
    def __init__(self, state: EngineState, scheduler: Scheduler, runner: Runner,
                 outputs: OutputProcessor, eos_token_ids: tuple[int, ...] = (),
                 speculator: Speculator | None = None, async_scheduling: bool = False,
                 structured_outputs_backend: str | None = None) -> None:
        self.state = state
        self.speculator = speculator  # None: no speculative decoding
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.runner = runner
        self.outputs = outputs
        self.tokenizer = outputs.tokenizer
        self.eos_token_ids = eos_token_ids
        self._pending: list[RequestOutput] = []  # outputs of aborted requests
        self._prompt_tokens = 0
        self.step_costs = StepCosts()  # measured step costs (GetLoad, the router's pick)
        self.kv_tiers: TierStore | None = None  # the KV offload connector's host/disk tiers
        self._step_split: tuple[int, int] | None = None  # the running step's work
        # user request id -> its samples, while one runs in the engine
        self._live: dict[str, list[Request]] = {}
        self.async_scheduling = async_scheduling
        self._ops: list[OutputOp] = []  # the output side's work of the coming step
        self._inflight: concurrent.futures.Future[Applied] | None = None
        self._out_lock = threading.Lock()  # the output processor: one thread at a time
        self._out_thread = OutputThread(outputs, self._out_lock)
        # async_scheduling: where the output thread hands outputs as soon as they are made
        # (any thread may call it); None: the next `step()` returns them
        self.output_sink: Callable[[list[RequestOutput]], None] | None = None
        # True when the latest `step` could schedule nothing: only a command (an abort, a
        # release of pinned blocks, a new request) can change that, so callers wait for one
        self.last_step_idle = False
        self.lora: LoRAManager | None = None  # set by LLMEngine with enable_lora
        # optimistic: the launched step whose sampled ids are still on the device, and the
        # requests of it that sample (None: none)
        # async_scheduling's optimistic path (on unless a benchmark turns it off to time
        # the output thread alone)
        self.optimistic = True
        self._deferred: tuple[SchedulerOutput, PendingOutput, list[bool]] | None = None
        self.optimistic_steps = 0  # steps committed after the next one was launched
        self.optimistic_dropped = 0  # their tokens dropped: the request had ended
        # structured outputs: grammars compile off this thread (built on first use)
        self._structured: StructuredOutputManager | None = None
        self.structured_outputs_backend = structured_outputs_backend  # None: the default

    def resolve_lora(self, lora: LoRARequest | str | None) -> str | None:
        """The adapter name a request runs with: a loaded adapter's name, or a
        `LoRARequest` (registered here on first use, from a local path: the offline API's
        caller is trusted). InvalidRequestError without enable_lora, UnknownAdapterError for
        a name that is not loaded."""
        if lora is None:
            return None
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters need enable_lora=True", "model")
        if isinstance(lora, LoRARequest):
            if not self.lora.has(lora.lora_name):
                if not lora.lora_path:
                    raise UnknownAdapterError(lora.lora_name)
                self.lora.add(lora, trusted=True)
            return lora.lora_name
        if not self.lora.has(lora):
            raise UnknownAdapterError(lora)
        return lora

    def load_lora(self, lora: LoRARequest, trusted: bool = False,
                  adapter: LoRAAdapter | None = None, fresh_id: bool = False) -> LoRARequest:
        """Register an adapter (`fresh_id`: under the next free `lora_int_id` instead of
        its own), read from disk unless `adapter` is it already (`LoRAManager.read`, off
        this thread); the registered request (path resolved, sha256 filled in). Errors as
        `LoRAManager.add`."""
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters need enable_lora=True", "lora_name")
        if fresh_id and not self.lora.has(lora.lora_name):
            lora = dataclasses.replace(lora, lora_int_id=self.lora.next_id())
            if adapter is not None:
                adapter = dataclasses.replace(adapter, int_id=lora.lora_int_id)
        self.lora.add(lora, trusted=trusted, adapter=adapter)
        return self.lora.registered[lora.lora_name]

    def unload_lora(self, name: str) -> bool:
        """Unload under traffic: new requests for `name` fail at once (UnknownAdapterError),
        those already queued or running finish with it; True when it was freed at once."""
        if self.lora is None:
            raise UnknownAdapterError(name)
        self.lora.retire(name)
        return bool(self._reap_loras())

    def _reap_loras(self) -> list[str]:
        if self.lora is None or not self.lora.retiring:
            return []
        return self.lora.reap({r.lora_name for r in self.scheduler.requests.values()})

    @property
    def _optimistic(self) -> bool:
        return (self.async_scheduling and self.optimistic and self.speculator is None
                and hasattr(self.runner, "execute_async"))

    # -- requests ----------------------------------------------------------------------------
    def process_prompt(self, prompt: str | list[int] | TokenizedPrompt) -> TokenizedPrompt:
        """Tokenize a text prompt or check a token-id prompt. Reads only immutable state, so
        servers call it from a thread pool, off the engine thread and the event loop.

        Raises `InvalidRequestError` naming `prompt`.
        """
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_TOKENS * 16:
                raise InvalidRequestError("prompt is too long", "prompt")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)):
            if len(prompt) > MAX_PROMPT_TOKENS:
                raise InvalidRequestError("prompt is too long", "prompt")
            vocab = self.state.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                   for t in prompt):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab})", "prompt")
            ids, text = list(prompt), None
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return TokenizedPrompt(ids, text)

    def add_request(self, request_id: str, prompt: str | list[int] | TokenizedPrompt,
                    params: SamplingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None, keep_blocks: bool = False,
                    lora_request: LoRARequest | str | None = None,
                    delta: bool = False, resume: ResumeState | None = None) -> list[int]:
        """Validate and queue a request; returns its prompt token ids. `keep_blocks`: when it
        finishes normally its KV blocks stay pinned until `kv.release_kept(request_id)` (the
        source of a KV transfer). A `TokenizedPrompt` (from `process_prompt`) is not
        tokenized or checked again. `delta`: its outputs carry only what is new
        (`OutputProcessor.use_deltas`).

        Raises `InvalidRequestError` (bad input) or `QueueFullError` (back-pressure).
        """
        params = params or SamplingParams()
        params.validate()
        if request_id in self._live or self.outputs.has(request_id):
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        tokenized = self.process_prompt(prompt)
        ids = tokenized.token_ids
        limit = self.state.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context window is {limit} tokens and at "
                "least one must be left to generate", "prompt")
        if params.max_tokens is None:
            max_tokens = limit - len(ids)
        elif len(ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context window of {limit} tokens", "max_tokens")
        else:
            max_tokens = params.max_tokens
        if resume is not None:
            self._check_resume(resume, params, len(ids), max_tokens)
        if keep_blocks and not self.kv.supports_keep:
            raise InvalidRequestError("this model's KV blocks cannot be kept for a transfer "
                                      "(its layers mix attention windows)", "kv_transfer")
        # a sliding-window model holds a bounded window of a request's blocks at once
        usable = self.kv.pool.num_usable_blocks
        if self.scheduler.max_blocks(len(ids) + max_tokens, keep_blocks) > usable:
            raise InvalidRequestError(
                f"prompt + max_tokens ({len(ids) + max_tokens} tokens) exceeds the KV cache "
                f"capacity of {self.kv.capacity_tokens(self.scheduler.max_num_batched_tokens)}"
                " tokens", "max_tokens")
        if not self.scheduler.can_admit(params.n):
            raise QueueFullError("the waiting queue is full; retry later")
        lora = self.resolve_lora(lora_request)
        # the adapter by the digest of its weights: a replaced adapter never hits old blocks
        keys = request_hash_keys(self.state.model_name,
                                 None if lora is None else self.lora.digest(lora), cache_salt)
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone_for_sample(i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if child_id in self.scheduler.requests:
                raise InvalidRequestError(f"duplicate request id {child_id!r}", "request_id")
            children.append(Request(child_id, ids, child_params, max_tokens, self.eos_token_ids,
                                    keys, lora, priority=priority, parent_id=request_id,
                                    sample_index=i, keep_kv=keep_blocks))
        if resume is not None:
            for t in resume.token_ids:
                children[0].append_output_token(t)
            children[0].num_replayed = len(resume.token_ids)
        if params.structured_outputs is not None:  # compiled off this thread; cached
            self.structured.add(children)
        with self._out_lock:
            if self.outputs.has(request_id):  # its last output is still being made
                if self._structured is not None:
                    for child in children:
                        self._structured.forget(child)
                raise InvalidRequestError(f"duplicate request id {request_id!r}",
                                          "request_id")
            self.outputs.add(request_id, tokenized.text, children)
            if resume is not None:
                self.outputs.resume(request_id, resume)
            if delta:
                self.outputs.use_deltas(request_id)
        self._live[request_id] = children
        for child in children:
            self.scheduler.add_request(child)
        return ids

    def _check_resume(self, resume: ResumeState, params: SamplingParams, num_prompt: int,
                      max_tokens: int) -> None:
        """A resumed request (`ResumeState`) continues one sample's output; InvalidRequestError
        naming `resume` otherwise."""
        k = len(resume.token_ids)
        vocab = self.state.vocab_size
        if params.n != 1 or params.prompt_logprobs is not None:
            raise InvalidRequestError("a resumed request has n == 1 and no prompt logprobs",
                                      "resume")
        if not 0 < k < max_tokens or num_prompt + k >= self.state.max_model_len:
            raise InvalidRequestError(f"{k} replayed tokens leave nothing to generate within "
                                      f"max_tokens ({max_tokens})", "resume")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
               for t in resume.token_ids):
            raise InvalidRequestError(f"replayed token ids must be integers in [0, {vocab})",
                                      "resume")
        if resume.sent_chars is not None and resume.sent_chars < 0:
            raise InvalidRequestError("sent_chars must be >= 0", "resume")

    def abort_request(self, request_id: str) -> bool:
        """Abort a user request (all its samples) and free its blocks at once."""
        children = self._live.get(request_id)
        if children is None:
            return False
        for child in children:
            if not child.is_finished:
                self._finish(child, RequestStatus.FINISHED_ABORTED)
                self._end(child, RequestStatus.FINISHED_ABORTED)
        self._emit(request_id)
        return True

    def _end(self, child: Request, status: RequestStatus) -> None:
        """Tell the output side the engine ended `child` without a token."""
        if self.async_scheduling:
            self._ops.append(Ended(child, status))
        else:
            self.outputs.end(child, status)

    def _emit(self, request_id: str) -> None:
        """The request's output is due: made now (serial) or by the output thread."""
        if self.async_scheduling:
            self._ops.append(Emit(request_id))
        elif self.outputs.has(request_id):
            self._pending.append(self.outputs.make_output(request_id))

    def _finish(self, req: Request, status: RequestStatus) -> None:
        pid = req.parent_id or req.request_id
        children = self._live.get(pid)
        if children is not None and all(c is req or c.is_finished for c in children):
            del self._live[pid]
        self.scheduler.finish(req, status)
        if req.grammar is not None and self._structured is not None:
            self._structured.forget(req)
        self.runner.release(req.request_id)
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        if self.lora is not None and req.lora_name in self.lora.retiring:
            self._reap_loras()  # its last request may just have ended

    def _fail(self, parent_ids: dict[str, None], message: str) -> None:
        """End every sample of the given user requests with an error; their outputs are
        due."""
        for pid in parent_ids:
            for child in self._live.get(pid, ()):
                if not child.is_finished:
                    self._finish(child, RequestStatus.FINISHED_ERROR)
                    self._end(child, RequestStatus.FINISHED_ERROR)
            if self.async_scheduling:
                self._ops.append(Failed(pid, message))
            elif self.outputs.has(pid):
                self.outputs.fail(pid, message)
            self._emit(pid)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with an error (the engine cannot go on)."""
        self._deferred = None  # its tokens are never emitted
        outs = self._drain() if self.async_scheduling else []
        parents = {(r.parent_id or r.request_id): None
                   for r in [*self.scheduler.running, *self.scheduler.waiting_requests()]}
        self._fail(parents, message)
        if self.async_scheduling:
            outs += self._apply(self._take_ops())
        outs += self._pending
        self._pending = []
        return outs

    # -- stepping ----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending) or bool(self._ops)
                or self._inflight is not None or self._deferred is not None)

    def expire_leases(self) -> bool:
        """End the page leases past their time (a reader that died: its pins end here); at
        every step, and by `AsyncLLMEngine` while the engine idles. True while leases
        remain."""
        for lease in self.kv.expire_leases():
            logger.info("[%s] lease expired: %d pages unpinned", lease.owner,
                        len(lease.block_ids))
        return self.kv.lease_stats().active > 0

    def step(self) -> list[RequestOutput]:
        """Run one batch; return outputs of requests that progressed, finished or aborted
        (with `async_scheduling`: those of the previous step, made while this one ran). A
        step that ran work feeds `step_costs` with its wall time."""
        t0 = time.perf_counter()
        self._step_split = None
        outputs = self._step()
        if self._step_split is not None:
            self.step_costs.observe(time.perf_counter() - t0, *self._step_split)
        return outputs

    def _step(self) -> list[RequestOutput]:
        self.expire_leases()
        grammars = self._poll_grammars()
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self._step_split = split_tokens(sched.scheduled)
        self.last_step_idle = sched.is_empty
        if sched.is_empty and grammars:
            # only compiling grammars can change that: wait a moment for one (a command
            # arriving meanwhile waits at most this long), then let the caller step again
            self._structured.wait(GRAMMAR_WAIT_S)  # type: ignore[union-attr]
            self.last_step_idle = False
        if sched.is_empty:
            if not self.async_scheduling:
                outputs, self._pending = self._pending, []
                return outputs
            # nothing to overlap with: finish the output side's work here (its stop strings
            # may free blocks, so the caller should not sleep on this step)
            self.last_step_idle = (self._inflight is None and not self._ops
                                   and self._deferred is None and not grammars)
            self._commit_deferred()
            return self._drain()
        if self.async_scheduling and self._ops:  # made while this step's forward runs
            self._inflight = self._out_thread.submit(self._take_ops(), self.output_sink)
        pending: PendingOutput | None = None
        try:
            t0 = time.perf_counter()
            if self._optimistic:
                pending = self.runner.execute_async(sched)  # type: ignore[attr-defined]
            else:
                result = self.runner.execute(sched)
            took = time.perf_counter() - t0
        except EngineDeadError:  # nothing can run any more: the caller fails everything
            raise
        except Exception as exc:  # one bad batch must not kill the loop
            logger.exception("step failed; failing %d requests", len(sched.scheduled))
            self._commit_deferred()  # the previous step's forward did complete
            parents = {(s.request.parent_id or s.request.request_id): None
                       for s in sched.scheduled}
            self._fail(parents, f"internal error: {type(exc).__name__}")
            return self._end_step()
        if pending is not None:
            self._commit_deferred()  # the previous step's ids, while this step runs
            if pending.deferred:
                self.scheduler.update_after_step(sched)
                self._defer(sched, pending)
                return self._end_step()
            result = pending.resolve()
        self.scheduler.update_after_step(sched, result.accepted)
        self._commit_step(sched, result)
        if self.speculator is not None:
            try:
                self.speculator.observe_step(took, sched.num_batched_tokens)
                self.speculator.propose(self.scheduler.running, result.hidden_states)
            except Exception:  # a proposer bug costs speed, never requests
                logger.exception("speculative proposal failed; this step proposes nothing")
                for req in self.scheduler.running:
                    req.spec_token_ids, req.spec_draft_probs = [], None
        return self._end_step()

    def _defer(self, sched: SchedulerOutput, pending: PendingOutput) -> None:
        """`sched` ran with its sampled ids left on the device: each sampling request that
        may go on gets a placeholder, so the next step computes its token before it is
        known; the ids are committed in the next step (`_commit_deferred`)."""
        samples = [s.samples for s in sched.scheduled]
        for s, sampled in zip(sched.scheduled, samples, strict=True):
            req = s.request
            if (sampled and not req.is_finished and req.status is RequestStatus.RUNNING
                    and req.num_output_tokens + 1 < req.max_tokens):
                req.num_placeholders = 1
        self._deferred = (sched, pending, samples)

    def _commit_deferred(self) -> None:
        """Commit the deferred step's tokens (waiting for their copy only): placeholders are
        replaced, token-id stops end their requests; the tokens of requests finished since
        (an abort, a stop string, a stop in this commit) are dropped."""
        if self._deferred is None:
            return
        sched, pending, samples = self._deferred
        self._deferred = None
        result = pending.resolve()
        self.optimistic_steps += 1
        for s in sched.scheduled:
            s.request.num_placeholders = 0
        self._commit_step(sched, result, samples)

    def _commit_step(self, sched: SchedulerOutput, result: RunnerOutput,
                     samples: list[bool] | None = None) -> None:
        """Each scheduled request's results (`_commit`), then the outputs of the parents
        that progressed. A request finished since it was
        scheduled (an abort, a stop in an earlier commit) is skipped, its token dropped;
        a request whose output path raises fails alone. `samples`: a deferred step's
        sampling flags as scheduled (None: a step committed as it ends)."""
        touched: dict[str, None] = {}
        failed: dict[str, None] = {}
        now = time.monotonic()
        for i, s in enumerate(sched.scheduled):
            pid = s.request.parent_id or s.request.request_id
            sampled = None if samples is None else samples[i]
            if pid in failed or s.request.is_finished:  # ended since it was scheduled
                if sampled:
                    self.optimistic_dropped += s.request.request_id in result.sampled
                continue
            try:
                if self._commit(s, result, now, sampled):
                    touched[pid] = None
            except Exception:  # a bug in one request's output path fails that request only
                logger.exception("[%s] output processing failed", s.request.request_id)
                failed[pid] = None
        for pid in touched:
            if pid not in failed:
                self._emit(pid)
        self._fail(failed, "internal error while processing outputs")

    def _end_step(self) -> list[RequestOutput]:
        """Serial: this step's outputs. Overlapped: the previous step's result, made by the
        output thread while this step ran (its stop strings end their samples here, before
        the next schedule); this step's ops wait for the next step's forward."""
        if not self.async_scheduling:
            outputs, self._pending = self._pending, []
            return outputs
        previous, self._inflight = self._inflight, None
        return [] if previous is None else self._settle(previous.result())

    def _take_ops(self) -> list[OutputOp]:
        ops, self._ops = self._ops, []
        return ops

    def _drain(self) -> list[RequestOutput]:
        """Overlapped loop: wait for the output thread, then run what is queued here."""
        outs: list[RequestOutput] = []
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            outs = self._settle(previous.result())
        if self._ops:
            outs += self._apply(self._take_ops())
        outs += self._pending
        self._pending = []
        return outs

    def _apply(self, ops: list[OutputOp]) -> list[RequestOutput]:
        """Run `ops` on this thread; their outputs."""
        with self._out_lock:
            done = self.outputs.apply(ops)
        return self._settle(done)

    def _settle(self, done: Applied) -> list[RequestOutput]:
        """End in the engine the samples the output side finished (a stop string; an
        error in their output path): the tokens computed past a stop are dropped."""
        for child, status in done.finished:
            if not child.is_finished:
                self._finish(child, status)
        return done.outputs

    def _commit(self, s: ScheduledRequest, result: RunnerOutput, now: float,
                samples: bool | None = None) -> bool:
        """Take one scheduled request's results; True when it has an output to report.
        Serial: every token goes through the output processor here (text, stop strings,
        logprobs). Overlapped: only token ids and token-id stops here, the rest queued for
        the output thread (`Tokens`, `PromptLogprobs`). `samples`: whether it sampled (as
        scheduled; default `s.samples`, which holds only until it gets a placeholder)."""
        req, overlapped = s.request, self.async_scheduling
        entries = result.prompt_logprobs.get(req.request_id)
        if entries:
            if overlapped:
                self._ops.append(PromptLogprobs(req, entries))
            else:
                self.outputs.add_prompt_logprobs(req, entries)
            req.advance_prompt_logprobs(len(entries))
        if not (s.samples if samples is None else samples):
            return False
        rid = req.request_id
        drafts = result.accepted.get(rid, [])
        if s.spec_token_ids and self.speculator is not None:
            self.speculator.record(rid, len(s.spec_token_ids), len(drafts))
        draft_lps = result.accepted_logprobs.get(rid)
        tokens: list[int] = []
        lps: list[dict[int, float] | None] = []
        # verified drafts, then the sampled token; a stop inside the run drops the rest
        for i, token in enumerate([*drafts, result.sampled[rid]]):
            lp = (result.logprobs.get(rid) if i == len(drafts)
                  else draft_lps[i] if draft_lps else None)
            req.append_output_token(token)
            if req.grammar is not None:  # its matcher follows the committed tokens
                accept_token(req, token)
            if req.first_token_time is None:
                req.first_token_time = now
                self._prompt_tokens += req.num_prompt_tokens
            if overlapped:
                tokens.append(token)
                lps.append(lp)
                status, stop_token = token_stop(req, token, req.num_output_tokens)
                if status is not None:
                    req.stop_reason = stop_token
            else:
                status = self.outputs.process_token(req, token, lp)
            if status is not None:
                self._finish(req, status)
                break
        if overlapped:
            self._ops.append(Tokens(req, tokens, lps))
        return True

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        leases = self.kv.lease_stats()
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(), num_free_blocks=self.kv.pool.num_free_blocks(),
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self._prompt_tokens,
            generation_tokens=self.outputs.generation_tokens,
            kv_unused_slots=self.kv.unused_slots(self.scheduler.running),
            in_flight_tokens=self.scheduler.num_unfinished_tokens(),
            prefill_s_per_token=self.step_costs.prefill_s_per_token,
            decode_step_s=self.step_costs.decode_step_s,
            pending_prefill_tokens=self._pending_prefill(),
            kv_leases_active=leases.active, kv_leases_released=leases.released,
            kv_leases_expired=leases.expired,
            kv_connector_loaded_tokens=self.scheduler.tokens_loaded,
            kv_window_freed_blocks=self.kv.window_freed_blocks, **self._spec_stats(),
            **self._lora_stats(), **self._tier_stats())

    def _tier_stats(self) -> dict[str, object]:
        tiers = self.kv_tiers
        if tiers is None:
            return {}
        return {"kv_tiers": tuple(tiers.stats()), "kv_block_bytes": tiers.block_bytes,
                "host_load_s_per_block": tiers.load_s_per_block.get("host", 0.0),
                "disk_load_s_per_block": tiers.load_s_per_block.get("disk", 0.0)}

    def _pending_prefill(self) -> int:
        """`step_costs.pending_prefill_tokens`, waiting requests' cached prefixes looked up
        in the prefix cache (when the KV pool has one)."""
        lookup = getattr(self.kv.pool, "get_cached_block", None)
        caching = lookup is not None and getattr(self.kv, "enable_caching", False)
        return pending_prefill_tokens(
            self.scheduler.running, self.scheduler.waiting_requests(),
            getattr(self.kv, "block_size", 0),
            (lambda h: lookup(h) is not None) if caching else None)

    def _lora_stats(self) -> dict[str, object]:
        if self.lora is None:
            return {}
        waiting = {r.lora_name for r in self.scheduler.waiting_requests()} - {None}
        state = self.lora.state
        return {"lora_running": tuple(sorted(self.scheduler.running_loras)),
                "lora_waiting": tuple(sorted(waiting)),  # type: ignore[type-var]
                "lora_resident": tuple(self.lora.resident()),
                "lora_adapters": tuple(state.names()), "max_loras": self.lora.num_slots,
                "lora_state": state}

    def _spec_stats(self) -> dict[str, object]:
        if self.speculator is None:
            return {}
        st = self.speculator.stats()
        return {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
                "spec_num_accepted_tokens": st.num_accepted_tokens,
                "spec_accepted_per_pos": st.accepted_per_pos}

    def take_kv_events(self) -> list[KVEvent]:
        events = self.kv.pool.take_events()
        if self.kv_tiers is not None:  # after the device's: an eviction, then its save
            events += self.kv_tiers.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()
