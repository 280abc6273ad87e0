"""Triton backend: paged attention read straight from the block table, on GPUs (and on the
CPU under Triton's interpreter, for tests).

Same cache layout as the torch backend (K and V each `[num_blocks, KVH, block_size, D]`, a
block one contiguous page; with kv_cache_dtype "fp8" / "int8" uint8 pages
`[num_blocks, KVH, block_size * (D + 2)]` of codes then float16 scales, quantized by
`reshape_and_cache` and read as aligned code tiles in the attention kernels). Per step,
`build_metadata` packs the batch's int32 indices (block tables, context lengths, query
offsets, KV slots) into one host buffer, pinned and reused on CUDA, and uploads it with one
non-blocking copy; every layer then runs
`reshape_and_cache` and one attention launch: the varlen kernel for a batch with any
prefill, or the decode kernel (split-KV when `choose_num_splits` says the batch is too small
to fill the GPU) for a decode-only one. `forward` does no host work, so a decode step over
the fixed buffers of `static_decode_metadata` can be captured as a CUDA graph.

The metadata holds no window or scale (the launches take them), so layers of different
windows and scales (`for_layer` views) share it. Score soft caps are not in the kernels:
"auto" serves such models with the torch backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.engine.attention.base import (
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    register_backend,
)
from tandem.engine.errors import ConfigError
from tandem.engine.kernels import triton_unavailable_reason


@dataclass
class TritonAttentionMetadata:
    """One step's device-side indices (int32) plus the host values the launches need."""

    block_tables: torch.Tensor  # [B, W] block ids (padding rows/columns: anything)
    seq_lens: torch.Tensor  # [B] context length after the step (0: padding row, skipped)
    query_start: torch.Tensor  # [B + 1] cumulative new-token counts
    slot_mapping: torch.Tensor  # [T] cache slot of each new token (-1: padding, skipped)
    num_seqs: int
    max_query_len: int
    num_splits: int = 1  # decode-only batches: KV splits per sequence
    workspace: Any = None  # DecodeWorkspace of the split-KV decode (num_splits > 1)
    padded: bool = False  # fixed buffers (static_decode_metadata): rows may be padding

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graphs = True

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto") -> None:
        super().__init__(spec, block_size, dtype, device, kv_cache_dtype)
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ConfigError(f"attention backend 'triton' cannot run on {device}: {reason}")
        _check_softcap(spec)
        from tandem.engine.kernels import triton_attention, triton_ops

        self._attn = triton_attention
        self._write = triton_ops.reshape_and_cache
        self.window = spec.sliding_window or 0
        # streaming multiprocessors the split-KV heuristic fills; the interpreter runs one
        # program at a time, so the CPU counts as one (tests raise it to force splits)
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None  # pinned staging buffer (CUDA)
        self._uploaded: torch.cuda.Event | None = None  # the last copy out of it
        self._workspace: Any = None

    def allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._zero_kv_cache(num_blocks)

    def _view(self, spec: AttentionSpec) -> TritonAttentionBackend:
        _check_softcap(spec)
        view = super()._view(spec)
        assert isinstance(view, TritonAttentionBackend)
        view.window = spec.sliding_window or 0
        return view

    def metadata_builder(self, window: int | None) -> TritonAttentionBackend:
        """As the base's, with its own pinned staging buffer: the groups' uploads of one
        step must not overwrite each other's (the kernels take the window per launch)."""
        builder = super().metadata_builder(window)
        assert isinstance(builder, TritonAttentionBackend)
        builder._host, builder._uploaded = None, None
        return builder

    # host staging --------------------------------------------------------------------------

    def _staging(self, n: int) -> torch.Tensor:
        """An int32 host buffer of `n` elements: on CUDA the reused pinned one, once the last
        non-blocking copy out of it has finished; on the CPU a fresh tensor."""
        if not self._cuda:
            return torch.empty(n, dtype=torch.int32, device="cpu")
        if self._uploaded is not None:
            self._uploaded.synchronize()
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * (0 if self._host is None else
                                                 self._host.numel()), 4096),
                                     dtype=torch.int32, device="cpu", pin_memory=True)
        return self._host[:n]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if not self._cuda:
            return host
        dev = host.to(self.device, non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        return dev

    def _splits(self, batch: int, max_seq_len: int) -> tuple[int, Any]:
        """Split count for a decode batch, and a workspace big enough for it."""
        n = self._attn.choose_num_splits(batch, self.spec.num_kv_heads, max_seq_len,
                                         self.num_sms)
        if n <= 1:
            return 1, None
        return n, self._grown_workspace(batch, n)

    def _grown_workspace(self, rows: int, splits: int) -> Any:
        """The split-KV workspace, grown (never shrunk) to hold `rows` x `splits`; one it
        replaces lives on in the metadata (and CUDA graphs) that hold it."""
        ws = self._workspace
        have_rows, have_splits = (0, 0) if ws is None else (ws.m.shape[0], ws.num_splits)
        if rows > have_rows or splits > have_splits:
            self._workspace = self._attn.DecodeWorkspace.allocate(
                max(rows, have_rows), self.spec.num_heads, self.spec.head_dim,
                max(splits, have_splits), self.device)
        return self._workspace

    # metadata ------------------------------------------------------------------------------

    def build_metadata(self, layout: BatchLayout,
                       out: TritonAttentionMetadata | None = None) -> TritonAttentionMetadata:
        """This step's metadata; with `out` (from `static_decode_metadata`), a decode-only
        batch written into out's fixed buffers instead, padded to its rows."""
        if out is not None:
            return self._fill_static(layout, out)
        b, t = len(layout.seq_lens), layout.num_tokens
        table = layout.block_table  # [b, w] zero-padded
        w = table.shape[1]
        host = self._staging(b * w + b + (b + 1) + t)
        arr = host.numpy()
        arr[: b * w].reshape(b, w)[:] = table  # host packing: one copy per step
        arr[b * w : b * w + b] = layout.seq_lens
        qs = arr[b * w + b : b * w + 2 * b + 1]
        qs[0] = 0
        np.cumsum(layout.query_lens, out=qs[1:])
        host[b * w + 2 * b + 1 :].copy_(layout.slot_mapping)
        dev = self._upload(host)
        max_q = max(layout.query_lens)
        meta = TritonAttentionMetadata(
            dev[: b * w].view(b, w), dev[b * w : b * w + b], dev[b * w + b : b * w + 2 * b + 1],
            dev[b * w + 2 * b + 1 :], b, max_q)
        if max_q == 1:
            meta.num_splits, meta.workspace = self._splits(b, max(layout.seq_lens))
        return meta

    def static_decode_metadata(self, sizes: Sequence[int],
                               max_model_len: int) -> dict[int, TritonAttentionMetadata]:
        """Decode metadata for batches padded to each of `sizes` rows, views of one set of
        fixed buffers (block tables `[max(sizes), cdiv(max_model_len, block_size)]`), with a
        split count fixed per size (the kernel splits each row's own length in-kernel)."""
        top = max(sizes)
        width = -(-max_model_len // self.block_size)
        d = self.device
        tables = torch.zeros(top, width, dtype=torch.int32, device=d)
        lens = torch.zeros(top, dtype=torch.int32, device=d)
        starts = torch.arange(top + 1, dtype=torch.int32, device=d)
        slots = torch.full((top,), -1, dtype=torch.int32, device=d)
        splits = {b: self._attn.choose_num_splits(b, self.spec.num_kv_heads, max_model_len,
                                                  self.num_sms) for b in sizes}
        split = {b: n for b, n in splits.items() if n > 1}
        ws = self._grown_workspace(max(split), max(split.values())) if split else None
        return {b: TritonAttentionMetadata(tables[:b], lens[:b], starts[: b + 1], slots[:b],
                                           b, 1, max(1, n), ws if n > 1 else None, True)
                for b, n in splits.items()}

    def _fill_static(self, layout: BatchLayout,
                     out: TritonAttentionMetadata) -> TritonAttentionMetadata:
        b, rows = len(layout.seq_lens), out.num_seqs
        if layout.num_decodes != b or b > rows:
            raise ValueError(f"static metadata holds up to {rows} decodes, got "
                             f"{layout.num_decodes} decodes in a batch of {b}")
        table = layout.block_table  # [b, w] zero-padded
        w = table.shape[1]
        if w > out.block_tables.shape[1]:
            raise ValueError(f"block table of {w} blocks exceeds the static width "
                             f"{out.block_tables.shape[1]}")
        host = self._staging(2 * rows + b * w)
        arr = host.numpy()
        arr[:b] = layout.seq_lens
        arr[b:rows] = 0  # padding rows: skipped by the kernel
        host[rows : rows + b].copy_(layout.slot_mapping)
        arr[rows + b : 2 * rows] = -1  # padding tokens: not written to the cache
        arr[2 * rows :].reshape(b, w)[:] = table
        dev = self._upload(host)
        out.seq_lens.copy_(dev[:rows])
        out.slot_mapping.copy_(dev[rows : 2 * rows])
        out.block_tables[:b, :w].copy_(dev[2 * rows :].view(b, w))
        return out

    # forward -------------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: TritonAttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        fmt, bs = self.kv_format.name, self.block_size
        self._write(k, v, k_cache, v_cache, meta.slot_mapping, kv_cache_dtype=fmt, block_size=bs)
        # padding rows are never attended: zero them, so no garbage flows through the layer
        alloc = torch.zeros if meta.padded else torch.empty
        out = alloc(q.shape, dtype=q.dtype, device=q.device)
        scale = self.spec.scale
        if meta.decode_only:
            self._attn.paged_decode_attention(
                q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, scale=scale,
                sliding_window=self.window, num_splits=meta.num_splits,
                workspace=meta.workspace, kv_cache_dtype=fmt, block_size=bs)
        else:
            self._attn.paged_attention(
                q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start,
                scale=scale, max_query_len=meta.max_query_len, sliding_window=self.window,
                kv_cache_dtype=fmt, block_size=bs)
        return out



def _check_softcap(spec: AttentionSpec) -> None:
    if spec.logit_softcap is not None:
        raise ConfigError("attention backend 'triton' has no attention logit soft cap; use "
                          "'torch'")
