"""A packed hash table from 64-bit block keys to small holder sets, for `index.PrefixIndex`.

Two numpy arrays and no Python object per block: `keys` (uint64, open addressing with
linear probing) and `rows` (int16, `INLINE` holder slots per key, sorted, `NONE` = empty
cell). A key held by more than `INLINE` workers, or by a worker whose slot is `CELL_MAX` or
more, is marked `OVER` in every cell and its holders live in the caller's `over` (key ->
bitmask of slots): only popular blocks (a shared system prompt) pay for a Python int.
8 + 8 bytes per table entry, at most `MAX_LOAD` full: 10M blocks take 2^24 entries,
~270 MB, and the garbage collector never walks them.

Every operation takes a batch of keys (numpy, vectorized). The home position is a
multiply-shift hash with a random odd multiplier, so prompts crafted to collide in the low
bits of their block hashes cannot build long probe chains. `EMPTY` (0) and `TOMB` (1) mark
free entries; a real key of 0 or 1 is stored as 2 or 3 (`as_keys`: a 2^-63 chance of two
blocks sharing a key, which can only mis-score a route, like any 8-byte key collision).
"""

from __future__ import annotations

import mmap
import secrets
from collections.abc import Sequence

import numpy as np

EMPTY, TOMB = 0, 1
NONE, OVER = -1, -2
INLINE = 4  # holders stored in the row itself
CELL_MAX = (1 << 15) - 1  # slots from this one up are never stored inline (int16 cells)
ROW_CODE = "h"  # `array` type code of a row cell
MAX_LOAD = 0.7  # live + tombstones, as a share of the entries, before a rehash
WINDOW = 8  # entries probed per vectorized step
_SPAN = np.arange(WINDOW, dtype=np.int64)
_M64 = (1 << 64) - 1


def as_key(h: bytes) -> int:
    """`as_keys` for one hash, as a Python int."""
    k = int.from_bytes(h[:8], "little")
    return k + 2 if k <= TOMB else k


def _zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A zeroed array, large ones on anonymous memory without transparent huge pages: numpy
    asks for huge pages on large arrays, and where the kernel compacts memory to find them
    (THP defrag "madvise"), first touching a fresh 2^25-entry table took seconds (0.3 s
    without)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size < (1 << 22) or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype)
    buf = mmap.mmap(-1, size)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype).reshape(shape)


def as_keys(hashes: Sequence[bytes], digests: bool = False) -> np.ndarray:
    """The index keys of block hashes (uint64): each hash's first 8 bytes, little-endian
    (`index.block_key`), 0 and 1 moved to 2 and 3. `digests`: the caller vouches that every
    hash is a 32-byte digest when they total 32 bytes each (a routing chain, which the
    router hashed itself), so their lengths are not checked one by one."""
    n = len(hashes)
    if not n:
        return np.empty(0, np.uint64)
    raw = b"".join(hashes)
    if len(raw) == 32 * n and (digests or set(map(len, hashes)) == {32}):
        keys = np.frombuffer(raw, dtype="<u8").reshape(n, 4)[:, 0].astype(np.uint64)
    else:
        keys = np.fromiter((int.from_bytes(h[:8], "little") for h in hashes), np.uint64, n)
    low = keys <= TOMB
    if low.any():
        keys[low] += np.uint64(2)
    return keys


