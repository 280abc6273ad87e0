"""The engine's request lifecycle without a model: admission, steps, aborts and failures.

`EngineCore` owns the scheduler (and through it the KV manager), the output processor and a
`Runner` (anything with `execute` and `release`); `LLMEngine` builds the model and its
`ModelRunner` and inherits the rest. Tests drive the core with fake runners. Torch-free.

One step: schedule → `runner.execute` → on success `update_after_step` (progress, then the
completed blocks join the prefix cache) → sampled tokens, stop checks, outputs. A step whose
forward raises fails exactly the requests it ran (finish reason "error"); nothing it was
about to compute reaches the cache, and the engine goes on with the others.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tandem.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    UnknownAdapterError,
)
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.lora.request import LoRARequest, LoRAState
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request, RequestStatus, TokenizedPrompt
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tandem.engine.spec_decode.speculator import Speculator
from tandem.protocol.block_hash import request_hash_keys
from tandem.protocol.kv_events import KVEvent

if TYPE_CHECKING:
    from tandem.engine.lora.manager import LoRAManager
    from tandem.engine.lora.peft import LoRAAdapter

logger = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = 1 << 20  # hard bound on what a client can hand us, before model limits


@dataclass
class RunnerOutput:
    """What one forward produced, by engine request id."""

    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # request id -> logprob entries for the prompt tokens this step covered, in order from
    # the request's `prompt_logprobs_pos`
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # speculative decoding: request id -> the verified drafts that precede `sampled[rid]`
    # (emitted in order before it), and their logprob entries when logprobs are wanted
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # request id -> [n, H] hidden states of the positions that gave its tokens (only when a
    # proposer reads them): torch tensors, opaque here
    hidden_states: dict[str, object] = field(default_factory=dict)


class Runner(Protocol):
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step's forward and sample; raise to fail the step."""

    def release(self, request_id: str) -> None:
        """Forget per-request state (its generator) once the request is finished."""


@dataclass(frozen=True)
class EngineState:
    """Values discovered at start-up (never written back into `EngineConfig`)."""

    model_path: str
    model_name: str  # served name; also the model key of every block hash
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_block: int  # all layers, K and V
    vocab_size: int
    model_memory_bytes: int = 0  # resident weight bytes (quant.apply.model_memory_bytes)
    quantization: str | None = None  # EngineConfig.quantization
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up at first admissions (cumulative)
    prefix_cache_hits: int  # of which hit (cumulative)
    num_preemptions: int  # cumulative
    prompt_tokens: int  # prompt tokens of requests that produced a token (cumulative)
    generation_tokens: int  # tokens sampled (cumulative)
    kv_unused_slots: int  # slots held by running requests beyond their computed tokens
    in_flight_tokens: int  # prompt + generated tokens of running and waiting requests
    # speculative decoding (cumulative; vLLM's vllm:spec_decode_* counters)
    spec_num_drafts: int = 0  # verifications: requests x steps that carried drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # accepted drafts at position 0 .. k-1
    # multi-LoRA (vLLM's vllm:lora_requests_info): adapters of running / waiting requests
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    lora_resident: tuple[str, ...] = ()  # in device slots, least recently used first
    lora_adapters: tuple[str, ...] = ()  # every adapter a request may name
    max_loras: int = 0  # 0: LoRA off
    lora_state: LoRAState | None = None  # the adapters' digests and version (None: LoRA off)


