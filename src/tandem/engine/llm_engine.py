"""The synchronous engine: add requests, `step()` until done. One step = schedule, run, emit.

`LLMEngine` resolves the device and dtype (`devices.py`), starts the tensor-parallel ranks
(`parallel/executor.py`; none with tensor_parallel_size 1), builds its shard of the model
and sizes the KV cache (`model_build.py`) and builds the `ModelRunner`; the request
lifecycle (admission, steps, aborts, failures) is `core.EngineCore`'s. A failing step fails
only the requests it ran (finish reason "error"); the engine goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from tandem.engine import memory
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore, EngineState, EngineStats
from tandem.engine.cuda_graphs import build_decode_graphs
from tandem.engine.devices import resolve_device, resolve_dtype
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.hybrid import HybridKVCacheManager
from tandem.engine.kv_cache.manager import KVCacheManager, uniform_window
from tandem.engine.kv_cache.pages import block_index, gather_layer, scatter_layer
from tandem.engine.kv_pages import PageLayout
from tandem.engine.lora.manager import LoRAConfig, LoRAManager
from tandem.engine.lora.peft import LoRAAdapter
from tandem.engine.lora.request import LoRARequest
from tandem.engine.lora.slots import adapter_data, adapter_ids
from tandem.engine.model.loader import bundled_model_path
from tandem.engine.model_build import (
    Shard,
    allocate_kv_caches,
    build_shard,
    kv_blocks,
    prepare_process,
)
from tandem.engine.model_runner import ModelRunner
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.parallel.comm import Groups, broadcast
from tandem.engine.parallel.executor import build_executor
from tandem.engine.parallel.kv_moves import gather_pages, scatter_pages
from tandem.engine.parallel.plan import PlanKind, StepPlan
from tandem.engine.quant.checkpoint import with_checkpoint_quantization
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode import (
    Proposer,
    ProposerContext,
    SpeculativeConfig,
    build_proposer,
)
from tandem.engine.spec_decode.speculator import Speculator
from tandem.engine.structured import get_backend
from tandem.protocol.structured_outputs import StructuredOutputsError
from tandem.protocol.tokenizer import Tokenizer

__all__ = ["EngineState", "EngineStats", "KVPageIO", "LLMEngine"]
logger = logging.getLogger(__name__)


class LLMEngine(EngineCore):
    runner: ModelRunner

    def __init__(self, config: EngineConfig) -> None:
        from tandem.engine.llm import resolve_config  # repository ids -> the hub cache

        # a pre-quantized checkpoint's method when unset (quant/checkpoint.py)
        self.config = config = with_checkpoint_quantization(resolve_config(config))
        path = Path(config.model) if config.model else bundled_model_path()
        self.device = device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, device, path)
        start = prepare_process(config, device)
        t0 = time.perf_counter()
        # ranks 1..N-1 start (processes or Ray actors) and join rank 0, this process
        self.executor = executor = build_executor(config, device)
        groups = executor.start()
        try:  # the ranks must not outlive a start-up that fails anywhere
            self._build(path, groups, start, t0)
        except BaseException:
            executor.shutdown()
            raise

    def _build(self, path: Path, groups: Groups | None,
               start: memory.MemorySnapshot | None, t0: float) -> None:
        """Rank 0's shard, proposer, KV cache, runner and scheduler (the ranks are up;
        `start`: the CUDA memory snapshot before anything was allocated)."""
        config, device, dtype = self.config, self.device, self.dtype
        executor = self.executor
        try:  # the grammar library loads now: a missing one is a start-up error
            get_backend(config.structured_outputs_backend)
        except StructuredOutputsError as exc:
            raise ConfigError(str(exc)) from None
        shard = build_shard(config, path, device, dtype, groups)
        # before the KV pool is sized: on CUDA, a draft model's weights and KV cache are
        # then allocated, so gpu_memory_utilization counts them (as vLLM's profiling does)
        spec = config.speculative_config  # a SpeculativeConfig (EngineConfig parsed it)
        proposer = None if spec is None else self._proposer(spec, path, shard)
        sampler = Sampler(config.seed)  # profiled with the model on CUDA, then the runner's
        num_blocks = kv_blocks(config, shard, device, start, sampler, groups)
        self.model, backend, max_len = shard.model, shard.backend, shard.max_len
        self.arch = arch = shard.arch  # the whole model's (model.config: this rank's share)
        tokenizer = Tokenizer.load(config.tokenizer or path)
        weight_bytes, per_block = shard.weight_bytes, shard.per_block
        lora = self._lora_manager(shard) if config.enable_lora else None
        name = config.model_name
        eos = tuple(dict.fromkeys(tuple(arch.eos_token_ids) + tuple(tokenizer.eos_token_ids)))
        # every layer slides with one window: blocks behind it are freed (null block 0);
        # layers of different windows: one block table per KV group (kv_cache/hybrid.py)
        groups_layout = shard.kv_groups
        kv: KVCacheManager
        if groups_layout is None:
            kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                enable_events=config.enable_kv_events,
                                sliding_window=uniform_window(arch.layer_windows))
        else:
            kv = HybridKVCacheManager(num_blocks, config.block_size, groups_layout.windows,
                                      config.enable_prefix_caching, config.enable_kv_events)
        state = EngineState(str(path), name, max_len, config.block_size, num_blocks,
                            per_block, arch.vocab_size, weight_bytes, config.quantization,
                            config.kv_cache_dtype,
                            kv_null_blocks=num_blocks - kv.pool.num_usable_blocks)
        caches = allocate_kv_caches(shard, num_blocks)
        runner = ModelRunner(self.model, backend, caches, kv, sampler, device, executor)
        if groups_layout is not None:
            runner.use_groups(groups_layout)
            if not config.enforce_eager and device.type == "cuda":
                logger.warning("CUDA graphs off: a model whose layers mix attention windows "
                               "runs eagerly (per-group KV block tables)")
        else:
            # decode graphs replay fixed buffers: steps with LoRA adapters run eagerly
            # (their slot plan changes every step); every tensor-parallel rank builds the
            # same graphs (parallel/worker.py) and replays them in the steps whose plan
            # says so
            runner.graphs = build_decode_graphs(config, self.model, backend, caches,
                                                max_len, device)
        runner.lora = lora
        runner.arch = arch  # which KV heads each rank holds (pages gathered layer by layer)
        runner.kv_pages = KVPageIO(self)
        scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                              config.max_waiting, config.long_prefill_token_threshold,
                              max_loras=config.max_loras if lora else 0)
        speculator = None
        if proposer is not None:
            runner.return_hidden = proposer.needs_hidden_states
            speculator = Speculator(spec, proposer, max_len,
                                    config.max_num_batched_tokens)
        runner.bitmask.vocab_size = arch.vocab_size  # the logits' width (every rank's)
        super().__init__(state, scheduler, runner, OutputProcessor(tokenizer), eos, speculator,
                         async_scheduling=config.async_scheduling,
                         structured_outputs_backend=config.structured_outputs_backend)
        self.lora = lora
        logger.info("engine ready in %.1fs: %s on %s in %s (weights %.0f MiB, quantization "
                    "%s), %d KV blocks of %d tokens (%.0f MiB, %s), max_model_len %d, "
                    "attention %s", time.perf_counter() - t0, name, device,
                    str(dtype).removeprefix("torch."), weight_bytes / 2**20,
                    config.quantization or "none", num_blocks, config.block_size,
                    num_blocks * per_block / 2**20, config.kv_cache_dtype, max_len,
                    backend.name)

    def _lora_manager(self, shard: Shard) -> LoRAManager:
        """Slot stacks in every decoder linear (this rank's shard of them), the configured
        adapters registered; with tensor parallelism each load into a slot is sent to the
        other ranks too (`_send_adapter`)."""
        cfg = self.config
        manager = LoRAManager(self.model, shard.arch, LoRAConfig(
            cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, tuple(cfg.lora_dirs)),
            self.device, self.dtype, shard.ops.lib, shard.tp)
        if self.executor.world > 1:
            manager.on_load = self._send_adapter
        for i, (name, path) in enumerate((cfg.lora_modules or {}).items(), start=1):
            manager.add(LoRARequest(name, i, path), trusted=True)
        logger.info("LoRA: %d slots of rank %d (%.1f MiB), %d adapters at start",
                    cfg.max_loras, cfg.max_lora_rank, manager.slot_bytes / 2**20,
                    len(manager.registered))
        return manager

    def _send_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        """Engine thread: the other ranks load `adapter` into `slot` (a LORA_LOAD plan, then
        its weights as one float32 broadcast; each rank keeps its shard)."""
        ex = self.executor
        ex.send(StepPlan.control(PlanKind.LORA_LOAD, adapter_ids(slot, adapter.weights)))
        data = adapter_data(adapter.weights)
        try:
            if data.numel():
                broadcast(ex.groups.ctrl, data)
        except Exception as exc:  # the ranks are out of step: the engine's end
            raise ex.failure(exc) from exc

    def _proposer(self, spec: SpeculativeConfig, path: Path, shard: Shard) -> Proposer:
        """The proposer `spec` configures, for the target model in `shard`. It runs on rank 0
        only, unsharded: with tensor parallelism it gets no target model (rank 0's shard
        runs collectives) and reads what it needs of the target from `path`."""
        cfg = self.config
        whole = shard.tp is None or shard.tp.world == 1
        ctx = ProposerContext(spec, cfg, shard.model if whole else None, str(path),
                              self.device, self.dtype, shard.arch.vocab_size, cfg.block_size,
                              shard.max_len, cfg.max_num_seqs)
        proposer = build_proposer(ctx)
        logger.info("speculative decoding: %s, up to %d tokens (adaptive %s)%s", spec.method,
                    spec.num_speculative_tokens, spec.adaptive,
                    "" if whole else ", unsharded on rank 0")
        return proposer

    @property
    def num_kv_heads(self) -> int:
        """The model's KV heads (each tensor-parallel rank's cache holds its share)."""
        return self.arch.num_kv_heads

    @property
    def kv_in_place(self) -> bool:
        """Whether `runner.kv_caches` holds every KV head (one rank), so other threads may
        read and write pinned pages there directly; with tensor parallelism pages move only
        through `export_kv` / `import_kv` on the engine thread."""
        return self.runner.executor is None

    def page_layout(self, model_id: str) -> PageLayout:
        """The layout of this engine's KV pages on the wire (in the format its attention
        backend allocated them: `AttentionBackend.kv_format`), with all of the model's KV
        heads whatever the tensor-parallel size (each rank's cache holds a share)."""
        layout = PageLayout.of(model_id, self.runner.kv_caches,
                               self.runner.backend.kv_format.name,
                               self.runner.backend.block_size)
        return dataclasses.replace(layout, num_kv_heads=self.num_kv_heads)

    def export_kv(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Engine thread only. Pinned `block_ids`' pages with every KV head, `[2, n, KVH,
        bs, row]` per layer on the host: copied out of this process's cache with one rank,
        gathered from the ranks with tensor parallelism."""
        ex = self.runner.executor
        caches = self.runner.kv_caches
        if ex is None:
            index = block_index(block_ids, caches[0][0].device)
            return [gather_layer(caches, layer, block_ids, index).cpu()
                    for layer in range(len(caches))]
        ex.send(StepPlan.control(PlanKind.KV_GATHER, block_ids))
        try:
            return gather_pages(ex.groups.ctrl, caches, block_ids, self.arch, ex.world)
        except Exception as exc:  # the ranks are out of step: the engine's end
            raise ex.failure(exc) from exc

    def import_kv(self, block_ids: list[int], pages: list[torch.Tensor]) -> None:
        """Engine thread only. Write full-head `pages` (one `[2, n, KVH, bs, row]` per
        layer, any device) into pinned `block_ids`: into this process's cache with one
        rank, each rank its own heads with tensor parallelism."""
        ex = self.runner.executor
        caches = self.runner.kv_caches
        if len(pages) != len(caches):
            raise ValueError(f"pages for {len(pages)} layers; the model has {len(caches)}")
        if ex is None:
            index = block_index(block_ids, caches[0][0].device)
            for layer, layer_pages in enumerate(pages):
                scatter_layer(caches, layer, block_ids, layer_pages, index)
            return
        ex.send(StepPlan.control(PlanKind.KV_SCATTER, block_ids))
        try:
            scatter_pages(ex.groups.ctrl, caches, block_ids, pages, self.arch, ex.world)
        except Exception as exc:  # the ranks are out of step: the engine's end
            raise ex.failure(exc) from exc

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do with one); idempotent."""
        self.executor.shutdown()

    def model_memory_bytes(self) -> int:
        """Resident bytes of the model's weights (every parameter and quantized buffer)."""
        return self.state.model_memory_bytes

    def stats(self) -> EngineStats:
        """The core's stats, with the model runner's graph vs eager step counts."""
        return dataclasses.replace(super().stats(), step_paths=self.runner.step_paths())


class KVPageIO:
    """Full-head KV pages (`[2, n, KVH, bs, row]` per layer) in and out of an engine's cache,
    the same whatever the tensor-parallel size: a connector's worker side reads and writes
    through it (`KVConnectorWorker.pages`), on the engine thread only. `read` exports pinned
    blocks (`LLMEngine.export_kv`); `write` puts one layer of a load into the cache at once
    with one rank, and with several keeps it until the model runner's `flush`, which hands
    every rank its heads (`LLMEngine.import_kv`: a KV_SCATTER plan) before the step's
    forward plan goes out."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._staged: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}

    def read(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every layer's pages of pinned `block_ids`, on the host."""
        return self._engine.export_kv(block_ids)

    def write(self, layer: int, block_ids: list[int], pages: torch.Tensor) -> None:
        """Layer `layer`'s pages of `block_ids` (the cache's dtype, any device)."""
        caches = self._engine.runner.kv_caches
        if self._engine.kv_in_place:
            scatter_layer(caches, layer, block_ids, pages)
        else:
            self._staged.setdefault(tuple(block_ids), {})[layer] = pages.detach().clone()

    def flush(self) -> None:
        """Hand what `write` kept to the ranks (nothing to do with one rank). RuntimeError
        when a block set was written for some layers only (nothing of it is written)."""
        staged, self._staged = self._staged, {}
        num_layers = len(self._engine.runner.kv_caches)
        for ids, layers in staged.items():
            if len(layers) != num_layers:
                raise RuntimeError(f"pages of blocks {list(ids)} were written for "
                                   f"{len(layers)} of {num_layers} layers")
        for ids, layers in staged.items():
            self._engine.import_kv(list(ids), [layers[i] for i in range(num_layers)])
