"""Copies of whole KV pages out of and into a paged cache (P/D transfers, tensor-parallel
page moves). A layer's cache is a (K, V) pair of `[num_blocks, kvh, *page]` tensors (page
`[block_size, head_dim]`, or quantized `[block_size * (head_dim + 2)]` uint8: codes, then
scales, `kv_cache/quant.py`); a layer's pages travel as one `[2, n, kvh, *page]` tensor in
the cache's dtype (`PageLayout.layer_shape`), opaque here: any format moves the same way.
`index`: `block_ids` already as an int64 tensor on the cache's device (build it once when
many layers move the same blocks)."""

from __future__ import annotations

from collections.abc import Callable

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


def _block_rows(t: torch.Tensor, rows: int) -> np.ndarray:
    """A contiguous host tensor of `rows` blocks as a numpy array of one opaque element per
    block (`[rows]`), viewing the same memory: numpy then copies whole blocks."""
    flat = t.reshape(-1).view(torch.uint8).numpy().reshape(rows, -1)
    return flat.view(np.dtype((np.void, flat.shape[1])))[:, 0]


def host_pages_into(kv_caches: Caches, block_ids: list[int]
                    ) -> Callable[[int, int, int, torch.Tensor], None] | None:
    """A writer of `block_ids`' pages of a host-memory cache into caller buffers, without
    a staging copy: `into(layer, kv, first, out)` writes the K (`kv` 0) or V (1) pages of
    `block_ids[first:first + len(out)]` in `layer` into `out` (`[m, kvh, *page]`, the
    cache's dtype, contiguous, host), one `numpy.take` (one thread, the GIL released).
    None for a device or non-contiguous cache, or ids outside it. Valid while the blocks
    stay pinned; raises ValueError for an `out` or range that does not fit."""
    k0 = kv_caches[0][0]
    if (k0.device.type != "cpu" or not block_ids or min(block_ids) < 0
            or max(block_ids) >= k0.shape[0]):
        return None
    if not all(t.is_contiguous() and t.shape == k0.shape and t.dtype == k0.dtype
               and t.device.type == "cpu" for kv in kv_caches for t in kv):
        return None
    ids = np.asarray(block_ids, dtype=np.intp)

    def into(layer: int, kv: int, first: int, out: torch.Tensor) -> None:
        m = out.shape[0] if out.dim() else 0
        if (out.device.type != "cpu" or out.dtype != k0.dtype or not out.is_contiguous()
                or tuple(out.shape[1:]) != tuple(k0.shape[1:]) or kv not in (0, 1)
                or not 0 <= first <= first + m <= len(ids)):
            raise ValueError(f"pages {first}..{first + m} of {len(ids)} (kv {kv}) do not "
                             f"fit a {tuple(out.shape)} {out.dtype} buffer")
        if m == 0:
            return
        np.take(_block_rows(kv_caches[layer][kv], len(k0)), ids[first:first + m],
                out=_block_rows(out, m), mode="clip")  # the ids were checked: no clip

    return into


def scatter_layer(kv_caches: Caches, layer: int, block_ids: list[int], pages: torch.Tensor,
                  index: torch.Tensor | None = None) -> None:
    """Write `[2, n, kvh, *page]` `pages` (the cache's dtype) into `block_ids` of `layer`."""
    k, v = kv_caches[layer]
    if _host_scatter(k, v, block_ids, pages, index):
        return
    idx = block_index(block_ids, k.device) if index is None else index
    k.index_copy_(0, idx, pages[0].to(k.device))
    v.index_copy_(0, idx, pages[1].to(v.device))


def _host_scatter(k: torch.Tensor, v: torch.Tensor, block_ids: list[int],
                  pages: torch.Tensor, index: torch.Tensor | None = None) -> bool:
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
    ids = (index.numpy() if index is not None and index.device.type == "cpu"
           and index.dtype == torch.int64 and len(index) == n else
           np.asarray(block_ids, dtype=np.int64))
    src = _block_rows(pages.contiguous(), 2 * n)
    for i, t in enumerate((k, v)):
        _block_rows(t, t.shape[0])[ids] = src[i * n:(i + 1) * n]
    return True
