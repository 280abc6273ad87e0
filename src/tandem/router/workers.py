"""What the router knows about each worker: identity, health, load, circuit breaker.

Plain state, mutated only on the router's event loop. `Worker.id` is the worker's base URL.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, KeysView, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

DEFAULT_BLOCK_SIZE = 16  # assumed until a worker reports its own (readiness or KV stream)
MAX_REPORTED_ADAPTERS = 4096  # adapters taken from one report
RETIRED_INSTANCES = 8  # engine instances of a worker remembered as gone (their reports: stale)
HashGroup = tuple[int, str]  # (KV block size, adapter digest): workers that hash alike


@dataclass(frozen=True)
class LoRAReport:
    """A worker's adapters as one report states them (`/ready`, `GetLoad`, a load or unload
    answer): name -> weight digest (the adapter's identity in block hashes), its slots, and
    the adapter set's version on engine `instance` (None: a worker that reports none)."""

    digests: Mapping[str, str]
    slots: int = 0
    instance: str = ""
    version: int | None = None

    @classmethod
    def reported(cls, digests: Mapping[Any, Any], slots: int = 0, instance: str = "",
                 version: int | None = None) -> LoRAReport:
        """A report as a worker states it, bounded: its first MAX_REPORTED_ADAPTERS
        adapters, digests and the instance id of at most 128 characters."""
        return cls(_digests(digests), slots, instance[:128], version)

    @classmethod
    def from_json(cls, obj: object, slots: int = 0,
                  names: object = None) -> LoRAReport | None:
        """From `/ready`'s or a load answer's `lora` object (`LoRAState.to_json`); without
        one, from a bare `lora_adapters` name list (`names`, unversioned); None when
        neither is well formed."""
        if isinstance(obj, dict) and isinstance(obj.get("adapters"), dict):
            version, instance = obj.get("version"), obj.get("instance")
            if (isinstance(version, int) and not isinstance(version, bool) and version >= 0
                    and isinstance(instance, str)):
                return cls.reported(obj["adapters"], slots, instance, version)
        if isinstance(names, list):
            return cls({n: "" for n in names[:MAX_REPORTED_ADAPTERS] if isinstance(n, str)},
                       slots)
        return None


def _digests(adapters: Mapping[Any, Any]) -> dict[str, str]:
    return {name: digest for name, digest in islice(adapters.items(), MAX_REPORTED_ADAPTERS)
            if isinstance(name, str) and isinstance(digest, str) and len(digest) <= 128}


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
    # measured costs (0.0: not reported yet; `bounded_costs` clamps what a worker states):
    # seconds of compute per prefill token, seconds of one decode-only step, and the prompt
    # tokens its waiting and partly prefilled running requests still need computed
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    pending_prefill_tokens: int = 0
    # measured KV load costs, seconds per block of every layer (0.0: not measured yet;
    # `bounded_load_costs`): from its host tier, its disk tier, pulled from a peer; and the
    # bytes of one such block (0: not reported)
    host_load_s_per_block: float = 0.0
    disk_load_s_per_block: float = 0.0
    peer_pull_s_per_block: float = 0.0
    kv_block_bytes: int = 0


MAX_LOAD_S_PER_BLOCK = 10.0  # slower than any real load of one block
MAX_KV_BLOCK_BYTES = 1 << 34


def bounded_load_costs(host: float, disk: float, peer: float, block_bytes: int
                       ) -> tuple[float, float, float, int]:
    """A worker's reported KV load costs made safe to compute with: NaN, infinite or
    negative -> 0 (unmeasured), the rest clamped to MAX_LOAD_S_PER_BLOCK and
    MAX_KV_BLOCK_BYTES."""
    return (_clamp(host, MAX_LOAD_S_PER_BLOCK), _clamp(disk, MAX_LOAD_S_PER_BLOCK),
            _clamp(peer, MAX_LOAD_S_PER_BLOCK),
            int(_clamp(float(block_bytes), MAX_KV_BLOCK_BYTES)))


MAX_PREFILL_S_PER_TOKEN = 0.1  # 10 tokens/s: slower than any real prefill
MAX_DECODE_STEP_S = 10.0
MAX_PENDING_PREFILL_TOKENS = 1 << 32


def bounded_costs(prefill_s_per_token: float, decode_step_s: float,
                  pending_prefill_tokens: int) -> tuple[float, float, int]:
    """A worker's reported costs made safe to compute with: NaN, infinite or negative -> 0.0
    (unmeasured), the rest clamped to MAX_PREFILL_S_PER_TOKEN, MAX_DECODE_STEP_S and
    MAX_PENDING_PREFILL_TOKENS."""
    return (_clamp(prefill_s_per_token, MAX_PREFILL_S_PER_TOKEN),
            _clamp(decode_step_s, MAX_DECODE_STEP_S),
            int(_clamp(float(pending_prefill_tokens), MAX_PENDING_PREFILL_TOKENS)))


def bounded_kv_usage(reported: float) -> float:
    """A worker's reported KV-cache use (a fraction) made safe to score and compare: clamped
    to [0, 1]; NaN (an unknown use) counts as full."""
    return min(max(reported, 0.0), 1.0) if not math.isnan(reported) else 1.0


def _clamp(value: float, hi: float) -> float:
    return min(value, hi) if math.isfinite(value) and value > 0.0 else 0.0


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

    def on_abandon(self) -> None:
        """A request was sent but its outcome will never be known (a gateway answered it
        elsewhere, or the stream broke): a half-open trial ends undecided, the next request
        may be the trial."""
        self.trial_in_flight = False

    def on_failure(self, now: float) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.threshold:
            self.state = BreakerState.OPEN
            self.reopen_at = now + self.cooldown_s


# the fields flow control's saturation answer depends on (`Worker.watcher`)
WATCHED = frozenset({"model", "aliases", "role", "ready", "load", "local_in_flight",
                     "lora_digests"})


@dataclass
class Worker:
    id: str  # base URL, e.g. http://10.0.0.7:8000
    model: str = ""  # served model name ("" until known)
    # its other served names (--served-model-name's others, /ready `models`): requests may
    # name the model by them; prompts are hashed with `model`, as the worker does
    aliases: frozenset[str] = frozenset()
    role: str = "both"  # both | prefill | decode
    grpc_target: str | None = None  # host:port of its gRPC Worker service, if any
    kv_transfer_backend: str | None = None  # how it fetches P/D pages (from /ready), if known
    kv_cache_dtype: str | None = None  # its KV cache's "auto" | "fp8" | "int8" (/ready), if known
    max_model_len: int | None = None  # its context length (from /ready or /v1/models)
    block_size: int | None = None  # from its KV event stream
    ready: bool = False  # last readiness probe answered 200
    # when its probes started failing to get any answer (timeout, refused, reset): a frozen
    # or unreachable worker, not a draining or loading one (those answer); None: answering
    unreachable_since: float | None = None
    events_connected: bool = False  # its KV event stream is live (precise routing)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    local_in_flight: int = 0  # requests this router has open on it
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    lora_slots: int = 0  # its max_loras (0: LoRA off or not reported)
    # LoRA adapters a request may name here (its /ready, load and admin reports; served on
    # `model`): name -> weight digest ("": not reported)
    lora_digests: Mapping[str, str] = field(default_factory=dict)
    # (engine instance, version) of the adapter set applied; None: none versioned yet
    lora_version: tuple[str, int] | None = None
    retired_instances: tuple[str, ...] = ()  # its engines' earlier instances, newest last
    # called with the worker after a field in `WATCHED` is assigned (the router's
    # `saturation.SaturationBook` re-files it); None: nobody watches
    watcher: Callable[[Worker], None] | None = field(default=None, repr=False, compare=False)
    # its scheduler's per-request prefill chunk cap (--long-prefill-token-threshold; 0: none)
    # and per-step token budget (--max-num-batched-tokens), from /ready; None: not known
    prefill_chunk_cap: int | None = None
    max_batched_tokens: int | None = None

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in WATCHED:
            watcher = self.__dict__.get("watcher")
            if watcher is not None:
                watcher(self)

    def apply_lora_report(self, report: LoRAReport) -> bool:
        """Take a report's adapters unless it is older than the set held: a lower version
        of the same engine instance, or any version of an instance since replaced (a probe
        answered before a load must not undo it). Unversioned reports apply only while no
        versioned one has. True when applied."""
        held = self.lora_version
        if report.version is None:
            if held is not None:
                return False
        elif held is not None and (report.instance in self.retired_instances or (
                report.instance == held[0] and report.version < held[1])):
            return False
        elif held is not None and report.instance != held[0]:  # the worker restarted
            self.retired_instances = (*self.retired_instances, held[0])[-RETIRED_INSTANCES:]
        if report.version is not None:
            self.lora_version = (report.instance, report.version)
        self.lora_digests = dict(report.digests)
        if report.slots:
            self.lora_slots = report.slots
        return True

    @property
    def lora_adapters(self) -> KeysView[str]:
        """The adapters a request may name here (`lora_digests`' names)."""
        return self.lora_digests.keys()

    def adapter_digest(self, lora: str | None) -> str:
        """How prompts for adapter `lora` are hashed here: its weight digest; "name:<lora>"
        when the worker reported none (an older worker: never the base model's chain); ""
        for the base model."""
        if not lora:
            return ""
        return self.lora_digests.get(lora) or f"name:{lora}"

    def hash_group(self, lora: str | None) -> HashGroup:
        """Workers of one group hash a prompt for adapter `lora` alike (as `prompt.
        block_hashes` does with the group's block size and digest)."""
        return self.kv_block_size, self.adapter_digest(lora)

    def serves(self, model: str) -> bool:
        """`model` is its base model (by any served name) or one of its adapters."""
        return bool(model) and (model == self.model or model in self.aliases
                                or model in self.lora_adapters)

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
