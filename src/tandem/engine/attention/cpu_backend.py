"""CPU backend: attention reads K/V straight from the paged cache with native kernels.

The torch backend gathers every decode's context into a dense copy per layer and then runs
SDPA over it: the KV bytes cross memory three times. Here C kernels built by
`tandem.engine.native` walk each sequence's block table and read every K/V row once:
`csrc/paged_attention_cpu.c` for decodes, and (with AVX2 + FMA) the flash-style
`csrc/prefill_attention_cpu.c` for prefill chunks, which stacks the query heads that share
a KV head and skips the causal upper triangle that torch's CPU flash kernel computes and
masks for chunks under ~1k tokens. Without AVX2 the prefill stays on the torch path.
K/V writes stay in torch.

float32 and bfloat16 models: a bfloat16 model's q, out and KV cache stay bfloat16 in memory
(half the bytes per context token) and the kernels widen each row exactly as they read it,
so scores, softmax and the P V sums are float32; outputs round to bfloat16 once.

With a quantized KV cache ("fp8" / "int8", `kv_cache/quant.py`: per block and KV head a
page of codes, then their float16 scales) decodes read the uint8 pages directly
(about a quarter of the bytes of float32 per context token), and new float32 K/V are
quantized straight into them (`tandem_kv_quantize_write`); a prefill chunk's
context blocks are dequantized into a float32 scratch of just those blocks (remapped
tables) for the float prefill kernel, which costs one pass over the context per layer
against the chunk's attention over it.

The kernels take the sliding window and scale per call, so one step's metadata serves layers
of any window (`for_layer`); only the torch prefill path, without AVX2, builds masks per
window. Score soft caps are not in the kernels: such models use the torch backend.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from tandem.engine.attention.base import (
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    register_backend,
)
from tandem.engine.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    biting_window,
    per_window,
    write_then_attend,
)
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.quant import dequantize_pages
from tandem.engine.native import load_native

MAX_GROUP = 64  # query heads per KV head the kernels support
DTYPES = (torch.float32, torch.bfloat16)  # model dtypes the kernels take
KV_BF16 = 3  # the kernels' cache format code for bfloat16 rows (0: float32, 1/2: quantized)
PREFILL_KEY_TILE = 16  # keys per tile of the prefill kernel; block_size must be a multiple


@dataclass
class NativePrefills:
    """Every prefill chunk of the batch, as the prefill kernel reads them (int32 tensors)."""

    tables: torch.Tensor  # [P, max_blocks] block ids, zero-padded
    q_start: torch.Tensor  # [P] first row of each chunk in the flattened batch
    q_lens: torch.Tensor  # [P] new tokens per chunk
    seq_lens: torch.Tensor  # [P] context length after the chunk


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    decode_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32 context lengths
    native_prefills: NativePrefills | None = None  # set when the prefill kernel runs
    # quantized cache + prefill kernel: the prefills' distinct blocks [U] int64 (dequantized
    # per layer into a scratch cache) and native_prefills.tables remapped into it
    prefill_blocks: torch.Tensor | None = None


def native_available(spec: AttentionSpec, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the `cpu` backend can run this model here (else use `torch`)."""
    return (device.type == "cpu" and dtype in DTYPES
            and 1 <= spec.num_heads // spec.num_kv_heads <= MAX_GROUP
            and spec.logit_softcap is None and load_native() is not None)


