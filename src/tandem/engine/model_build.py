"""One rank's model: weights, attention backend, KV cache size. Shared by `LLMEngine`
(rank 0, or the only rank) and the other tensor-parallel ranks (`parallel/worker.py`), so
every rank builds, shards and sizes its share the same way.

The model is built on meta (quantized layers swapped in there), allocated once on the
device and filled tensor by tensor; with tensor parallelism a rank builds the model of its
share (`parallel/tp.local_arch`), loads each checkpoint tensor's slice as it streams in
(`shard_weights`; quantized layers hold the unsharded model's codes, sliced: a GGUF's
compressed blocks as they are), is packed for the CPU like any
model, and then gets the collectives wrapped around it (`wrap_tp`). KV blocks: an
explicit count, else host RAM (`kv_cache_memory`, shared by the ranks of one machine), else
on CUDA what `gpu_memory_utilization` leaves after a profiling step run by every rank at
once; the ranks then agree on their minimum.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine import memory
from tandem.engine.attention.base import AttentionBackend, AttentionSpec, resolve_backend
from tandem.engine.config import EngineConfig
from tandem.engine.cpu_tuning import tune_malloc, usable_cores
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.groups import KVGroupLayout, kv_group_layout
from tandem.engine.kv_cache.manager import uniform_window, window_blocks
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.cpu_linear import packing_available
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.layers import layer_attention_spec
from tandem.engine.model.loader import open_model
from tandem.engine.model.moe import convert_all_experts
from tandem.engine.model.ops import Ops
from tandem.engine.model.registry import build_model
from tandem.engine.parallel.comm import Groups, all_reduce_min
from tandem.engine.parallel.tp import TPPlan, local_arch, shard_weights, wrap_tp
from tandem.engine.quant.apply import (
    convert_linears,
    model_memory_bytes,
    plan_quantization,
    prepare_model,
    row_scaled_weights,
)
from tandem.engine.quant.float_methods import PackedMethod
from tandem.engine.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass
class Shard:
    """One rank's built model. `arch` is the whole model's (`model.config` the rank's
    share); `per_block`: bytes of one KV block over all layers on this rank (its KV heads
    only)."""

    model: DecoderForCausalLM
    backend: AttentionBackend
    arch: ModelArchConfig
    ops: Ops
    max_len: int
    weight_bytes: int
    per_block: int
    tp: TPPlan | None
    # a hybrid model's KV groups (layers of different windows: `kv_cache/groups.py`):
    # `group_size` physical K/V tensors instead of one per layer; None: one per layer
    kv_groups: KVGroupLayout | None = None


def build_shard(config: EngineConfig, path: Path, device: torch.device, dtype: torch.dtype,
                groups: Groups | None = None) -> Shard:
    """Rank `groups.rank` of `groups.world` (None: the whole model on one device)."""
    # a GGUF's Q4/Q8 tensors stay compressed when quantizing anyway (a tensor-parallel
    # rank slices their blocks)
    world = groups.world if groups is not None else 1
    source = open_model(path, dtype, keep_quantized=config.quantization is not None)
    arch = source.config
    kv_groups = kv_group_layout(arch.layer_windows)
    if kv_groups is not None and (why := groups_unsupported(config, world)):
        logger.warning("KV cache groups off (%s): every layer keeps every block of its "
                       "sequences, as one block table serves them all", why)
        kv_groups = None
    max_len = min(config.max_model_len or arch.max_position_embeddings,
                  arch.max_position_embeddings)
    tp = TPPlan.build(arch, groups.rank, world) if groups is not None else None
    model_arch = local_arch(arch, tp) if tp else arch
    spec = attention_spec(model_arch)
    backend = resolve_backend(config.attention_backend, spec, dtype, device,
                              native=config.native_kernels)(
        spec, config.block_size, dtype, device, kv_cache_dtype=config.kv_cache_dtype)
    ops = Ops(config.native_kernels, device, dtype, triton=backend.name == "triton")
    plan = plan_quantization(config.quantization, model_arch, source.formats, device, ops.lib,
                             config.quantization_group_size, str(path))
    # a rank's model is the single-device model of its share (local_arch); each checkpoint
    # tensor is sliced as it streams in, so only the shard is ever allocated
    with torch.device("meta"):
        model = build_model(model_arch, backend, max_positions=max_len, ops=ops)
        try:
            prepare_model(model, plan, dtype)
        except ConfigError as e:
            if tp is None:
                raise
            raise ConfigError(f"tensor_parallel_size {world} (each rank's share of the "
                              f"model): {e}") from None
    model.materialize(device, dtype)
    weights = source.tensors(progress=groups is None or groups.rank == 0)  # vLLM: always
    if tp is not None:  # per-channel layers scale by their whole rows (ColumnSlice)
        weights = shard_weights(weights, arch, tp, row_scaled_weights(plan, model_arch))
    model.load_weights(weights)
    model.eval()
    if config.cpu_linear == "packed" and packing_available(dtype, device, ops.lib):
        # the float linears left (all of them unless quantized): packed once for the CPU
        def packed() -> PackedMethod:
            return PackedMethod(device=device, native=ops.lib, dtype=dtype)

        count = convert_linears(model, packed) + convert_all_experts(model, packed)
        logger.info("packed %d float linear layers", count)
    if tp is not None:  # the collectives, around whatever the layers became
        wrap_tp(model, tp, groups.tp)
    tensors = arch.num_layers if kv_groups is None else kv_groups.group_size
    return Shard(model, backend, arch, ops, max_len, model_memory_bytes(model),
                 backend.bytes_per_block() * tensors, tp, kv_groups)


def groups_unsupported(config: EngineConfig, world: int) -> str:
    """Why a hybrid model's KV groups (`kv_cache/groups.py`) are off ("" for on): turned
    off (`kv_cache_groups=False`, which P/D roles set). The model then runs on one block
    table, freeing nothing."""
    return "" if config.kv_cache_groups else "kv_cache_groups=False"


def allocate_kv_caches(shard: Shard, num_blocks: int) -> list[tuple[torch.Tensor,
                                                                     torch.Tensor]]:
    """Each layer's (K, V) cache of `num_blocks` blocks: a pair per layer, or for a hybrid
    model `group_size` pairs, layer j of every KV group sharing pair j."""
    if shard.kv_groups is None:
        return [shard.backend.allocate_kv_cache(num_blocks)
                for _ in range(shard.arch.num_layers)]
    return shard.kv_groups.tensors_of([shard.backend.allocate_kv_cache(num_blocks)
                                       for _ in range(shard.kv_groups.group_size)])


def attention_spec(arch: ModelArchConfig) -> AttentionSpec:
    """The attention backend's spec for a model (or a rank's share) of `arch`: its first
    layer's (heads, head size, softmax scale, sliding window, score soft cap); layers that
    differ get their own view of the backend (`AttentionBackend.for_layer`)."""
    return layer_attention_spec(arch, 0)


def prepare_process(config: EngineConfig, device: torch.device) -> memory.MemorySnapshot | None:
    """What every rank's process does before it builds anything (rank 0 and the others
    alike): its torch threads (`rank_threads`); on CUDA its device selected, the memory
    snapshot the KV budget is measured from (returned) and gpu_memory_utilization checked
    against the free memory; on the CPU glibc malloc tuned (`tune_malloc`)."""
    if (threads := rank_threads(config)) is not None:
        torch.set_num_threads(threads)
    if device.type != "cuda":
        tune_malloc()
        return None
    torch.cuda.set_device(device)
    start = memory.snapshot(device)  # before this rank holds anything
    if gpu_profiled(config):
        memory.requested_memory(start.total, start.free, config.gpu_memory_utilization)
    return start


def rank_threads(config: EngineConfig) -> int | None:
    """Torch threads of each rank: `num_threads` is the whole engine's, split evenly over
    its tensor-parallel ranks (local processes share the host's cores); unset, a single
    rank keeps torch's default and N ranks split the cores this process may run on."""
    world = config.tensor_parallel_size
    if config.num_threads:
        return max(1, config.num_threads // world)
    if world == 1:
        return None
    return max(1, usable_cores() // world)


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_profiled(config: EngineConfig) -> bool:
    """On CUDA: whether gpu_memory_utilization sizes the pool (no explicit blocks/bytes)."""
    return not config.num_kv_blocks and not isinstance(config.kv_cache_memory, int)


def kv_blocks(config: EngineConfig, shard: Shard, device: torch.device,
              start: memory.MemorySnapshot | None, sampler: Sampler,
              groups: Groups | None = None) -> int:
    """This engine's KV blocks per rank (every rank calls it at the same time)."""
    world = groups.world if groups is not None else 1
    if config.num_kv_blocks:
        blocks = config.num_kv_blocks
    elif device.type == "cuda":
        blocks = _blocks_on_gpu(config, shard, device, start, sampler)
    else:
        mem = config.kv_cache_memory
        budget = int(_total_memory() * mem) if isinstance(mem, float) else int(mem)
        need, null = sequence_blocks(shard.arch, shard.max_len, config.block_size,
                                     config.max_num_batched_tokens, shard.kv_groups)
        useful = config.max_num_seqs * need + null  # no more can ever be held at once
        blocks = max(1 + null, min(budget // world // shard.per_block, useful))
    return blocks if groups is None else all_reduce_min(groups.ctrl, blocks)


def sequence_blocks(arch: ModelArchConfig, max_len: int, block_size: int,
                    step_tokens: int, kv_groups: KVGroupLayout | None = None
                    ) -> tuple[int, int]:
    """(the most KV blocks one `max_len`-token sequence holds at once, the pool's null
    blocks): all of its blocks, or for a model whose every layer slides with one window W
    the window's bound (`kv_cache/manager.window_blocks`, a step running at most
    `step_tokens`) and the null block the window reserves; for a hybrid model the sum of
    its KV groups' (`kv_groups`) bounds, a block covering `group_size` layers."""
    if kv_groups is not None:  # a hybrid model's: each group's bound (one null block)
        return sum(window_blocks(max_len, block_size, w, step_tokens)
                   for w in kv_groups.windows), 1
    window = uniform_window(arch.layer_windows)
    return window_blocks(max_len, block_size, window, step_tokens), int(window is not None)


def check_sequence_fits(num_blocks: int, need: int, null: int, block_size: int, max_len: int,
                        budget: int) -> None:
    """ConfigError unless a pool of `num_blocks` (`budget` bytes, `null` of them reserved)
    holds the `need` blocks one max_model_len (`max_len`) sequence holds at once."""
    usable = num_blocks - null
    if usable >= need:
        return
    raise ConfigError(
        f"the KV cache holds {max(0, usable) * block_size} tokens ({budget / 2**30:.2f} GiB), "
        f"less than one max_model_len ({max_len}) sequence needs; raise "
        "gpu_memory_utilization (or kv_cache_memory bytes) or lower max_model_len to at "
        f"most {max(0, usable) * block_size}")


def _blocks_on_gpu(config: EngineConfig, shard: Shard, device: torch.device,
                   start: memory.MemorySnapshot, sampler: Sampler) -> int:
    """`kv_cache_memory` bytes when given as an int, else what gpu_memory_utilization
    leaves after a profiling step (engine/memory.py). One max_model_len sequence must fit
    (`check_sequence_fits`: a sliding-window model's, the blocks its window holds)."""
    if gpu_profiled(config):
        weights = memory.snapshot(device).allocated - start.allocated
        prof = memory.profile_steps(shard.model, shard.backend, shard.arch.num_layers,
                                    config.max_num_batched_tokens, config.max_num_seqs,
                                    shard.max_len, device, sampler)
        budget = memory.kv_cache_budget(
            start.total, config.gpu_memory_utilization, weights, prof.activation_peak,
            max(0, prof.after.non_torch - start.non_torch), free_at_start=start.free)
        logger.info("GPU memory: %.2f GiB total x %.2f, weights %.2f GiB, activation "
                    "peak %.2f GiB -> KV cache %.2f GiB", start.total / 2**30,
                    config.gpu_memory_utilization, weights / 2**30,
                    prof.activation_peak / 2**30, budget / 2**30)
    else:
        budget = int(config.kv_cache_memory)
    num_blocks = budget // shard.per_block
    need, null = sequence_blocks(shard.arch, shard.max_len, config.block_size,
                                 config.max_num_batched_tokens, shard.kv_groups)
    check_sequence_fits(num_blocks, need, null, config.block_size, shard.max_len, budget)
    return num_blocks
