"""Copies of whole KV pages out of and into a paged cache (P/D transfers, tensor-parallel
page moves). A layer's cache is a (K, V) pair of `[num_blocks, kvh, *page]` tensors (page
`[block_size, head_dim]`, or quantized `[block_size * (head_dim + 2)]` uint8: codes, then
scales, `kv_cache/quant.py`); a layer's pages travel as one `[2, n, kvh, *page]` tensor in
the cache's dtype (`PageLayout.layer_shape`), opaque here: any format moves the same way.
`index`: `block_ids` already as an int64 tensor on the cache's device (build it once when
many layers move the same blocks)."""

from __future__ import annotations

import numpy as np
import torch

Caches = list[tuple[torch.Tensor, torch.Tensor]]


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64, device=device)


def gather_layer(kv_caches: Caches, layer: int, block_ids: list[int],
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """`[2, n, kvh, *page]` copy of `block_ids` in `layer`, on the cache's device (the
    blocks must be pinned)."""
    k, v = kv_caches[layer]
    idx = block_index(block_ids, k.device) if index is None else index
    out = torch.empty((2, len(block_ids), *k.shape[1:]), dtype=k.dtype, device=k.device)
    torch.index_select(k, 0, idx, out=out[0])
    torch.index_select(v, 0, idx, out=out[1])
    return out


def scatter_layer(kv_caches: Caches, layer: int, block_ids: list[int], pages: torch.Tensor,
                  index: torch.Tensor | None = None) -> None:
    """Write `[2, n, kvh, *page]` `pages` (the cache's dtype) into `block_ids` of `layer`."""
    k, v = kv_caches[layer]
    if _host_scatter(k, v, block_ids, pages):
        return
    idx = block_index(block_ids, k.device) if index is None else index
    k.index_copy_(0, idx, pages[0].to(k.device))
    v.index_copy_(0, idx, pages[1].to(v.device))


def _host_scatter(k: torch.Tensor, v: torch.Tensor, block_ids: list[int],
                  pages: torch.Tensor) -> bool:
    """`scatter_layer` for a host-memory cache and pages: one copy per block by numpy's
    indexed assignment (one thread, the GIL released). torch's `index_copy_` runs an
    OpenMP team that stalls whenever another thread or process holds a core (a P/D import
    runs beside the sender and the engine), at about half the speed then. False (nothing
    written) for anything else: device tensors, another dtype or shape, a negative id."""
    n = len(block_ids)
    if (k.device.type != "cpu" or pages.device.type != "cpu" or pages.dtype != k.dtype
            or v.dtype != k.dtype or not (k.is_contiguous() and v.is_contiguous())
            or tuple(pages.shape) != (2, n, *k.shape[1:]) or v.shape != k.shape
            or n == 0 or min(block_ids) < 0 or max(block_ids) >= k.shape[0]):
        return False
    ids = np.asarray(block_ids, dtype=np.int64)
    src = pages.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(2, n, -1)
    for i, t in enumerate((k, v)):
        t.reshape(-1).view(torch.uint8).numpy().reshape(t.shape[0], -1)[ids] = src[i]
    return True
