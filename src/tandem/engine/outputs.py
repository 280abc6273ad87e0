"""Result objects returned by the engine and the offline API (shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field

# {token_id: logprob} for the chosen token plus the top-k alternatives, one dict per position
LogprobsList = list[dict[int, float]]


@dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: list[int]
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
