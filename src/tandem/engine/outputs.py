"""Result objects returned by the engine and the offline API (shaped like vLLM's)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

# {token_id: logprob} for the chosen token plus the top-k alternatives, one dict per position
LogprobsList = list[dict[int, float]]


class TokenPrefix(Sequence[int]):
    """The first `n` ids of an append-only list, made in O(1): a running request's output
    ids in each step's `RequestOutput`, so a step costs no copy of every request's whole
    output. Stable while the list only grows; `==` compares with any list or tuple;
    `list(view)` copies. Finished outputs carry a plain list."""

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