class BlockTable:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self.live = 0  # keys held
        # `version` changes whenever an entry's key does (entries found before go stale)
        self.version = 0
        self.rehashes = 0  # entries found before a rehash are stale
        self._alloc(max(1 << 10, 1 << (capacity - 1).bit_length()))

    def _alloc(self, cap: int) -> None:
        self.cap, self.mask, self.used = cap, cap - 1, 0  # used = live + tombstones
        self.keys = _zeros((cap,), np.uint64)  # all EMPTY
        self.rows = _zeros((cap, INLINE), np.int16)
        self.rows.fill(NONE)
        self._mult = np.uint64(secrets.randbits(64) | 1)
        self._shift = np.uint64(64 - cap.bit_length() + 1)
        # flat views for one-key lookups (`find_one` and the index's scalar paths): plain
        # ints, no numpy scalar per access
        self.key_view = memoryview(self.keys)
        self.row_view = memoryview(self.rows.reshape(-1))

    def nbytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * self._mult) >> self._shift).astype(np.int64)

    def find_one(self, k: int) -> int:
        """`find` for one key (a Python int from `as_key`)."""
        view, mask = self.key_view, self.mask
        pos = ((k * int(self._mult)) & _M64) >> int(self._shift)
        while True:
            t = view[pos]
            if t == k:
                return pos
            if t == EMPTY:
                return -1
            pos = (pos + 1) & mask

    def insert_one(self, k: int) -> int:
        """`insert` for one key known to be absent."""
        if self.used + 1 > MAX_LOAD * self.cap:
            self._rehash(1)
        view, mask = self.key_view, self.mask
        pos = ((k * int(self._mult)) & _M64) >> int(self._shift)
        while view[pos] > TOMB:
            pos = (pos + 1) & mask
        self.used += view[pos] == EMPTY
        view[pos] = k
        self.live += 1
        self.version += 1
        return pos

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Entry of each key (int64), -1 where absent. Most keys are settled by their home
        entry (found there, or it is empty); the rest probe `WINDOW` entries at a time."""
        pos = self._home(keys)
        tk = self.keys[pos]
        hit = tk == keys
        out = np.where(hit, pos, -1)
        idx = np.flatnonzero(~hit & (tk != EMPTY))
        pos = (pos[idx] + 1) & self.mask
        while idx.size:
            win = (pos[:, None] + _SPAN) & self.mask
            tk = self.keys[win]
            hit = tk == keys[idx, None]
            stop = hit | (tk == EMPTY)
            first = stop.argmax(1)
            r = np.arange(idx.size)
            found = hit[r, first]
            out[idx[found]] = win[r, first][found]
            cont = ~stop[r, first]
            idx, pos = idx[cont], (pos[cont] + WINDOW) & self.mask
        return out

    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Entries for distinct keys known to be absent (rows all `NONE`); may rehash, so
        positions found before are stale afterwards."""
        if self.used + len(keys) > MAX_LOAD * self.cap:
            self._rehash(len(keys))
        out = np.empty(len(keys), np.int64)
        idx = np.arange(len(keys))
        pos = self._home(keys)
        while idx.size:
            win = (pos[:, None] + _SPAN) & self.mask
            free = self.keys[win] <= TOMB
            anyf = free.any(1)
            cand = win[np.arange(idx.size), free.argmax(1)]
            sel = np.flatnonzero(anyf)
            slots, first = np.unique(cand[sel], return_index=True)
            won = sel[first]
            self.used += int((self.keys[slots] == EMPTY).sum())
            self.keys[slots] = keys[idx[won]]
            out[idx[won]] = slots
            lost = np.ones(idx.size, bool)
            lost[won] = False
            # losers retry from the entry just taken, rows with no free entry move on
            pos = np.where(anyf, cand, (pos + WINDOW) & self.mask)[lost]
            idx = idx[lost]
        self.live += len(keys)
        self.version += 1
        return out

    def delete(self, entries: np.ndarray) -> None:
        """Free entries whose key holds no worker any more."""
        self.keys[entries] = TOMB
        self.rows[entries] = NONE
        self.live -= len(entries)
        self.version += 1

    def _rehash(self, extra: int) -> None:
        """Move every live key to a table at most half full after `extra` more: sorted by
        their new home, each run of keys lands in one vectorized pass (a key's entry is its
        home or the one after its predecessor's, whichever is later); the few that would
        run past the end wrap around through `insert`."""
        held = np.flatnonzero(self.keys > TOMB)
        keys, rows = self.keys[held], self.rows[held]
        cap = self.cap
        while (len(held) + extra) > MAX_LOAD * cap / 2 and cap < (1 << 40):
            cap *= 2
        self._alloc(cap)
        home = self._home(keys)
        order = np.argsort(home)
        step = np.arange(len(order))
        pos = np.maximum.accumulate(home[order] - step) + step
        fits = pos < cap
        at, placed = pos[fits], order[fits]
        self.keys[at] = keys[placed]
        self.rows[at] = rows[placed]
        self.used = self.live = len(at)
        rest = order[~fits]
        if rest.size:
            self.rows[self.insert(keys[rest])] = rows[rest]
        self.version += 1
        self.rehashes += 1
