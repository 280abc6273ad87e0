"""Per-sample detokenization and stop checks; assembles `RequestOutput`s per user request."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.engine.outputs import CompletionOutput, RequestOutput, TokenPrefix
from tandem.engine.request import Request, RequestStatus
from tandem.protocol.detokenizer import IncrementalDetokenizer
from tandem.protocol.tokenizer import Tokenizer


@dataclass
class _SampleState:
    request: Request
    detok: IncrementalDetokenizer
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


class OutputProcessor:
    """Owns the text side of every live request (the scheduler owns the token side)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._child_parent: dict[str, str] = {}

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
        """Account for a token already appended to `child`; return a finish status or None."""
        parent = self._parents[self._child_parent[child.request_id]]
        state = parent.samples[child.sample_index]
        params = child.sampling_params
        if child.sample_index == 0:
            parent.new_token_ids.append(token_id)
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(logprobs)
            state.cumulative_logprob = (state.cumulative_logprob or 0.0) + logprobs[token_id]
        # vLLM's rule: stops count from the min_tokens-th output token on (the sampler bans
        # EOS and stop tokens before it)
        may_stop = child.num_output_tokens >= params.min_tokens
        if may_stop and params.stop_token_ids and token_id in params.stop_token_ids:
            child.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if may_stop and not params.ignore_eos and token_id in child.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        delta = state.detok.push([token_id])
        if delta:
            state.text += delta
            if may_stop and params.stop_strings:
                status = self._check_stop_strings(state, len(delta))
                if status is not None:
                    return status
        if child.num_output_tokens >= child.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _check_stop_strings(state: _SampleState, delta_len: int) -> RequestStatus | None:
        params = state.request.sampling_params
        for stop in params.stop_strings:
            start = max(0, len(state.text) - delta_len - len(stop) + 1)
            idx = state.text.find(stop, start)
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                state.text = state.text[:end]
                state.request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        return None

    def fail(self, request_id: str, message: str) -> None:
        self._parents[request_id].error = message

    def make_output(self, request_id: str) -> RequestOutput:
        """The request's output (cumulative, or a delta after `use_deltas`); removes the
        request once every sample has finished."""
        parent = self._parents[request_id]
        outputs = []
        finished = all(s.request.is_finished for s in parent.samples)
        delta_text = ""
        for i, s in enumerate(parent.samples):
            req = s.request
            done = req.is_finished
            if done and not s.flushed:
                s.flushed = True
                if not isinstance(req.stop_reason, str):  # a stop string already cut the text
                    s.text += s.detok.flush()
            visible = len(s.text) if done else max(s.sent_len, len(s.text) - parent.hold_back)
            new_text = s.text[s.sent_len:visible]
            if i == 0:
                delta_text = new_text
            s.sent_len = visible
            ids: Sequence[int]
            if parent.delta:
                text, ids, logprobs = new_text, req.output_token_ids[s.sent_tok:], s.logprobs
                s.sent_tok = len(req.output_token_ids)
                if logprobs is not None:
                    s.logprobs = []  # handed over, not copied
            else:
                text, logprobs = s.text[:visible], s.logprobs
                ids = (list(req.output_token_ids) if done else
                       TokenPrefix(req.output_token_ids, len(req.output_token_ids)))
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=ids,
                finish_reason=req.status.value if done else None,
                stop_reason=req.stop_reason, logprobs=logprobs,
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
        if finished:
            del self._parents[request_id]
            for s in parent.samples:
                self._child_parent.pop(s.request.request_id, None)
        return out
