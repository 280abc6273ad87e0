"""Per-sample detokenization and stop checks; assembles `RequestOutput`s per user request.

The processor keeps its own view of every sample (its token ids, its finish status), fed
token by token, so it never reads what the engine thread mutates: the serial loop feeds it
inline, the overlapped loop (`async_scheduling`) feeds it a step's `OutputOp`s on the
output thread while the next step runs (`apply`). Token-id stops (EOS, `stop_token_ids`,
`max_tokens`) are decided here and by the engine alike (`token_stop`); a stop string only
here: `apply` reports it so the engine ends that sample at its next step boundary, and the
tokens the engine computed past it are dropped (never counted, never shown).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.engine.outputs import CompletionOutput, RequestOutput, TokenPrefix
from tandem.engine.request import Request, RequestStatus, ResumeState
from tandem.protocol.detokenizer import IncrementalDetokenizer
from tandem.protocol.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def token_stop(child: Request, token_id: int, num_output_tokens: int
               ) -> tuple[RequestStatus | None, int | None]:
    """The finish a token-id rule gives `child` after its `num_output_tokens`-th output
    token `token_id`, and the stop token id that matched (vLLM's rules: EOS and stop
    tokens count from the `min_tokens`-th output token on; then `max_tokens`). A structured
    output ends ("stop") at the token that terminated its grammar (a stop token the grammar
    allowed: never in the text), whatever `min_tokens` and `ignore_eos` say. Stop strings
    are the output processor's."""
    params = child.sampling_params
    if num_output_tokens >= params.min_tokens:
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if not params.ignore_eos and token_id in child.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
    done_at = None if child.grammar is None else child.grammar.done_at
    if done_at is not None and num_output_tokens >= done_at:
        return RequestStatus.FINISHED_STOPPED, None
    if num_output_tokens >= child.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None


# -- what the engine thread hands the output side, in order (the overlapped loop) ---------------
@dataclass(frozen=True)
class Tokens:
    """Output tokens of one sample from one step (verified drafts, then the sampled token),
    with their logprob entries (None each when not asked for)."""

    child: Request
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


@dataclass(frozen=True)
class PromptLogprobs:
    child: Request
    entries: list[dict[int, float]]


@dataclass(frozen=True)
class Ended:
    """The engine ended a sample without a token (abort, error)."""

    child: Request
    status: RequestStatus


@dataclass(frozen=True)
class Failed:
    request_id: str
    message: str


@dataclass(frozen=True)
class Emit:
    """Assemble the user request's output (if anything changed since the last one)."""

    request_id: str


OutputOp = Tokens | PromptLogprobs | Ended | Failed | Emit


@dataclass
class Applied:
    """What `apply` made: outputs in order, and the samples it finished itself (a stop
    string, or an error in their output path) with their status, for the engine to end."""

    outputs: list[RequestOutput] = field(default_factory=list)
    finished: list[tuple[Request, RequestStatus]] = field(default_factory=list)


@dataclass
class _SampleState:
    request: Request
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # output ids taken (this side's view)
    status: RequestStatus | None = None  # this side's finish (None: running)
    stop_reason: str | int | None = None
    text: str = ""
    sent_len: int = 0  # chars of text already reported as delta
    sent_tok: int = 0  # output ids already handed out (delta outputs)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    flushed: bool = False


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_SampleState]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
    hold_back: int = 0  # chars withheld while running: a stop string may still complete
    new_token_ids: list[int] = field(default_factory=list)
    delta: bool = False  # outputs carry only what is new (`use_deltas`)
    dirty: bool = True  # changed since its last output


