"""The draft model of `draft.py` and its own paged KV cache.

The draft is either a second model (a .gguf file or an HF directory, loaded the way
`LLMEngine` loads the target: built on meta, quantized there, streamed onto the device) or a
view of the target's first N decoder layers with its final norm and LM head (no weight is
copied). Its KV cache is a separate block pool in the engine's discipline: a request holds a
list of blocks, token position p lives in slot `blocks[p // block_size] * block_size +
p % block_size`; a `DraftKV` keeps, per request, the tokens whose KV is written there.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.engine.attention.base import (
    AttentionBackend,
    BatchLayout,
    resolve_backend,
)
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.block_pool import BlockPool, KVBlock
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.model.cpu_linear import packing_available
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.loader import open_model
from tandem.engine.model.ops import Ops
from tandem.engine.model.registry import build_model
from tandem.engine.model_build import attention_spec
from tandem.engine.quant.apply import convert_linears, plan_quantization, prepare_model
from tandem.engine.quant.float_methods import PackedMethod
from tandem.engine.staging import upload


def truncated_view(model: DecoderForCausalLM, num_layers: int) -> DecoderForCausalLM:
    """`model` with only its first `num_layers` decoder layers (final norm, LM head, RoPE
    tables and every weight shared, not copied)."""
    if not 1 <= num_layers <= len(model.layers):
        raise ConfigError(f"speculative_config.draft_num_layers must be in [1, "
                          f"{len(model.layers)}] for this model, got {num_layers}")
    view = copy.copy(model)  # shallow: the same submodules and tensors
    view._modules = dict(model._modules)  # own registry: the swap below stays local
    view._parameters, view._buffers = dict(model._parameters), dict(model._buffers)
    view.layers = model.layers[:num_layers]
    view.config = model.config.with_layers(num_layers)
    return view


def _first_layers(items: Iterable[tuple[str, Any]], n: int) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors without those of decoder layers n and above."""
    for name, tensor in items:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= n:
            continue
        yield name, tensor


def load_model(path: str | Path, engine_config: Any, device: torch.device, dtype: torch.dtype,
               max_positions: int, block_size: int, num_layers: int | None = None,
               quantization: str | None = None) -> tuple[DecoderForCausalLM, AttentionBackend]:
    """A model from `path` as `LLMEngine` builds its target (same attention backend choice,
    KV cache dtype, CPU linear packing), optionally truncated to its first `num_layers`
    layers and quantized by `quantization` (an `EngineConfig.quantization` mode)."""
    cfg = engine_config
    source = open_model(path, dtype, keep_quantized=quantization is not None)
    arch = source.config
    max_positions = min(max_positions, arch.max_position_embeddings)
    if num_layers is not None:
        if not 1 <= num_layers <= arch.num_layers:
            raise ConfigError(f"speculative_config.draft_num_layers must be in [1, "
                              f"{arch.num_layers}] for {path}, got {num_layers}")
        arch = arch.with_layers(num_layers)
    spec = attention_spec(arch)
    backend = resolve_backend(cfg.attention_backend, spec, dtype, device,
                              native=cfg.native_kernels)(
        spec, block_size, dtype, device, kv_cache_dtype=cfg.kv_cache_dtype)
    ops = Ops(cfg.native_kernels, device, dtype, triton=backend.name == "triton")
    plan = plan_quantization(quantization, arch, source.formats, device, ops.lib,
                             cfg.quantization_group_size, str(path))
    with torch.device("meta"):
        model = build_model(arch, backend, max_positions=max_positions, ops=ops)
        prepare_model(model, plan, dtype)
    model.materialize(device, dtype)
    model.load_weights(_first_layers(source.tensors(progress=False), arch.num_layers))
    model.eval()
    if cfg.cpu_linear == "packed" and packing_available(dtype, device, ops.lib):
        convert_linears(model, lambda: PackedMethod(device=device, native=ops.lib,
                                                    dtype=dtype))
    return model, backend


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of `a` and `b`, at most `limit`: a binary
    search over slice equality (prefix equality is monotone), C-speed list compares."""
    hi = max(0, min(len(a), len(b), limit))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds, a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class DraftSeq:
    """One request's draft KV: `tokens[p]` is the token whose K/V sit at position p."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)


