"""Sizing the KV cache on a GPU from `gpu_memory_utilization` (vLLM's meaning and method).

The engine may use `total * gpu_memory_utilization` bytes of the device. Of that, what is
not taken by the weights, the activation peak of the largest step, and memory this process
holds outside torch's allocator (CUDA context growth, cuBLAS/Triton workspaces, NCCL) goes
to the KV cache:

    kv = total * utilization - (weights + activation_peak + non_torch_increase)

`snapshot` reads the device (`torch.cuda.mem_get_info` + the caching allocator's stats);
`profile_peak` measures a dummy step's activation peak; `kv_cache_budget` is the arithmetic,
pure, on plain ints. As vLLM, memory used by other processes is assumed not to change while
the engine starts; it must leave at least the requested fraction free (`requested_memory`).
CUDA graphs captured later (engine/cuda_graphs.py) take a small extra pool not counted here.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.attention.base import AttentionBackend, BatchLayout
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.sampler import Sampler, SamplingRow
from tandem.engine.scheduler import prompt_logprobs_rows

logger = logging.getLogger(__name__)
GiB = 1 << 30


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a CUDA device, in bytes."""

    free: int  # free on the device (all processes)
    total: int
    reserved: int  # held by this process's torch caching allocator
    allocated: int  # in live torch tensors
    peak_allocated: int  # since the last torch.cuda.reset_peak_memory_stats

    @property
    def non_torch(self) -> int:
        """Used on the device but not through torch's allocator here: other processes,
        this process's CUDA context, library workspaces."""
        return (self.total - self.free) - self.reserved


def snapshot(device: torch.device) -> MemorySnapshot:
    """Read `device` now (creates its CUDA context if there is none yet)."""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return MemorySnapshot(free, total, torch.cuda.memory_reserved(device),
                          stats.get("allocated_bytes.all.current", 0),
                          stats.get("allocated_bytes.all.peak", 0))


def requested_memory(total: int, free: int, utilization: float) -> int:
    """`total * utilization` bytes; ConfigError when less than that is free at start-up
    (other processes, or another engine in this one, already hold the rest)."""
    requested = int(total * utilization)
    if free < requested:
        raise ConfigError(
            f"free GPU memory at start-up ({_gib(free)} of {_gib(total)}) is less than "
            f"gpu_memory_utilization {utilization} asks for ({_gib(requested)}); lower "
            "gpu_memory_utilization or free memory held by other processes")
    return requested


def kv_cache_budget(total: int, utilization: float, weights: int, activation_peak: int,
                    non_torch: int, *, free_at_start: int | None = None) -> int:
    """KV cache bytes: `total * utilization - (weights + activation_peak + non_torch)`.

    `non_torch`: this process's non-torch memory growth since start-up. With
    `free_at_start`, first checks `requested_memory`. ConfigError, naming every term, when
    nothing is left for the KV cache.
    """
    requested = (int(total * utilization) if free_at_start is None
                 else requested_memory(total, free_at_start, utilization))
    kv = requested - (weights + activation_peak + non_torch)
    if kv <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization {utilization} of "
            f"{_gib(total)} is {_gib(requested)}, and the model weights take "
            f"{_gib(weights)}, the activation peak {_gib(activation_peak)} and non-torch "
            f"memory {_gib(non_torch)}; raise gpu_memory_utilization, or lower "
            "max_num_batched_tokens / max_num_seqs")
    return kv


@dataclass(frozen=True)
class ProfileResult:
    activation_peak: int  # bytes above the allocations live before the dummy steps
    after: MemorySnapshot  # after the steps, their tensors freed


