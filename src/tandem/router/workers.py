"""What the router knows about each worker: identity, health, load, circuit breaker.

Plain state, mutated only on the router's event loop. `Worker.id` is the worker's base URL.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

DEFAULT_BLOCK_SIZE = 16  # assumed until a worker reports its own (readiness or KV stream)


@dataclass
class WorkerLoad:
    """The worker's own view (gRPC `GetLoad`), refreshed every poll interval."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0  # [0, 1]
    in_flight_tokens: int = 0
    # multi-LoRA: adapters of running / waiting requests, adapters in device slots, slots
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    resident_loras: frozenset[str] = frozenset()
    max_loras: int = 0


class BreakerState(enum.Enum):
    CLOSED = "closed"  # normal
    OPEN = "open"  # failing: not routed to until `reopen_at`
    HALF_OPEN = "half_open"  # one trial request decides


@dataclass
class CircuitBreaker:
    """Opens after `threshold` consecutive failures; after `cooldown_s` lets one trial
    request through (half-open); a success closes it, a failure re-opens it."""

    threshold: int = 3
    cooldown_s: float = 5.0
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    reopen_at: float = 0.0
    trial_in_flight: bool = False

    def current(self, now: float) -> BreakerState:
        """The state as of `now` (an open breaker past its cooldown is half-open); pure."""
        if self.state is BreakerState.OPEN and now >= self.reopen_at:
            return BreakerState.HALF_OPEN
        return self.state

    def allows(self, now: float) -> bool:
        """May a request go to the worker at `now`? Pure: only `on_attempt` and the
        outcomes change the breaker (probes, /ready and /metrics may ask at any time)."""
        state = self.current(now)
        if state is BreakerState.HALF_OPEN:
            return not self.trial_in_flight
        return state is BreakerState.CLOSED

    def on_attempt(self, now: float) -> None:
        """A request is sent: past the cooldown it is the half-open trial."""
        if self.current(now) is BreakerState.HALF_OPEN:
            self.state = BreakerState.HALF_OPEN
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.trial_in_flight = False

    def on_failure(self, now: float) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.threshold:
            self.state = BreakerState.OPEN
            self.reopen_at = now + self.cooldown_s


@dataclass
class Worker:
    id: str  # base URL, e.g. http://10.0.0.7:8000
    model: str = ""  # served model name ("" until known)
    role: str = "both"  # both | prefill | decode
    grpc_target: str | None = None  # host:port of its gRPC Worker service, if any
    kv_transfer_backend: str | None = None  # how it fetches P/D pages (from /ready), if known
    kv_cache_dtype: str | None = None  # its KV cache's "auto" | "fp8" | "int8" (/ready), if known
    max_model_len: int | None = None  # its context length (from /ready or /v1/models)
    block_size: int | None = None  # from its KV event stream
    ready: bool = False  # last readiness probe answered 200
    events_connected: bool = False  # its KV event stream is live (precise routing)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    local_in_flight: int = 0  # requests this router has open on it
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    # LoRA adapters a request may name here (its /ready and load reports; served on `model`)
    lora_adapters: frozenset[str] = frozenset()
    lora_slots: int = 0  # its max_loras (0: LoRA off or not reported)

    def serves(self, model: str) -> bool:
        """`model` is its base model or one of its adapters."""
        return bool(model) and (model == self.model or model in self.lora_adapters)

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block: the worker's own, else DEFAULT_BLOCK_SIZE."""
        return self.block_size or DEFAULT_BLOCK_SIZE

    @property
    def queue_depth(self) -> int:
        """Requests on the worker: its reported running + waiting, or this router's own
        open requests if higher (they are counted at once, the poll lags)."""
        return max(self.load.num_running + self.load.num_waiting, self.local_in_flight)

    def routable(self, now: float) -> bool:
        return self.ready and self.breaker.allows(now)