class EngineCore:
    def __init__(self, state: EngineState, scheduler: Scheduler, runner: Runner,
                 outputs: OutputProcessor, eos_token_ids: tuple[int, ...] = (),
                 speculator: Speculator | None = None) -> None:
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
        self._generation_tokens = 0
        # True when the latest `step` could schedule nothing: only a command (an abort, a
        # release of pinned blocks, a new request) can change that, so callers wait for one
        self.last_step_idle = False
        self.lora: LoRAManager | None = None  # set by LLMEngine with enable_lora

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
                    lora_request: LoRARequest | str | None = None) -> list[int]:
        """Validate and queue a request; returns its prompt token ids. `keep_blocks`: when it
        finishes normally its KV blocks stay pinned until `kv.release_kept(request_id)` (the
        source of a KV transfer). A `TokenizedPrompt` (from `process_prompt`) is not
        tokenized or checked again.

        Raises `InvalidRequestError` (bad input) or `QueueFullError` (back-pressure).
        """
        params = params or SamplingParams()
        params.validate()
        if self.outputs.has(request_id):
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
        if cdiv(len(ids) + max_tokens, self.state.block_size) > self.state.num_kv_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens ({len(ids) + max_tokens} tokens) exceeds the KV cache "
                f"capacity of {self.state.num_kv_blocks * self.state.block_size} tokens",
                "max_tokens")
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
        self.outputs.add(request_id, tokenized.text, children)
        for child in children:
            self.scheduler.add_request(child)
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Abort a user request (all its samples) and free its blocks at once."""
        if not self.outputs.has(request_id):
            return False
        for child in self.outputs.children(request_id):
            if not child.is_finished:
                self._finish(child, RequestStatus.FINISHED_ABORTED)
        self._pending.append(self.outputs.make_output(request_id))
        return True

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self.runner.release(req.request_id)
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        if self.lora is not None and req.lora_name in self.lora.retiring:
            self._reap_loras()  # its last request may just have ended

    def _fail(self, parent_ids: dict[str, None], message: str) -> list[RequestOutput]:
        """End every sample of the given user requests with an error; their outputs."""
        outs = []
        for pid in parent_ids:
            for child in self.outputs.children(pid):
                if not child.is_finished:
                    self._finish(child, RequestStatus.FINISHED_ERROR)
            self.outputs.fail(pid, message)
            outs.append(self.outputs.make_output(pid))
        return outs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with an error (the engine cannot go on)."""
        parents = {(r.parent_id or r.request_id): None
                   for r in [*self.scheduler.running, *self.scheduler.waiting_requests()]}
        outs, self._pending = self._pending, []
        return outs + self._fail(parents, message)

    # -- stepping ----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return outputs of requests that progressed, finished or aborted."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self.last_step_idle = sched.is_empty
        if sched.is_empty:
            return outputs
        try:
            t0 = time.perf_counter()
            result = self.runner.execute(sched)
            took = time.perf_counter() - t0
        except EngineDeadError:  # nothing can run any more: the caller fails everything
            raise
        except Exception as exc:  # one bad batch must not kill the loop
            logger.exception("step failed; failing %d requests", len(sched.scheduled))
            parents = {(s.request.parent_id or s.request.request_id): None
                       for s in sched.scheduled}
            outputs.extend(self._fail(parents, f"internal error: {type(exc).__name__}"))
            return outputs
        self.scheduler.update_after_step(sched, result.accepted)
        touched: dict[str, None] = {}
        failed: dict[str, None] = {}
        now = time.monotonic()
        for s in sched.scheduled:
            pid = s.request.parent_id or s.request.request_id
            if pid in failed:
                continue
            try:
                if self._commit_outputs(s, result, now):
                    touched[pid] = None
            except Exception:  # a bug in one request's output path fails that request only
                logger.exception("[%s] output processing failed", s.request.request_id)
                failed[pid] = None
        outputs.extend(self.outputs.make_output(pid) for pid in touched if pid not in failed)
        outputs.extend(self._fail(failed, "internal error while processing outputs"))
        if self.speculator is not None:
            try:
                self.speculator.observe_step(took, sched.num_batched_tokens)
                self.speculator.propose(self.scheduler.running, result.hidden_states)
            except Exception:  # a proposer bug costs speed, never requests
                logger.exception("speculative proposal failed; this step proposes nothing")
                for req in self.scheduler.running:
                    req.spec_token_ids, req.spec_draft_probs = [], None
        return outputs

    def _commit_outputs(self, s: ScheduledRequest, result: RunnerOutput, now: float) -> bool:
        """Take one scheduled request's results; True when it has an output to report."""
        req = s.request
        entries = result.prompt_logprobs.get(req.request_id)
        if entries:
            self.outputs.add_prompt_logprobs(req, entries)
            req.advance_prompt_logprobs(len(entries))
        if not s.samples:
            return False
        rid = req.request_id
        drafts = result.accepted.get(rid, [])
        if s.spec_token_ids and self.speculator is not None:
            self.speculator.record(rid, len(s.spec_token_ids), len(drafts))
        draft_lps = result.accepted_logprobs.get(rid)
        # verified drafts, then the sampled token; a stop inside the run drops the rest
        for i, token in enumerate([*drafts, result.sampled[rid]]):
            lp = (result.logprobs.get(rid) if i == len(drafts)
                  else draft_lps[i] if draft_lps else None)
            req.append_output_token(token)
            self._generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
                self._prompt_tokens += req.num_prompt_tokens
            status = self.outputs.process_token(req, token, lp)
            if status is not None:
                self._finish(req, status)
                break
        return True

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(), num_free_blocks=self.kv.pool.num_free_blocks(),
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            kv_unused_slots=self.kv.unused_slots(self.scheduler.running),
            in_flight_tokens=self.scheduler.num_unfinished_tokens(), **self._spec_stats(),
            **self._lora_stats())

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
        return self.kv.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()
