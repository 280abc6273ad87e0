"""The synchronous engine: add requests, `step()` until done. One step = schedule, run, emit.

`LLMEngine` resolves the device and dtype (`devices.py`), builds the model on the meta device
and streams the weights onto the device in the target dtype, sizes the KV cache (host RAM on
the CPU, `memory.py`'s profile on CUDA) and builds the `ModelRunner`; the request
lifecycle (admission, steps, aborts, failures) is `core.EngineCore`'s. A failing step fails
only the requests it ran (finish reason "error"); the engine goes on.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from tandem.engine import memory
from tandem.engine.attention.base import AttentionBackend, AttentionSpec, resolve_backend
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore, EngineState, EngineStats
from tandem.engine.cpu_tuning import tune_malloc
from tandem.engine.cuda_graphs import build_decode_graphs
from tandem.engine.devices import resolve_device, resolve_dtype
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.lora.manager import LoRAConfig, LoRAManager
from tandem.engine.lora.request import LoRARequest
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.cpu_linear import packing_available
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.loader import bundled_model_path, open_model
from tandem.engine.model.ops import Ops
from tandem.engine.model_runner import ModelRunner
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.quant.apply import (
    convert_linears,
    model_memory_bytes,
    plan_quantization,
    prepare_model,
)
from tandem.engine.quant.float_methods import PackedMethod
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode import ProposerContext, SpeculativeConfig, build_proposer
from tandem.engine.spec_decode.speculator import Speculator
from tandem.protocol.tokenizer import Tokenizer

__all__ = ["EngineState", "EngineStats", "LLMEngine"]
logger = logging.getLogger(__name__)


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class LLMEngine(EngineCore):
    runner: ModelRunner

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = Path(config.model) if config.model else bundled_model_path()
        self.device = device = resolve_device(config.device)
        self.dtype = dtype = resolve_dtype(config.dtype, device)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
            start = memory.snapshot(device)  # before this engine holds anything
            if self._gpu_profiled():
                memory.requested_memory(start.total, start.free, config.gpu_memory_utilization)
        else:
            tune_malloc()
        t0 = time.perf_counter()
        # a GGUF's Q4_0 / Q4_1 / Q8_0 tensors stay compressed when quantizing anyway
        source = open_model(path, dtype, keep_quantized=config.quantization is not None)
        arch = source.config
        tokenizer = Tokenizer.load(path)
        max_len = min(config.max_model_len or arch.max_position_embeddings,
                      arch.max_position_embeddings)
        spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim,
                             arch.head_dim ** -0.5, arch.sliding_window)
        backend = resolve_backend(config.attention_backend, spec, dtype, device,
                                  native=config.native_kernels)(
            spec, config.block_size, dtype, device, kv_cache_dtype=config.kv_cache_dtype)
        ops = Ops(config.native_kernels, device, dtype, triton=backend.name == "triton")
        plan = plan_quantization(config.quantization, arch, source.formats, device, ops.lib,
                                 config.quantization_group_size, str(path))
        # built on meta (quantized layers swapped in there), allocated once on the device,
        # filled tensor by tensor: neither a float copy nor a host copy of the model exists
        with torch.device("meta"):
            self.model = LlamaForCausalLM(arch, backend, max_positions=max_len, ops=ops)
            prepare_model(self.model, plan, dtype)
        self.model.materialize(device, dtype)
        self.model.load_weights(source.tensors())
        self.model.eval()
        if config.cpu_linear == "onednn" and packing_available(dtype, device, ops.lib):
            # the float linears left (all of them unless quantized): packed once for the CPU
            count = convert_linears(self.model, lambda: PackedMethod(device=device,
                                                                     native=ops.lib))
            logger.info("packed %d float linear layers", count)
        weight_bytes = model_memory_bytes(self.model)
        lora = self._lora_manager(arch, ops.lib) if config.enable_lora else None

        sampler = Sampler(config.seed)  # profiled with the model on CUDA, then the runner's
        per_block = backend.bytes_per_block() * arch.num_layers
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif cuda:
            num_blocks = self._blocks_on_gpu(backend, start, per_block, max_len, sampler)
        else:
            num_blocks = self._blocks_from_budget(per_block, max_len)
        name = config.model_name
        state = EngineState(str(path), name, max_len, config.block_size, num_blocks,
                            per_block, arch.vocab_size, weight_bytes, config.quantization,
                            config.kv_cache_dtype)
        eos = tuple(dict.fromkeys(tuple(arch.eos_token_ids) + tuple(tokenizer.eos_token_ids)))
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                            enable_events=config.enable_kv_events)
        caches = [backend.allocate_kv_cache(num_blocks) for _ in range(arch.num_layers)]
        runner = ModelRunner(self.model, backend, caches, kv, sampler, device)
        # decode graphs replay fixed buffers: a LoRA engine runs eagerly (its slot plan
        # changes every step)
        runner.graphs = None if lora else build_decode_graphs(config, self.model, backend,
                                                              caches, max_len, device)
        runner.lora = lora
        scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                              config.max_waiting, config.long_prefill_token_threshold,
                              max_loras=config.max_loras if lora else 0)
        speculator = self._speculator(path, max_len, runner)
        super().__init__(state, scheduler, runner, OutputProcessor(tokenizer), eos, speculator)
        self.lora = lora
        logger.info("engine ready in %.1fs: %s on %s in %s (weights %.0f MiB, quantization "
                    "%s), %d KV blocks of %d tokens (%.0f MiB, %s), max_model_len %d, "
                    "attention %s", time.perf_counter() - t0, name, device,
                    str(dtype).removeprefix("torch."), weight_bytes / 2**20,
                    config.quantization or "none", num_blocks, config.block_size,
                    num_blocks * per_block / 2**20, config.kv_cache_dtype, max_len,
                    backend.name)

    def _lora_manager(self, arch: ModelArchConfig, native: object | None) -> LoRAManager:
        """Slot stacks in every decoder linear, the configured adapters registered."""
        cfg = self.config
        manager = LoRAManager(self.model, arch, LoRAConfig(
            cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, tuple(cfg.lora_dirs)),
            self.device, self.dtype, native)
        for i, (name, path) in enumerate((cfg.lora_modules or {}).items(), start=1):
            manager.add(LoRARequest(name, i, path), trusted=True)
        logger.info("LoRA: %d slots of rank %d (%.1f MiB), %d adapters at start",
                    cfg.max_loras, cfg.max_lora_rank, manager.slot_bytes / 2**20,
                    len(manager.registered))
        return manager

    def _speculator(self, path: Path, max_len: int, runner: ModelRunner) -> Speculator | None:
        """The configured proposer (speculative_config), or None."""
        cfg = self.config
        spec = getattr(cfg, "speculative_config", None)
        if spec is None:
            return None
        spec = SpeculativeConfig.from_dict(spec)
        ctx = ProposerContext(spec, cfg, self.model, str(path), self.device, self.dtype,
                              self.model.config.vocab_size, cfg.block_size, max_len,
                              cfg.max_num_seqs)
        proposer = build_proposer(ctx)
        runner.return_hidden = proposer.needs_hidden_states
        logger.info("speculative decoding: %s, up to %d tokens (adaptive %s)", spec.method,
                    spec.num_speculative_tokens, spec.adaptive)
        return Speculator(spec, proposer, max_len, cfg.max_num_batched_tokens)

    def model_memory_bytes(self) -> int:
        """Resident bytes of the model's weights (every parameter and quantized buffer)."""
        return self.state.model_memory_bytes

    def _gpu_profiled(self) -> bool:
        """On CUDA: whether gpu_memory_utilization sizes the pool (no explicit blocks/bytes)."""
        mem = self.config.kv_cache_memory
        return not self.config.num_kv_blocks and not isinstance(mem, int)

    def _blocks_on_gpu(self, backend: AttentionBackend, start: memory.MemorySnapshot,
                       per_block: int, max_len: int, sampler: Sampler) -> int:
        """KV blocks on CUDA: `kv_cache_memory` bytes when given as an int, else what
        gpu_memory_utilization leaves after a profiling step (engine/memory.py). At least
        one max_model_len sequence must fit."""
        cfg, device = self.config, self.device
        if self._gpu_profiled():
            weights = memory.snapshot(device).allocated - start.allocated
            prof = memory.profile_steps(self.model, backend, self.model.config.num_layers,
                                        cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                        max_len, device, sampler)
            budget = memory.kv_cache_budget(
                start.total, cfg.gpu_memory_utilization, weights, prof.activation_peak,
                max(0, prof.after.non_torch - start.non_torch), free_at_start=start.free)
            logger.info("GPU memory: %.2f GiB total x %.2f, weights %.2f GiB, activation "
                        "peak %.2f GiB -> KV cache %.2f GiB", start.total / 2**30,
                        cfg.gpu_memory_utilization, weights / 2**30,
                        prof.activation_peak / 2**30, budget / 2**30)
        else:
            budget = int(cfg.kv_cache_memory)
        num_blocks = budget // per_block
        needed = cdiv(max_len, cfg.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"the KV cache holds {num_blocks * cfg.block_size} tokens "
                f"({budget / 2**30:.2f} GiB), less than one max_model_len ({max_len}) "
                "sequence needs; raise gpu_memory_utilization (or kv_cache_memory bytes) or "
                f"lower max_model_len to at most {num_blocks * cfg.block_size}")
        return num_blocks

    def _blocks_from_budget(self, per_block: int, max_len: int) -> int:
        mem = self.config.kv_cache_memory
        budget = int(_total_memory() * mem) if isinstance(mem, float) else int(mem)
        useful = self.config.max_num_seqs * cdiv(max_len, self.config.block_size)
        return max(1, min(budget // per_block, useful))