@register_backend("cpu")
class CpuAttentionBackend(AttentionBackend):
    """Native decode (and, with AVX2, prefill) kernels over the paged cache; the torch
    backend it owns builds the shared metadata and runs what the kernels do not."""

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto") -> None:
        super().__init__(spec, block_size, dtype, device, kv_cache_dtype)
        if not native_available(spec, dtype, device):
            raise ConfigError("attention backend 'cpu' needs a CPU device, float32 or "
                              "bfloat16, a C compiler, at most 64 query heads per KV head, "
                              "and no attention logit soft cap")
        self._torch = TorchAttentionBackend(spec, block_size, dtype, device, kv_cache_dtype)
        lib = load_native()
        self._kernel = lib.tandem_paged_attention_decode
        self._quantize_write = lib.tandem_kv_quantize_write
        self._io_bf16 = int(dtype == torch.bfloat16)  # q and out
        # the cache rows as the decode kernel reads them, and as the prefill kernel does
        # (a quantized cache's chunks go to it dequantized to float32)
        self._kv_fmt = (self.kv_format.code if self.kv_format.quantized
                        else KV_BF16 if self._io_bf16 else 0)
        self._prefill_kv_fmt = 0 if self.kv_format.quantized else self._kv_fmt
        self._prefill_kernel = (  # tandem_linear_simd: the library was built with AVX2 + FMA
            lib.tandem_paged_attention_prefill
            if lib.tandem_linear_simd() and spec.head_dim % 16 == 0
            and block_size % PREFILL_KEY_TILE == 0 else None)

    def allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._zero_kv_cache(num_blocks)

    def _view(self, spec: AttentionSpec) -> CpuAttentionBackend:
        if spec.logit_softcap is not None:
            raise ConfigError("attention backend 'cpu' has no attention logit soft cap; use "
                              "'torch'")
        view = super()._view(spec)
        assert isinstance(view, CpuAttentionBackend)
        view._torch = self._torch.for_layer(spec)
        return view

    def build_metadata(self, layout: BatchLayout) -> CpuAttentionMetadata:
        nd = layout.num_decodes
        tables = lens = None
        if nd:
            tables = torch.from_numpy(layout.block_table[:nd])  # rows contiguous
            lens = torch.tensor(layout.seq_lens[:nd], dtype=torch.int32)
        if self._prefill_kernel is None or nd == len(layout.query_lens):
            # torch prefills (if any): masks per window; the decode kernel takes the window
            windows, seq_lens = self.layer_windows, layout.seq_lens
            meta = CpuAttentionMetadata(
                self._torch.write_rows(layout), nd, [],
                self._torch.prefill_seqs(layout, biting_window(windows[0], seq_lens)),
                decode_tables=tables, decode_lens=lens)
            if not meta.prefills:
                return meta
            return per_window(meta, windows, seq_lens, lambda w: replace(
                meta, prefills=self._torch.prefill_seqs(layout, w), by_window={}))
        q_lens = layout.query_lens[nd:]
        starts = list(itertools.accumulate(q_lens[:-1], initial=nd))  # decodes: 1 row each
        table = layout.block_table[nd:]
        blocks = None
        if self.kv_format.quantized:
            table, blocks = _remap_blocks(table, layout.seq_lens[nd:], self.block_size)
        native = NativePrefills(torch.from_numpy(table),
                                torch.tensor(starts, dtype=torch.int32),
                                torch.tensor(q_lens, dtype=torch.int32),
                                torch.tensor(layout.seq_lens[nd:], dtype=torch.int32))
        return CpuAttentionMetadata(self._torch.write_rows(layout), nd, [], [],
                                    decode_tables=tables, decode_lens=lens,
                                    native_prefills=native, prefill_blocks=blocks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: CpuAttentionMetadata) -> torch.Tensor:
        return write_then_attend(self, q, k, v, kv_cache,
                                 meta.for_window(self.spec.sliding_window))

    def write_quantized(self, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                        v_rows: torch.Tensor, meta: TorchAttentionMetadata
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The native quantize-and-scatter (same bytes as `quantize_rows`) for float32 k/v
        whose heads are contiguous; the torch path otherwise or where a torch prefill
        reads the new tokens."""
        s = self.spec
        rows = meta.write_rows
        if meta.prefills or rows.dtype != torch.int64 or not rows.is_contiguous() or not all(
                _heads_contiguous(x, s.head_dim) for x in (k, v)):
            return self._torch.write_quantized(k, v, k_rows, v_rows, meta)
        for x, cache in ((k, k_rows), (v, v_rows)):
            rc = self._quantize_write(cache.data_ptr(), x.data_ptr(), rows.data_ptr(),
                                      x.shape[0], s.num_kv_heads, s.head_dim,
                                      self.block_size, x.stride(0), self.kv_format.code,
                                      torch.get_num_threads())
            _check(rc, "KV quantize")
        return k, v

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_rows: torch.Tensor, v_rows: torch.Tensor, meta: TorchAttentionMetadata,
                out: torch.Tensor) -> None:
        """The prefill chunks: the native kernel where `build_metadata` planned it, else
        the torch backend's path."""
        assert isinstance(meta, CpuAttentionMetadata)
        p = meta.native_prefills
        if p is None:
            self._torch.prefill(q, k, v, k_rows, v_rows, meta, out)
            return
        s = self.spec
        q = _rows_of_heads(q, s.head_dim)
        if meta.prefill_blocks is not None:  # quantized: a float copy of the chunks' blocks
            k_rows, v_rows = (self._dequantized_blocks(rows, meta.prefill_blocks)
                              for rows in (k_rows, v_rows))
        rc = self._prefill_kernel(
            out.data_ptr(), q.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(),
            p.tables.data_ptr(), p.q_start.data_ptr(), p.q_lens.data_ptr(),
            p.seq_lens.data_ptr(), len(p.q_lens), s.num_heads, s.num_kv_heads, s.head_dim,
            self.block_size, p.tables.shape[1], q.stride(0), out.stride(0),
            s.sliding_window or 0, self._prefill_kv_fmt, self._io_bf16, s.scale,
            torch.get_num_threads(),
        )
        _check(rc, "prefill")

    def decode(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """Attention of the first `meta.num_decodes` rows of q into `out` (native)."""
        assert isinstance(meta, CpuAttentionMetadata) and meta.decode_tables is not None
        s = self.spec
        qd = _rows_of_heads(q[: meta.num_decodes], s.head_dim)
        k_cache, v_cache = kv_cache
        tables, lens = meta.decode_tables, meta.decode_lens
        rc = self._kernel(
            out.data_ptr(), qd.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), meta.num_decodes, s.num_heads,
            s.num_kv_heads, s.head_dim, self.block_size, tables.shape[1], qd.stride(0),
            out.stride(0), s.sliding_window or 0, self._kv_fmt, self._io_bf16, s.scale,
            torch.get_num_threads(),
        )
        _check(rc, "decode")

    def _dequantized_blocks(self, pages: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Cache pages [NB * KVH, BS * (D + 2)] uint8 -> blocks `blocks` as a float32 cache
        [U, KVH, BS, D] (contiguous, as the prefill kernel reads it)."""
        picked = pages.view(-1, self.spec.num_kv_heads, pages.shape[-1]).index_select(0, blocks)
        return dequantize_pages(picked, self.kv_format.name, self.block_size, torch.float32)


def _remap_blocks(table: np.ndarray, seq_lens: list[int], block_size: int
                  ) -> tuple[np.ndarray, torch.Tensor]:
    """[P, W] block tables (zero-padded) -> (the same tables as indices into their distinct
    used blocks, those blocks [U] int64); padding entries map to 0."""
    used = np.arange(table.shape[1])[None, :] < (-(-np.asarray(seq_lens) // block_size))[:, None]
    blocks, inverse = np.unique(table[used], return_inverse=True)
    remapped = np.zeros_like(table)
    remapped[used] = inverse
    return remapped, torch.from_numpy(blocks.astype(np.int64))


def _heads_contiguous(x: torch.Tensor, head_dim: int) -> bool:
    """x [T, KVH, D] float32 with heads and D contiguous (any row stride)."""
    return x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == head_dim


def _rows_of_heads(q: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`q` [T, H, D] as the kernels read it: any row stride, heads and D contiguous."""
    return q if q.stride(2) == 1 and q.stride(1) == head_dim else q.contiguous()


def _check(rc: int, which: str) -> None:
    if rc == -1:
        raise MemoryError(f"{which} attention kernel could not allocate scratch memory")
    if rc != 0:
        raise RuntimeError(f"{which} attention kernel failed with code {rc}")