class DraftKV:
    """The draft's paged KV cache: per-layer K/V tensors, a block pool and each request's
    `DraftSeq`, in least-recently-used order. A request short of blocks may take those of
    requests not `protected` (the LRU ones first; their draft KV is recomputed when they
    come back), never anyone else's."""

    def __init__(self, backend: AttentionBackend, num_layers: int, num_blocks: int,
                 block_size: int) -> None:
        self.backend, self.block_size = backend, block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.caches = [backend.allocate_kv_cache(num_blocks) for _ in range(num_layers)]
        self.seqs: OrderedDict[str, DraftSeq] = OrderedDict()
        self.num_evictions = 0

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    def known(self, rid: str, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` (short of the last) the request's draft KV
        holds (read-only; `reconcile` keeps exactly these)."""
        seq = self.seqs.get(rid)
        return 0 if seq is None else common_prefix(seq.tokens, token_ids,
                                                   len(token_ids) - 1)

    def reconcile(self, rid: str, token_ids: list[int]) -> DraftSeq:
        """The request's state, kept only over its longest common prefix with `token_ids`
        and short of the last token (whose logits the next forward must produce)."""
        seq = self.seqs.get(rid)
        if seq is None:
            seq = self.seqs[rid] = DraftSeq()
        self.seqs.move_to_end(rid)
        del seq.tokens[common_prefix(seq.tokens, token_ids, len(token_ids) - 1):]
        return seq

    def reserve(self, seq: DraftSeq, num_tokens: int, protected: set[str]) -> bool:
        """Exactly the blocks for `num_tokens` positions (tail blocks beyond freed);
        False, with the state unchanged, when the pool cannot supply them."""
        need = cdiv(num_tokens, self.block_size) - len(seq.blocks)
        if need <= 0:
            if need < 0:
                self.pool.free_blocks(reversed(seq.blocks[need:]))
                del seq.blocks[need:]
            return True
        if need > self.pool.num_blocks:
            return False
        while self.pool.num_free_blocks() < need:
            victim = next((r for r in self.seqs if r not in protected), None)
            if victim is None:
                return False
            self.release(victim)
            self.num_evictions += 1
        seq.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def release(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.pool.free_blocks(reversed(seq.blocks))

    @torch.inference_mode()
    def forward(self, model: DecoderForCausalLM, device: torch.device,
                rows: list[tuple[DraftSeq, list[int]]]) -> torch.Tensor:
        """Append each row's tokens to its sequence through the draft (blocks reserved
        beforehand) and return the logits [len(rows), V] at each row's last token, in
        `rows`' order. One forward: single-token rows first, by context length."""
        bs = self.block_size
        order = sorted(range(len(rows)), key=lambda i: (
            len(rows[i][1]) != 1, len(rows[i][0].tokens) if len(rows[i][1]) == 1 else 0))
        n = sum(len(toks) for _, toks in rows)
        tokens, positions, slots = (np.empty(n, dtype=np.int64) for _ in range(3))
        last = np.empty(len(rows), dtype=np.int64)
        query_lens, seq_lens, tables = [], [], []
        off = 0
        for i in order:
            seq, toks = rows[i]
            start, m = len(seq.tokens), len(toks)
            pos = np.arange(start, start + m, dtype=np.int64)
            ids = np.fromiter((b.block_id for b in seq.blocks), dtype=np.int64,
                              count=len(seq.blocks))
            tokens[off:off + m], positions[off:off + m] = toks, pos
            slots[off:off + m] = ids[pos // bs] * bs + pos % bs
            query_lens.append(m)
            seq_lens.append(start + m)
            tables.append(ids[: cdiv(start + m, bs)].tolist())
            off += m
            last[i] = off - 1
            seq.tokens.extend(toks)
        nd = next((j for j, q in enumerate(query_lens) if q != 1), len(rows))
        layout = BatchLayout(query_lens, seq_lens, tables, torch.from_numpy(slots), nd, bs)
        flat = upload(np.concatenate([tokens, positions, last]), torch.int64, device)
        ids_t, pos_t, idx_t = flat.split([n, n, len(rows)])
        return model(ids_t, pos_t, self.caches, self.backend.build_metadata(layout), idx_t)
