"""Copies of whole KV pages out of and into a paged cache (P/D transfers, tensor-parallel
page moves). A layer's cache is a (K, V) pair of `[num_blocks, kvh, *page]` tensors (page
`[block_size, head_dim]`, or quantized `[block_size * (head_dim + 2)]` uint8: codes, then
scales, `kv_cache/quant.py`); a layer's pages travel as one `[2, n, kvh, *page]` tensor in
the cache's dtype (`PageLayout.layer_shape`), opaque here: any format moves the same way.
`index`: `block_ids` already as an int64 tensor on the cache's device (build it once when
many layers move the same blocks)."""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from tandem.engine.kv_cache import page_copy

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


class HostPages:
    """A send's pinned blocks of a host-memory cache, written into caller buffers without a
    staging copy (`host_pages_into`). Valid while the blocks stay pinned.

    `self(layer, kv, first, out)` writes the K (`kv` 0) or V (1) pages of
    `block_ids[first:first + len(out)]` in `layer` into `out` (`[m, kvh, *page]`, the
    cache's dtype, contiguous, host); `digest_into(layer, out)` writes the whole layer's
    `[2, n, kvh, *page]` pages (K then V) into `out` and returns their XXH3-64, hashed as
    they are copied (the native kernel, `page_copy`; None where it is unavailable). Both
    run on the calling thread with the GIL released and raise ValueError for an `out` or
    range that does not fit."""

    def __init__(self, kv_caches: Caches, block_ids: list[int]) -> None:
        self._caches = kv_caches
        self._k0 = kv_caches[0][0]
        self._ids = page_copy.block_indices(block_ids)
        self._page = self._k0[0].numel() * self._k0.element_size()  # bytes of one block
        self._native = page_copy.available()

    def _check(self, out: torch.Tensor, lead: tuple[int, ...]) -> None:
        k0 = self._k0
        if (out.device.type != "cpu" or out.dtype != k0.dtype or not out.is_contiguous()
                or tuple(out.shape) != (*lead, *k0.shape[1:])):
            raise ValueError(f"pages {lead} x {tuple(k0.shape[1:])} {k0.dtype} do not fit a "
                             f"{tuple(out.shape)} {out.dtype} buffer")

    def __call__(self, layer: int, kv: int, first: int, out: torch.Tensor) -> None:
        m = out.shape[0] if out.dim() else 0
        if kv not in (0, 1) or not 0 <= first <= first + m <= len(self._ids):
            raise ValueError(f"pages {first}..{first + m} of {len(self._ids)} (kv {kv}) "
                             f"do not fit a {tuple(out.shape)} {out.dtype} buffer")
        self._check(out, (m,))
        if m == 0:
            return
        src = self._caches[layer][kv]
        if self._native:
            page_copy.copy_blocks(src.data_ptr(), self._ids[first:first + m],
                                  out.data_ptr(), _arange(m), self._page)
            return
        np.take(_block_rows(src, len(self._k0)), self._ids[first:first + m],
                out=_block_rows(out, m), mode="clip")  # the ids were checked: no clip

    def digest_into(self, layer: int, out: torch.Tensor, stream: bool = False) -> int | None:
        """Layer `layer`'s pages into `out` (`[2, n, kvh, *page]`), and their XXH3-64;
        None (nothing written) without the native kernel. `stream`: non-temporal stores
        (`page_copy.copy_blocks`), for an `out` larger than the last-level cache."""
        if not self._native:
            return None
        n = len(self._ids)
        self._check(out, (2, n))
        d = _thread_digest()
        for kv in (0, 1):
            page_copy.copy_blocks(self._caches[layer][kv].data_ptr(), self._ids,
                                  out[kv].data_ptr(), _arange(n), self._page, d, stream)
        return d.intdigest()


@functools.lru_cache(maxsize=8)
def _arange(n: int) -> np.ndarray:
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False  # shared between callers
    return out


def host_pages_into(kv_caches: Caches, block_ids: list[int]) -> HostPages | None:
    """`HostPages` of `block_ids` in a host-memory cache; None for a device or
    non-contiguous cache, or ids outside it."""
    k0 = kv_caches[0][0]
    if (k0.device.type != "cpu" or not block_ids or min(block_ids) < 0
            or max(block_ids) >= k0.shape[0]):
        return None
    if not all(t.is_contiguous() and t.shape == k0.shape and t.dtype == k0.dtype
               and t.device.type == "cpu" for kv in kv_caches for t in kv):
        return None
    return HostPages(kv_caches, block_ids)


def scatter_layer(kv_caches: Caches, layer: int, block_ids: list[int], pages: torch.Tensor,
                  index: torch.Tensor | None = None) -> None:
    """Write `[2, n, kvh, *page]` `pages` (the cache's dtype) into `block_ids` of `layer`."""
    k, v = kv_caches[layer]
    if _host_scatter(k, v, block_ids, pages, index):
        return
    idx = block_index(block_ids, k.device) if index is None else index
    k.index_copy_(0, idx, pages[0].to(k.device))
    v.index_copy_(0, idx, pages[1].to(v.device))


