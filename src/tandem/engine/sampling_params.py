"""Per-request sampling parameters (vLLM-compatible names) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.errors import InvalidRequestError
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError

MAX_LOGPROBS = 20
MAX_N = 128
MAX_SEED = 2**63  # torch generators take 64-bit seeds; a larger one must not reach a step
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 512


@dataclass
class SamplingParams:
    """How to sample one request. `validate()` raises `InvalidRequestError(param=...)`."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 = off (prompt + output tokens)
    presence_penalty: float = 0.0  # [-2, 2] (output tokens)
    frequency_penalty: float = 0.0  # [-2, 2] (output tokens)
    seed: int | None = None  # per-request generator; same tokens regardless of batch
    max_tokens: int | None = 16  # None = up to the context window
    min_tokens: int = 0  # EOS / stop ids suppressed before this many tokens
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (<= 20)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (<= 20)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # False: this request never speculates (speculative_config)
    # grammar-constrained decoding (vLLM's `structured_outputs`): every sampled token is one
    # the grammar allows (engine/structured_manager.py); None: unconstrained
    structured_outputs: StructuredOutputs | None = None
    # with structured outputs and a reasoning model: the grammar applies only after these
    # ids (the reasoning parser's end tag, e.g. `</think>`) appear in the output (vLLM's
    # reasoning-aware structured outputs); None: from the first token (also when the
    # prompt already closed the thinking)
    reasoning_end_token_ids: tuple[int, ...] | None = None
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not self.temperature >= 0.0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not 0 <= self.seed < MAX_SEED):
            raise bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens",
                      f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"accepts at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise bad("stop", f"entries must be non-empty strings of at most "
                          f"{MAX_STOP_STRING_LEN} characters")
        self._stop = tuple(stop)
        if self.stop_token_ids is not None and (len(self.stop_token_ids) > 256 or any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        )):
            raise bad("stop_token_ids", "must be at most 256 non-negative integers")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", f"must be true or false, got {self.speculative!r}")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputs):
                raise bad("structured_outputs", "must be a StructuredOutputs, got "
                          f"{type(so).__name__}")
            try:
                so.validate()
            except StructuredOutputsError as exc:
                raise InvalidRequestError(str(exc), param="structured_outputs") from None
        end = self.reasoning_end_token_ids
        if end is not None:
            if (not isinstance(end, (tuple, list)) or not 1 <= len(end) <= 16
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in end)):
                raise bad("reasoning_end_token_ids", "must be 1 to 16 non-negative integers")
            self.reasoning_end_token_ids = tuple(end)

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Params for the `index`-th of n samples: n=1 and a derived seed when seeded."""
        seed = None if self.seed is None else (self.seed + index) % MAX_SEED
        return SamplingParams(**{**self._fields(), "n": 1, "seed": seed})

    def _fields(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