class OutputProcessor:
    """Owns the text side of every live request (the scheduler owns the token side)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._child_parent: dict[str, str] = {}
        self.generation_tokens = 0  # output tokens taken, over all requests (cumulative)

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params
        samples = []
        for child in children:
            detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
            samples.append(_SampleState(
                child, detok, logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None))
            self._child_parent[child.request_id] = request_id
        stops = params.stop_strings
        self._parents[request_id] = _ParentState(
            request_id, prompt, list(children[0].prompt_token_ids), samples,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            hold_back=max((len(s) for s in stops), default=1) - 1)

    def resume(self, request_id: str, resume: ResumeState) -> None:
        """Sample 0 of `request_id` continues after `resume.token_ids` (added to its
        request already): they are its first output tokens (stop checks count them), the
        detokenizer continues from their text, and outputs start after the
        `resume.sent_chars` characters the client already has."""
        state = self._parents[request_id].samples[0]
        state.token_ids.extend(resume.token_ids)
        state.sent_tok = len(state.token_ids)
        # one push per token, as they were made: the same text to the character, even where
        # a decoder renders invalid UTF-8 differently in other chunkings
        state.text = "".join(state.detok.push([t]) for t in resume.token_ids)
        sent = len(state.text) if resume.sent_chars is None else resume.sent_chars
        state.sent_len = min(sent, len(state.text))

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def use_deltas(self, request_id: str) -> None:
        """From now on each output of `request_id` carries, per sample, only the text, ids
        and logprobs produced since its previous output (the final one too): no output
        copies what an earlier one carried, so what waits for a slow reader stays O(what it
        has not read). Logprob entries handed out are not kept here."""
        self._parents[request_id].delta = True

    def children(self, request_id: str) -> list[Request]:
        return [s.request for s in self._parents[request_id].samples]

    def add_prompt_logprobs(self, child: Request, entries: list[dict[int, float]]) -> None:
        parent = self._parents[self._child_parent[child.request_id]]
        if child.sample_index == 0 and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(entries)

    def process_token(self, child: Request, token_id: int,
                      logprobs: dict[int, float] | None) -> RequestStatus | None:
        """Take `child`'s next output token; its finish status, or None while it runs. A
        sample already finished here (a stop string the engine has not yet seen) drops the
        token and returns that status."""
        parent = self._parents[self._child_parent[child.request_id]]
        state = parent.samples[child.sample_index]
        if state.status is not None:
            return state.status
        parent.dirty = True
        state.token_ids.append(token_id)
        self.generation_tokens += 1
        params = child.sampling_params
        if child.sample_index == 0:
            parent.new_token_ids.append(token_id)
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(logprobs)
            state.cumulative_logprob = (state.cumulative_logprob or 0.0) + logprobs[token_id]
        n = len(state.token_ids)
        status, stop_token = token_stop(child, token_id, n)
        if status is RequestStatus.FINISHED_STOPPED:  # EOS or a stop token: not in the text
            state.status, state.stop_reason = status, stop_token
            return status
        delta = state.detok.push([token_id])
        if delta:
            state.text += delta
            if n >= params.min_tokens and params.stop_strings:
                status = self._check_stop_strings(state, len(delta)) or status
        state.status = status
        return status

    def end(self, child: Request, status: RequestStatus) -> None:
        """The engine ended `child` without a token (abort, error); a sample finished here
        already keeps its own status."""
        parent = self._parents.get(self._child_parent.get(child.request_id, ""))
        if parent is None:
            return
        state = parent.samples[child.sample_index]
        if state.status is None:
            state.status = status
            parent.dirty = True

    def apply(self, ops: Sequence[OutputOp]) -> Applied:
        """Run one step's ops in order (the overlapped loop's output thread). Ops of a
        request that already finished here are dropped; an error in one request's output
        path fails that request only."""
        done = Applied()
        failed: dict[str, None] = {}
        for op in ops:
            pid = (op.request_id if isinstance(op, (Failed, Emit))
                   else self._child_parent.get(op.child.request_id))
            if pid is None or pid not in self._parents or pid in failed:
                continue
            try:
                if isinstance(op, Tokens):
                    state = self._state(op.child)
                    if state.status is not None:  # tokens past a stop string: dropped
                        continue
                    for token, lp in zip(op.token_ids, op.logprobs, strict=True):
                        if self.process_token(op.child, token, lp) is not None:
                            break
                    if isinstance(state.stop_reason, str):  # the engine cannot know it
                        done.finished.append((op.child, RequestStatus.FINISHED_STOPPED))
                elif isinstance(op, PromptLogprobs):
                    self.add_prompt_logprobs(op.child, op.entries)
                elif isinstance(op, Ended):
                    self.end(op.child, op.status)
                elif isinstance(op, Failed):
                    self.fail(op.request_id, op.message)
                elif self._parents[pid].dirty:
                    done.outputs.append(self.make_output(pid))
            except Exception:  # a bug in one request's output path fails that request only
                logger.exception("[%s] output processing failed", pid)
                failed[pid] = None
        for pid in failed:
            for s in self._parents[pid].samples:
                if s.status is None:
                    s.status = RequestStatus.FINISHED_ERROR
                    done.finished.append((s.request, RequestStatus.FINISHED_ERROR))
            self.fail(pid, "internal error while processing outputs")
            done.outputs.append(self.make_output(pid))
        return done

    def _state(self, child: Request) -> _SampleState:
        return self._parents[self._child_parent[child.request_id]].samples[child.sample_index]

    @staticmethod
    def _check_stop_strings(state: _SampleState, delta_len: int) -> RequestStatus | None:
        params = state.request.sampling_params
        for stop in params.stop_strings:
            start = max(0, len(state.text) - delta_len - len(stop) + 1)
            idx = state.text.find(stop, start)
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                state.text = state.text[:end]
                state.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        return None

    def fail(self, request_id: str, message: str) -> None:
        """End the request's unfinished samples with an error carrying `message`."""
        parent = self._parents[request_id]
        parent.error = message
        parent.dirty = True
        for s in parent.samples:
            if s.status is None:
                s.status = RequestStatus.FINISHED_ERROR

    def make_output(self, request_id: str) -> RequestOutput:
        """The request's output (cumulative, or a delta after `use_deltas`); removes the
        request once every sample has finished."""
        parent = self._parents[request_id]
        outputs = []
        finished = all(s.status is not None for s in parent.samples)
        delta_text = ""
        for i, s in enumerate(parent.samples):
            done = s.status is not None
            if done and not s.flushed:
                s.flushed = True
                if not isinstance(s.stop_reason, str):  # a stop string already cut the text
                    s.text += s.detok.flush()
            visible = len(s.text) if done else max(s.sent_len, len(s.text) - parent.hold_back)
            new_text = s.text[s.sent_len:visible]
            if i == 0:
                delta_text = new_text
            s.sent_len = visible
            ids: Sequence[int]
            if parent.delta:
                text, ids, logprobs = new_text, s.token_ids[s.sent_tok:], s.logprobs
                s.sent_tok = len(s.token_ids)
                if logprobs is not None:
                    s.logprobs = []  # handed over, not copied
            else:
                text, logprobs = s.text[:visible], s.logprobs
                if logprobs is not None and not done:  # the list grows on: a stable view
                    logprobs = TokenPrefix(logprobs, len(logprobs))  # type: ignore[arg-type]
                ids = (list(s.token_ids) if done else
                       TokenPrefix(s.token_ids, len(s.token_ids)))
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=ids,
                finish_reason=s.status.value if s.status is not None else None,
                stop_reason=s.stop_reason, logprobs=logprobs,
                cumulative_logprob=s.cumulative_logprob))
        first = parent.samples[0].request
        queued = (None if first.first_scheduled_time is None
                  else first.first_scheduled_time - first.arrival_time)
        out = RequestOutput(
            request_id=request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=outputs, finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=max(parent.samples[0].request.num_cached_tokens, 0),
            error=parent.error, queue_time=queued,
            engine_time=time.monotonic() - first.arrival_time, delta_text=delta_text,
            delta_token_ids=parent.new_token_ids)
        parent.new_token_ids = []
        parent.dirty = False
        if finished:
            del self._parents[request_id]
            for s in parent.samples:
                self._child_parent.pop(s.request.request_id, None)
        return out


