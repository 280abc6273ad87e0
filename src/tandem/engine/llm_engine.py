"""The synchronous engine: add requests, `step()` until done. One step = schedule, run, emit.

`LLMEngine` loads the model, sizes the KV cache and builds the `ModelRunner`; the request
lifecycle (admission, steps, aborts, failures) is `core.EngineCore`'s. A failing step fails
only the requests it ran (finish reason "error"); the engine goes on.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from tandem.engine.attention.base import AttentionSpec, resolve_backend
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore, EngineState, EngineStats
from tandem.engine.cpu_tuning import tune_malloc
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.model.cpu_linear import pack_linears, packing_available
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.loader import bundled_model_path, load_model
from tandem.engine.model.ops import Ops
from tandem.engine.model_runner import ModelRunner
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import Scheduler
from tandem.protocol.tokenizer import Tokenizer

__all__ = ["EngineState", "EngineStats", "LLMEngine", "default_device"]
logger = logging.getLogger(__name__)


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_device() -> torch.device:
    """Where an engine runs: the first CUDA device if there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLMEngine(EngineCore):
    runner: ModelRunner

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
        tokenizer = Tokenizer.load(path)
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
        state = EngineState(str(path), name, max_len, config.block_size, num_blocks,
                            per_block, arch.vocab_size)
        eos = tuple(dict.fromkeys(tuple(arch.eos_token_ids) + tuple(tokenizer.eos_token_ids)))
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                            enable_events=config.enable_kv_events)
        caches = [backend.allocate_kv_cache(num_blocks) for _ in range(arch.num_layers)]
        runner = ModelRunner(self.model, backend, caches, kv, Sampler(config.seed), self.device)
        scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                              config.max_waiting, config.long_prefill_token_threshold)
        super().__init__(state, scheduler, runner, OutputProcessor(tokenizer), eos)
        logger.info("engine ready in %.1fs: %s, %d KV blocks of %d tokens (%.0f MiB), "
                    "max_model_len %d, attention %s", time.perf_counter() - t0, name, num_blocks,
                    config.block_size, num_blocks * per_block / 2**20, max_len, backend.name)

    def _blocks_from_budget(self, per_block: int, max_len: int) -> int:
        mem = self.config.kv_cache_memory
        budget = int(_total_memory() * mem) if isinstance(mem, float) else int(mem)
        useful = self.config.max_num_seqs * cdiv(max_len, self.config.block_size)
        return max(1, min(budget // per_block, useful))
