"""The engine core's typed contracts: what a runner returns (`RunnerOutput`), the `Runner`
protocol, the start-up `EngineState` and the `EngineStats` snapshot. Torch-free;
re-exported by `engine.core`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tandem.engine.lora.request import LoRAState

if TYPE_CHECKING:
    from tandem.engine.kv_tiers.counters import TierCounters
    from tandem.engine.scheduler import SchedulerOutput


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
    kv_bytes_per_block: int  # all layers (a hybrid model: group_size layers), K and V
    vocab_size: int
    model_memory_bytes: int = 0  # resident weight bytes (quant.apply.model_memory_bytes)
    quantization: str | None = None  # EngineConfig.quantization
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype
    kv_null_blocks: int = 0  # of num_kv_blocks, never held (a sliding window's null block)

    @property
    def num_usable_blocks(self) -> int:
        """KV blocks requests can hold: `num_kv_blocks` less the null block (the totals the
        router's load reports and /metrics give)."""
        return self.num_kv_blocks - self.kv_null_blocks


@dataclass(frozen=True)
class StepPathCount:
    """Rank 0's forward steps of one path (cumulative): `path` "graph" (the decode graphs
    replayed, or their static buffers without capture; `reason` "decode") or "eager"
    (`reason` why: model_runner.EAGER_REASONS); `seconds` the runner's host wall time of
    those steps (on a GPU it waits for the device when the step's tokens are copied back)."""

    path: str
    reason: str
    steps: int
    seconds: float


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
    step_paths: tuple[StepPathCount, ...] = ()  # graph vs eager steps (a model runner's)
    # KV pages held for readers outside the engine (kv_cache/leases.py): live leases, and
    # how the ended ones ended (cumulative)
    kv_leases_active: int = 0
    kv_leases_released: int = 0
    kv_leases_expired: int = 0
    # prompt tokens a KV connector loaded instead of computing them (cumulative)
    kv_connector_loaded_tokens: int = 0
    # KV blocks a sliding-window model released as they left every query's window
    # (cumulative; kv_cache/manager.py `free_out_of_window`)
    kv_window_freed_blocks: int = 0
    # measured costs (engine/step_costs.py; 0.0: not measured yet) and the prompt tokens its
    # waiting and partly prefilled running requests still need computed
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    pending_prefill_tokens: int = 0
    # KV offload tiers (engine/kv_tiers; empty: off): each tier's bytes and counts, measured
    # EWMA seconds to load one block (every layer) from host memory / disk (0.0: not yet),
    # and one block's bytes (every layer, every KV head)
    kv_tiers: tuple[TierCounters, ...] = ()
    host_load_s_per_block: float = 0.0
    disk_load_s_per_block: float = 0.0
    kv_block_bytes: int = 0