_digests = threading.local()  # a page_copy.Digest per thread that copies pages


def _thread_digest() -> page_copy.Digest:
    """This thread's XXH3-64 state, reset."""
    digest = getattr(_digests, "digest", None)
    if digest is None:
        digest = _digests.digest = page_copy.Digest()
    digest.reset()
    return digest


def _host_pages_fit(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, n: int) -> bool:
    """`pages` is `[2, n, kvh, *page]` host memory of the host-memory cache (K `k`, V `v`)'s
    dtype and page shape, and the cache is contiguous."""
    return (k.device.type == "cpu" and pages.device.type == "cpu" and pages.dtype == k.dtype
            and v.dtype == k.dtype and v.shape == k.shape
            and k.is_contiguous() and v.is_contiguous()
            and tuple(pages.shape) == (2, n, *k.shape[1:]))


def _native_scatter(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                    targets: np.ndarray, digest: page_copy.Digest | None = None) -> None:
    """Pages i of contiguous `pages` into blocks `targets[i]` of K and V (-1: hashed only),
    non-temporal stores from `STREAM_CACHE_WRITES` up."""
    n = len(targets)
    page = k[0].numel() * k.element_size()
    for i, t in enumerate((k, v)):
        page_copy.copy_blocks(pages[i].data_ptr(), _arange(n), t.data_ptr(), targets, page,
                              digest, stream=2 * n * page >= page_copy.STREAM_CACHE_WRITES)


def scatter_targets(num_pages: int, block_ids: list[int], select: list[int] | None,
                    num_cache_blocks: int) -> np.ndarray | None:
    """The cache block each of `num_pages` pages goes to (`scatter_layer_digest`'s
    `targets`): `block_ids[j]` for page `select[j]` (None: page j), -1 (hashed, not
    written) for the pages not selected. None for ids outside a cache of `num_cache_blocks`
    blocks, or a selection that repeats, leaves `[0, num_pages)` or does not match the ids
    one for one. Build it once per import: every layer moves the same blocks."""
    pos = list(range(num_pages)) if select is None else select
    if (len(pos) != len(block_ids) or len(set(pos)) != len(pos)
            or (pos and (min(pos) < 0 or max(pos) >= num_pages))
            or (block_ids and (min(block_ids) < 0 or max(block_ids) >= num_cache_blocks))):
        return None
    targets = np.full(num_pages, -1, dtype=np.int64)
    targets[np.asarray(pos, dtype=np.int64)] = block_ids
    return targets


def scatter_layer_digest(kv_caches: Caches, layer: int, targets: np.ndarray | None,
                         pages: torch.Tensor) -> int | None:
    """Write page i of `[2, n, kvh, *page]` host `pages` into block `targets[i]` of `layer`
    (`scatter_targets`; -1: not written) and return the XXH3-64 of all of `pages`' bytes, K
    then V, each block hashed as it is read (the native kernel: the bytes cross memory
    once). None, nothing written, for no `targets`, a device cache or pages, another dtype
    or shape, or without the kernel."""
    k, v = kv_caches[layer]
    if (targets is None or not page_copy.available() or not pages.is_contiguous()
            or not _host_pages_fit(k, v, pages, len(targets))):
        return None
    digest = _thread_digest()
    _native_scatter(k, v, pages, targets, digest)
    return digest.intdigest()


def _host_scatter(k: torch.Tensor, v: torch.Tensor, block_ids: list[int],
                  pages: torch.Tensor, index: torch.Tensor | None = None) -> bool:
    """`scatter_layer` for a host-memory cache and pages: one copy per block by the native
    kernel (`page_copy`), else numpy's indexed assignment (one thread, the GIL released).
    torch's `index_copy_` runs an OpenMP team that stalls whenever another thread or process
    holds a core (a P/D import runs beside the sender and the engine), at about half the
    speed then. False (nothing written) for anything else: device tensors, another dtype
    or shape, a negative id."""
    n = len(block_ids)
    if not _host_pages_fit(k, v, pages, n) or n == 0 or min(block_ids) < 0 \
            or max(block_ids) >= k.shape[0]:
        return False
    ids = (index.numpy() if index is not None and index.device.type == "cpu"
           and index.dtype == torch.int64 and len(index) == n else
           np.asarray(block_ids, dtype=np.int64))
    pages = pages.contiguous()
    if page_copy.available():  # one native copy per layer half, at memory speed
        _native_scatter(k, v, pages, page_copy.block_indices(ids))
        return True
    src = _block_rows(pages, 2 * n)
    for i, t in enumerate((k, v)):
        _block_rows(t, t.shape[0])[ids] = src[i * n:(i + 1) * n]
    return True