class OutputThread:
    """The overlapped loop's output side: `OutputProcessor.apply` of each submitted step's
    ops, in order, on one daemon thread (started on first use) under `lock`; a step's
    outputs go to `sink` when one is given (from this thread), else into its `Applied`."""

    def __init__(self, outputs: OutputProcessor, lock: threading.Lock) -> None:
        self.outputs = outputs
        self.lock = lock
        self._inbox: queue.SimpleQueue | None = None

    def submit(self, ops: list[OutputOp],
               sink: Callable[[list[RequestOutput]], None] | None = None
               ) -> concurrent.futures.Future[Applied]:
        fut: concurrent.futures.Future[Applied] = concurrent.futures.Future()
        if self._inbox is None:
            self._inbox = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(self._inbox,), name="tandem-outputs",
                             daemon=True).start()
        self._inbox.put((ops, sink, fut))
        return fut

    def _run(self, inbox: queue.SimpleQueue) -> None:
        while True:
            ops, sink, fut = inbox.get()
            try:
                with self.lock:
                    done = self.outputs.apply(ops)
                if sink is not None and done.outputs:
                    outs, done.outputs = done.outputs, []
                    sink(outs)
            except BaseException as exc:  # noqa: BLE001 - raised on the engine thread
                fut.set_exception(exc)
            else:
                fut.set_result(done)
