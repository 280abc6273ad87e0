"""CPU backend: decodes read K/V straight from the paged cache with a native kernel.

The torch backend gathers every decode's context into a dense copy per layer and then runs
SDPA over it: the KV bytes cross memory three times. Here one C kernel
(`engine/csrc/paged_attention_cpu.c`, built by `tandem.engine.native`) walks each
sequence's block table and reads every K/V row once. Writes and prefill chunks stay on the
torch path (prefill is matmul-bound, where SDPA is already good). float32 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, register_backend
from tandem.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from tandem.engine.errors import ConfigError
from tandem.engine.native import load_native

MAX_GROUP = 64  # query heads per KV head the kernel supports


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    decode_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32 context lengths


def native_available(spec: AttentionSpec, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the `cpu` backend can run this model here (else use `torch`)."""
    return (device.type == "cpu" and dtype == torch.float32
            and 1 <= spec.num_heads // spec.num_kv_heads <= MAX_GROUP
            and load_native() is not None)


@register_backend("cpu")
class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(spec, block_size, dtype, device)
        if not native_available(spec, dtype, device):
            raise ConfigError("attention backend 'cpu' needs a CPU device, float32, a C "
                              "compiler, and at most 64 query heads per KV head")
        self._kernel = load_native().tandem_paged_attention_decode_f32

    def build_metadata(self, layout: BatchLayout) -> CpuAttentionMetadata:
        nd = layout.num_decodes
        tables = lens = None
        if nd:
            width = max(len(t) for t in layout.block_tables[:nd])
            tables = torch.tensor([t + [0] * (width - len(t)) for t in layout.block_tables[:nd]],
                                  dtype=torch.int32)
            lens = torch.tensor(layout.seq_lens[:nd], dtype=torch.int32)
        return CpuAttentionMetadata(self._write_rows(layout), nd, [],
                                    self._prefill_seqs(layout), tables, lens)

    def _decode(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: TorchAttentionMetadata, out: torch.Tensor) -> None:
        assert isinstance(meta, CpuAttentionMetadata) and meta.decode_tables is not None
        s = self.spec
        qd = q[: meta.num_decodes]
        if qd.stride(2) != 1 or qd.stride(1) != s.head_dim:
            qd = qd.contiguous()
        k_cache, v_cache = kv_cache
        tables, lens = meta.decode_tables, meta.decode_lens
        rc = self._kernel(
            out.data_ptr(), qd.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), meta.num_decodes, s.num_heads,
            s.num_kv_heads, s.head_dim, self.block_size, tables.shape[1], qd.stride(0),
            out.stride(0), s.sliding_window or 0, s.scale, torch.get_num_threads(),
        )
        if rc == -1:
            raise MemoryError("paged attention kernel could not allocate scratch memory")
        if rc != 0:
            raise RuntimeError(f"paged attention kernel failed with code {rc}")
