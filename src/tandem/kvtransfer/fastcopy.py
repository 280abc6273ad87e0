"""Copies of KV page bytes fused with their XXH3-64 digest, for the `shm` backend.

`copy_digest(dst, pieces)` writes `pieces` back to back into `dst` and returns the XXH3-64
(seed 0, `pages.PageChecksum`'s) of the bytes written, hashing each ~`CHUNK` of `dst` right
after writing it, while it is still in the core's cache: the bytes cross memory once, where
a copy of a layer larger than the last-level cache and then a hash of it would read the
copy back from memory. The digest is the same as `xxh3_64(dst[:total])` for any chunk size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import xxhash

CHUNK = 512 << 10  # about half a core's L2 here: written, then hashed while still there


def copy_digest(dst: memoryview, pieces: Sequence[memoryview], chunk: int = CHUNK) -> int:
    """Copy `pieces` (byte views) contiguously into the start of `dst` (a writable byte
    view at least their total size) and return the XXH3-64 of the bytes copied. Raises
    ValueError when they do not fit."""
    total = sum(len(p) for p in pieces)
    if total > len(dst):
        raise ValueError(f"{total} bytes do not fit a {len(dst)}-byte buffer")
    h = xxhash.xxh3_64()
    off = start = 0
    for p in pieces:
        n = len(p)
        if n >= chunk:  # a large piece: copy and hash it chunk by chunk
            if off > start:
                h.update(dst[start:off])
            for i in range(0, n, chunk):
                j = min(n, i + chunk)
                dst[off + i:off + j] = p[i:j]
                h.update(dst[off + i:off + j])
            off += n
            start = off
            continue
        dst[off:off + n] = p
        off += n
        if off - start >= chunk:
            h.update(dst[start:off])
            start = off
    if off > start:
        h.update(dst[start:off])
    return h.intdigest()



def gather_digest(out: torch.Tensor, gather: Callable[[int, int, torch.Tensor], None],
                  chunk: int = CHUNK) -> int:
    """Fill `out` (`[2, n, ...]` host pages, contiguous: K then V) by `gather(kv, first,
    out[kv, first:first + m])` calls of about `chunk` bytes each, in byte order, and return
    the XXH3-64 of `out`'s bytes, hashing each piece right after it is written."""
    if not out.is_contiguous() or out.dim() < 2 or out.shape[0] != 2:
        raise ValueError(f"not a contiguous [2, n, ...] page buffer: {tuple(out.shape)}")
    n = out.shape[1]
    per = max(1, chunk // max(1, out[0, :1].numel() * out.element_size()))
    h = xxhash.xxh3_64()
    for kv in (0, 1):
        for first in range(0, n, per):
            piece = out[kv, first:first + per]
            gather(kv, first, piece)
            h.update(piece.view(torch.uint8).numpy())
    return h.intdigest()
