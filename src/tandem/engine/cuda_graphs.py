"""CUDA graphs of decode steps: one launch replays every kernel of a forward pass.

A decode step launches a few hundred small kernels; on a GPU their launch overhead, not the
math, bounds it. `DecodeGraphRunner` captures the model's forward once per padded batch size
(largest first, all graphs sharing one memory pool) over fixed input buffers: token ids,
positions, logits rows, and the attention backend's static metadata (block tables
`[max size, cdiv(max_model_len, block_size)]`, context lengths, KV slots). Each step copies
its inputs into those buffers, padding the batch to the next captured size (padding rows
have context length 0 and KV slot -1, so attention and the cache write skip them), replays,
and hands the real rows' logits to the sampler, which runs outside the graph.

Not applicable (the caller runs eagerly): a step with prefill tokens, prompt logprobs, a
layer observer, LoRA adapters or hidden states for a proposer, a batch above the largest
size (`padded_size` None), a backend without `supports_cuda_graphs`. Rank 0 decides and the
step's plan says so (`StepPlan.graphs`), so with tensor parallelism every rank replays its
own graphs in the same step (their collectives captured with them: NCCL on CUDA); ranks
> 0 hold no logits (gathered to rank 0) and `run` returns None there. Rank 0 counts each
step's path and, for eager ones, why (`model_runner.EAGER_REASONS`;
`tandem_engine_steps_total{path, reason}` on the worker's /metrics).
`capture=False` runs the same static-buffer forward eagerly: the path tests check on the
CPU. `build_decode_graphs` decides at engine start: graphs on CUDA unless
`enforce_eager`; on other devices none, unless the environment sets `TANDEM_STATIC_DECODE=1`
(tests, benchmarks: the static path without capture, on any device).
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections import Counter

import torch

from tandem.engine.attention.base import AttentionBackend, BatchLayout
from tandem.engine.config import EngineConfig
from tandem.engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MAX_DEFAULT_SIZE = 256
STATIC_DECODE_ENV = "TANDEM_STATIC_DECODE"


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 8 up to min(max_num_seqs, 256), and that bound."""
    top = min(max_num_seqs, MAX_DEFAULT_SIZE)
    sizes = [n for n in (1, 2, 4) if n <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


class DecodeGraphRunner:
    """Decode forwards over static buffers, replayed from CUDA graphs when `capture`."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sizes: tuple[int, ...],
                 max_model_len: int, device: torch.device, capture: bool) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} has no static decode path")
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = tuple(sorted(set(sizes)))
        self.device = device
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(top, dtype=torch.int64, device=device)
        self.metas = backend.static_decode_metadata(self.sizes, max_model_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [top, V]: what every graph writes
        self.runs: Counter[int] = Counter()  # padded size -> steps it ran
        if capture:
            self._capture()

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                          self.metas[size], self.logits_indices[:size])

    @torch.inference_mode()
    def _capture(self) -> None:
        """Warm up each size eagerly (compiles the kernels, sets up cuBLAS), then capture it.
        The all-padding inputs write no KV and attend nothing. Logits are copied into one
        buffer inside each graph, so nothing a graph allocates outlives its capture and the
        shared pool is reused by every capture after the first (largest)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            out = self._forward(size)  # None on tensor-parallel ranks > 0
            if self.logits is None and out is not None:
                self.logits = torch.empty(self.sizes[-1], out.shape[-1], dtype=out.dtype,
                                          device=self.device)
            del out
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
                if self.logits is not None:
                    self.logits[:size].copy_(out)
                del out
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def padded_size(self, batch: int) -> int | None:
        """The smallest captured size holding `batch` rows; None above the largest."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            layout: BatchLayout) -> torch.Tensor | None:
        """Logits [B, V] of a decode-only step whose every row samples (input_ids and
        positions [B] on the device; None on tensor-parallel ranks > 0). The tensor is only
        valid until the next `run`. ValueError when the step is not one the static path
        holds (prefill rows, or more rows than `padded_size` takes)."""
        b = len(layout.seq_lens)
        size = self.padded_size(b) if layout.num_decodes == b else None
        if size is None:
            raise ValueError(f"a step of {b} rows ({layout.num_decodes} decodes) is not a "
                             f"decode batch of at most {self.sizes[-1]}")
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.backend.build_metadata(layout, out=self.metas[size])
        self.runs[size] += 1
        graph = self.graphs.get(size)
        if graph is None:
            out = self._forward(size)
            return None if out is None else out[:b]
        graph.replay()
        return None if self.logits is None else self.logits[:b]


def build_decode_graphs(config: EngineConfig, model: LlamaForCausalLM,
                        backend: AttentionBackend,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_model_len: int,
                        device: torch.device) -> DecodeGraphRunner | None:
    """The engine's decode graphs (after its KV caches exist), or None to run eagerly."""
    static = os.environ.get(STATIC_DECODE_ENV) == "1"
    if config.enforce_eager or not (device.type == "cuda" or static):
        return None
    if not backend.supports_cuda_graphs:
        logger.info("CUDA graphs off: attention backend %r has none", backend.name)
        return None
    sizes = config.cuda_graph_sizes or default_graph_sizes(config.max_num_seqs)
    capture = device.type == "cuda" and not static
    if capture and not getattr(model, "cuda_graph_safe", True):
        logger.info("CUDA graphs off: the model's mixture-of-experts layers run grouped "
                    "through quantized experts, which reads token counts back to the host")
        return None
    t0 = time.perf_counter()
    try:
        runner = DecodeGraphRunner(model, backend, kv_caches, sizes, max_model_len, device,
                                   capture)
    except RuntimeError as e:  # no silent fallback: the user picks eager explicitly
        raise RuntimeError(f"capturing decode CUDA graphs failed ({e}); enforce_eager=True "
                           "(--enforce-eager) runs without them") from e
    logger.info("decode %s for batch sizes %s in %.1fs",
                "CUDA graphs captured" if capture else "static buffers (no capture)",
                ",".join(map(str, runner.sizes)), time.perf_counter() - t0)
    return runner
