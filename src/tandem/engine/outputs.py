"""Result objects returned by the engine and the offline API (shaped like vLLM's)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

# {token_id: logprob} for the chosen token plus the top-k alternatives, one dict per position
LogprobsList = list[dict[int, float]]


class TokenPrefix(Sequence[int]):
    """The first `n` items of an append-only list, made in O(1): a running request's output
    ids (and logprob entries) in each step's `RequestOutput`, so a step costs no copy of
    every request's whole output. Stable while the list only grows (on another thread too:
    the overlapped loop's output thread appends while readers hold earlier views); `==`
    compares with any list or tuple; `list(view)` copies. Finished outputs carry a plain
    list."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int) -> None:
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step > 0:
                return self._ids[start:stop:step]
            return [self._ids[j] for j in range(start, stop, step)]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError("token index out of range")
        return self._ids[j]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenPrefix | list | tuple):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like list

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: Sequence[int]  # a list once finished; a `TokenPrefix` view while running
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: LogprobsList | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """State of a request after a step. Streaming consumers read the `delta` fields."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None  # first entry is None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when finish_reason == "error"
    queue_time: float | None = None  # seconds from arrival to first scheduling (sample 0)
    engine_time: float = 0.0  # seconds from the engine taking the request to this output
    delta_text: str = ""  # text produced by the latest step (single-sample requests)
    delta_token_ids: list[int] = field(default_factory=list)


def output_size(out: RequestOutput) -> int:
    """What `out` holds of its request's generated data, in items: characters of text plus
    token ids plus logprob entries, over its samples and its `delta_*` fields (the measure
    in which a request's pending outputs are bounded)."""
    size = len(out.delta_text) + len(out.delta_token_ids)
    for c in out.outputs:
        size += len(c.text) + len(c.token_ids) + (len(c.logprobs) if c.logprobs else 0)
    return size


class DeltaAccumulator:
    """Merges a request's delta outputs (each sample's new text, ids and logprobs since the
    previous output) into one: appended, never copied per output, so it holds O(what it was
    given); text pieces are joined once, by `take`. Also builds a delta request's whole
    result. The request-level fields are the newest output's (`queue_time`: the first
    known; `error`: the last set)."""

    __slots__ = ("_last", "_texts", "_ids", "_lps", "_delta_texts", "_delta_ids", "_queue_time",
                 "_error", "size")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._last: RequestOutput | None = None
        self._texts: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}
        self._lps: dict[int, LogprobsList | None] = {}
        self._delta_texts: list[str] = []
        self._delta_ids: list[int] = []
        self._queue_time: float | None = None
        self._error: str | None = None
        self.size = 0  # `output_size` of what `take` would return

    def __bool__(self) -> bool:
        return self._last is not None

    def add(self, out: RequestOutput) -> None:
        self._last = out
        for c in out.outputs:
            if c.text:
                self._texts.setdefault(c.index, []).append(c.text)
            self._ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self._lps.setdefault(c.index, []).extend(c.logprobs)  # type: ignore[union-attr]
            else:
                self._lps.setdefault(c.index, None)
        if out.delta_text:
            self._delta_texts.append(out.delta_text)
        self._delta_ids.extend(out.delta_token_ids)
        if self._queue_time is None:
            self._queue_time = out.queue_time
        self._error = out.error or self._error
        self.size += output_size(out)

    def take(self) -> RequestOutput | None:
        """The merged output (None if nothing was added); the accumulator is then empty."""
        last = self._last
        if last is None:
            return None
        outputs = [CompletionOutput(
            index=c.index, text="".join(self._texts.get(c.index, ())),
            token_ids=self._ids.get(c.index, []), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, logprobs=self._lps.get(c.index),
            cumulative_logprob=c.cumulative_logprob) for c in last.outputs]
        out = RequestOutput(
            request_id=last.request_id, prompt=last.prompt,
            prompt_token_ids=last.prompt_token_ids, outputs=outputs, finished=last.finished,
            prompt_logprobs=last.prompt_logprobs, num_cached_tokens=last.num_cached_tokens,
            error=self._error, queue_time=self._queue_time, engine_time=last.engine_time,
            delta_text="".join(self._delta_texts), delta_token_ids=self._delta_ids)
        self._reset()
        return out