def profile_peak(run: Callable[[], object], device: torch.device) -> ProfileResult:
    """Run `run` (the dummy steps) on `device` and measure its torch allocation peak."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = snapshot(device)
    run()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    after = snapshot(device)
    return ProfileResult(after.peak_allocated - before.allocated, after)


def dummy_layout(num_tokens: int, max_len: int, block_size: int) -> BatchLayout:
    """A step of `num_tokens` prompt tokens: prefills of `max_len` tokens (the last one
    shorter) whose every block id is 0, so a 1-block KV cache serves it. Writes collide in
    block 0; the values are garbage, the memory traffic is real."""
    qlens = [max_len] * (num_tokens // max_len)
    if rest := num_tokens % max_len:
        qlens = [rest, *qlens] if rest == 1 else [*qlens, rest]  # one-token rows go first
    tables = [[0] * cdiv(n, block_size) for n in qlens]
    slots = torch.arange(num_tokens, dtype=torch.int64) % block_size
    return BatchLayout(qlens, list(qlens), tables, slots, int(qlens[0] == 1), block_size)


_PROFILE_KEY = "\x00profile-"  # penalty-state keys no request id can take


def worst_case_rows(n: int, prompt_len: int) -> list[SamplingRow]:
    """`n` sampling rows that take every costly path at once: top-k, top-p and min-p
    (the full sort), all three penalties (per-request device counts) and 20 logprobs."""
    prompt = list(range(prompt_len))
    return [SamplingRow(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05,
                        repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1,
                        generator=None, banned_token_ids=(0,), prompt_token_ids=prompt,
                        output_token_ids=[1], num_logprobs=20, key=f"{_PROFILE_KEY}{i}")
            for i in range(n)]


def prompt_logprobs_work(logits: torch.Tensor, k: int = 20) -> torch.Tensor:
    """What the model runner computes over a step's prompt-logprobs rows (`[rows, V]` in
    the model dtype): float32 log-softmax, each row's target and top-k. Returns the
    log-softmax."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.zeros(logits.shape[0], 1, dtype=torch.int64, device=logits.device)
    torch.cat([logprobs.gather(1, targets).double(),
               *(t.double() for t in logprobs.topk(min(k, logits.shape[-1]), dim=-1))], dim=1)
    return logprobs


@torch.inference_mode()
def dummy_step(model: torch.nn.Module, backend: AttentionBackend,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: BatchLayout,
               num_logits: int, device: torch.device,
               sampler: Sampler | None = None, prompt_logprob_rows: int = 0
               ) -> torch.Tensor | None:
    """One forward over `layout` with logits for its last `num_logits + prompt_logprob_rows`
    tokens (at most all of them): with a `sampler`, the real sampler over the first
    `num_logits` rows in its costliest mode (`worst_case_rows`; its penalty state released
    after, its storage kept, as it would be under load), then `prompt_logprobs_work` over
    the rest, the logits all live meanwhile as in a real step. Returns the logits. Any
    device; the engine profiles it on CUDA (None on tensor-parallel ranks > 0, which hold
    no logits)."""
    positions = torch.cat([torch.arange(s - q, s) for q, s in
                           zip(layout.query_lens, layout.seq_lens, strict=True)])
    t = layout.num_tokens
    ids = torch.zeros(t, dtype=torch.int64, device=device)
    n = min(num_logits + prompt_logprob_rows, t)
    rows = torch.arange(t - n, t, device=device)
    logits = model(ids, positions.to(device), kv_caches, backend.build_metadata(layout), rows)
    if logits is None:  # a tensor-parallel rank > 0: the logits are gathered to rank 0
        return None
    ns = min(num_logits, n)
    if sampler is not None:
        sample_rows = worst_case_rows(ns, min(t, 64))
        try:
            sampler(logits[:ns], sample_rows)
        finally:
            for r in sample_rows:
                sampler.release(r.key)
    if n > ns:
        prompt_logprobs_work(logits[ns:])
    return logits


def profile_steps(model: torch.nn.Module, backend: AttentionBackend, num_layers: int,
                  max_num_batched_tokens: int, max_num_seqs: int, max_len: int,
                  device: torch.device, sampler: Sampler | None = None) -> ProfileResult:
    """The activation peak of the largest step (vLLM's profile run): the whole token budget
    as prompt tokens, with logits for `max_num_seqs` rows sampled by `sampler` in its
    costliest mode and for the prompt-logprobs rows a step may compute
    (`scheduler.prompt_logprobs_rows`, their float32 log-softmax and top-20), over a
    1-block KV cache.

    The Triton backend's decode needs no context-sized temporaries; the torch backend's
    decode gathers each row's whole context, which this does not bound.
    """
    caches = [backend.allocate_kv_cache(1) for _ in range(num_layers)]
    layout = dummy_layout(max_num_batched_tokens, max_len, backend.block_size)
    plp_rows = prompt_logprobs_rows(max_num_seqs, max_num_batched_tokens)
    result = profile_peak(
        lambda: dummy_step(model, backend, caches, layout, max_num_seqs, device, sampler,
                           plp_rows),
        device)
    logger.info("profiled a %d-token step: activation peak %s", max_num_batched_tokens,
                _gib(result.activation_peak))
    return result
