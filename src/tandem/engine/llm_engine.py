"""The synchronous engine: add requests, `step()` until done. One step = schedule, run, emit.

A failing step fails only the requests it ran (finish reason "error"); the engine goes on.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.attention.base import AttentionSpec, resolve_backend
from tandem.engine.config import EngineConfig
from tandem.engine.cpu_tuning import tune_malloc
from tandem.engine.errors import InvalidRequestError, QueueFullError
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.model.cpu_linear import pack_linears, packing_available
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.loader import bundled_model_path, load_model
from tandem.engine.model.ops import Ops
from tandem.engine.model_runner import ModelRunner
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.protocol.block_hash import HashKeys
from tandem.protocol.kv_events import KVEvent
from tandem.protocol.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = 1 << 20  # hard bound on what a client can hand us, before model limits


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


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up (cumulative)
    prefix_cache_hits: int  # tokens hit (cumulative)
    num_preemptions: int  # cumulative
    prompt_tokens: int  # prompt tokens of requests that produced a token (cumulative)
    generation_tokens: int  # tokens sampled (cumulative)
    kv_unused_slots: int  # slots held by running requests beyond their computed tokens
    in_flight_tokens: int  # prompt + generated tokens of running and waiting requests


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_device() -> torch.device:
    """Where an engine runs: the first CUDA device if there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = Path(config.model) if config.model else bundled_model_path()
        dtype = getattr(torch, config.dtype)
        self.device = default_device()
        if self.device.type == "cpu":
            tune_malloc()
        t0 = time.perf_counter()
        loaded = load_model(path, dtype=torch.float32)
        arch = loaded.config
        self.tokenizer = Tokenizer.load(path)
        max_len = min(config.max_model_len or arch.max_position_embeddings,
                      arch.max_position_embeddings)
        spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim,
                             arch.head_dim ** -0.5, arch.sliding_window)
        backend = resolve_backend(config.attention_backend, spec, dtype, self.device,
                                  native=config.native_kernels)(
            spec, config.block_size, dtype, self.device)
        ops = Ops(config.native_kernels, self.device, dtype)
        self.model = LlamaForCausalLM(arch, backend, max_positions=max_len, ops=ops)
        self.model.load_weights(loaded.weights)
        del loaded
        self.model.to(device=self.device, dtype=dtype).eval()
        self.model.rope.to(torch.float32)
        if config.cpu_linear == "onednn" and packing_available(dtype, self.device, ops.lib):
            pack_linears(self.model, native=ops.lib)

        per_block = backend.bytes_per_block() * arch.num_layers
        num_blocks = config.num_kv_blocks or self._blocks_from_budget(per_block, max_len)
        name = config.model_name
        self.state = EngineState(str(path), name, max_len, config.block_size, num_blocks,
                                 per_block, arch.vocab_size)
        self.eos_token_ids = tuple(dict.fromkeys(
            tuple(arch.eos_token_ids) + tuple(self.tokenizer.eos_token_ids)))
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 enable_events=config.enable_kv_events)
        caches = [backend.allocate_kv_cache(num_blocks) for _ in range(arch.num_layers)]
        self.runner = ModelRunner(self.model, backend, caches, self.kv, Sampler(config.seed),
                                  self.device)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_waiting, config.long_prefill_token_threshold)
        self.outputs = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # outputs of aborted requests
        self._prompt_tokens = 0
        self._generation_tokens = 0
        logger.info("engine ready in %.1fs: %s, %d KV blocks of %d tokens (%.0f MiB), "
                    "max_model_len %d, attention %s", time.perf_counter() - t0, name, num_blocks,
                    config.block_size, num_blocks * per_block / 2**20, max_len, backend.name)

    def _blocks_from_budget(self, per_block: int, max_len: int) -> int:
        mem = self.config.kv_cache_memory
        budget = int(_total_memory() * mem) if isinstance(mem, float) else int(mem)
        useful = self.config.max_num_seqs * cdiv(max_len, self.config.block_size)
        return max(1, min(budget // per_block, useful))

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None, keep_blocks: bool = False) -> list[int]:
        """Validate and queue a request; returns its prompt token ids. `keep_blocks`: when it
        finishes normally its KV blocks stay pinned until `kv.release_kept(request_id)` (the
        source of a KV transfer).

        Raises `InvalidRequestError` (bad input) or `QueueFullError` (back-pressure).
        """
        params = params or SamplingParams()
        params.validate()
        if self.outputs.has(request_id):
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        ids = self._prompt_ids(prompt)
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
        keys = HashKeys(self.state.model_name, "", cache_salt or "")
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone_for_sample(i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if child_id in self.scheduler.requests:
                raise InvalidRequestError(f"duplicate request id {child_id!r}", "request_id")
            children.append(Request(child_id, ids, child_params, max_tokens, self.eos_token_ids,
                                    keys, priority=priority, parent_id=request_id,
                                    sample_index=i, keep_kv=keep_blocks))
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, children)
        for child in children:
            self.scheduler.add_request(child)
        return ids

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_TOKENS * 16:
                raise InvalidRequestError("prompt is too long", "prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if len(prompt) > MAX_PROMPT_TOKENS:
                raise InvalidRequestError("prompt is too long", "prompt")
            vocab = self.state.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                   for t in prompt):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab})", "prompt")
            ids = list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
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

    # -- stepping ----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return outputs of requests that progressed, finished or aborted."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        try:
            result = self.runner.execute(sched)
        except Exception as exc:  # one bad batch must not kill the loop
            logger.exception("step failed; failing %d requests", len(sched.scheduled))
            parents: dict[str, None] = {}
            for s in sched.scheduled:
                self._finish(s.request, RequestStatus.FINISHED_ERROR)
                parents[s.request.parent_id or s.request.request_id] = None
            for pid in parents:
                for child in self.outputs.children(pid):
                    if not child.is_finished:
                        self._finish(child, RequestStatus.FINISHED_ERROR)
                self.outputs.fail(pid, f"internal error: {type(exc).__name__}")
                outputs.append(self.outputs.make_output(pid))
            return outputs
        self.scheduler.update_after_step(sched)
        touched: dict[str, None] = {}
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            entries = result.prompt_logprobs.get(req.request_id)
            if entries:
                self.outputs.add_prompt_logprobs(req, entries)
            if not s.samples:
                continue
            token = result.sampled[req.request_id]
            req.append_output_token(token)
            self._generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
                self._prompt_tokens += req.num_prompt_tokens
            status = self.outputs.process_token(req, token, result.logprobs.get(req.request_id))
            if status is not None:
                self._finish(req, status)
            touched[req.parent_id or req.request_id] = None
        outputs.extend(self.outputs.make_output(pid) for pid in touched)
        return outputs

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(), num_free_blocks=self.kv.pool.num_free_blocks(),
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            kv_unused_slots=self.kv.unused_slots(self.scheduler.running),
            in_flight_tokens=self.scheduler.num_unfinished_tokens())

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()
