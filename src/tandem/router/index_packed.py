"""A packed hash table from 64-bit block keys to small holder sets, for `index.PrefixIndex`.

One numpy array of 16-byte entries and no Python object per block: a key (uint64, open
addressing with linear probing) beside its row (`INLINE` int16 holder slots, sorted, `NONE`
= empty cell; one 8-byte word, so a lookup touches one cache line). A key held by more
than `INLINE` workers, or by a worker whose slot is `CELL_MAX` or more, is marked `OVER`
in every cell and its holders live in the caller's `over` (key -> bitmask of slots): only
popular blocks (a shared system prompt) pay for a Python int. 8 + 8 bytes per table
entry, at most `MAX_LOAD` full: 10M blocks take 2^24 entries, ~270 MB, and the garbage
collector never walks them. While the table grows the old one drains (`BlockTable`).

Every operation takes a batch of keys (numpy, vectorized). The home position is a
multiply-shift hash with a random odd multiplier, so prompts crafted to collide in the low
bits of their block hashes cannot build long probe chains. `EMPTY` (0) and `TOMB` (1) mark
free entries; a real key of 0 or 1 is stored as 2 or 3 (`as_keys`: a 2^-63 chance of two
blocks sharing a key, which can only mis-score a route, like any 8-byte key collision).
"""

from __future__ import annotations

import mmap
import secrets
from array import array
from collections.abc import Sequence

import numpy as np

EMPTY, TOMB = 0, 1
NONE, OVER = -1, -2
INLINE = 4  # holders stored in the row itself (4 int16 cells: one 8-byte word)
CELL_MAX = (1 << 15) - 1  # slots from this one up are never stored inline (int16 cells)
ROW_CODE = "h"  # `array` type code of a row cell
MAX_LOAD = 0.7  # live + tombstones, as a share of the entries, before a rehash
WINDOW = 8  # entries probed per vectorized step
MIN_CAP = 1 << 10  # the smallest table
MIGRATE_PER_KEY = 4  # old entries moved per inserted key while a growth drains
MIGRATE_MIN = 4096  # ... and at least this many per insert (`insert_one`s pooled)
_SPAN = np.arange(WINDOW, dtype=np.int64)
SCALAR_TAIL = 32  # `find` probes this few remaining keys one by one (numpy's fixed cost)
_M64 = (1 << 64) - 1
HINT_BITS = 18  # entries of the position hints (`BlockTable.lookup`): 2^18 x 8 bytes


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


class _Slab:
    """One open-addressing table: `keys` (uint64) and `rows` (int16, `INLINE` cells per
    key, stored complemented so that a zero page reads as all `NONE`: a fresh table costs
    nothing until its pages are touched)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.mask, self.used = cap, cap - 1, 0  # used = live + tombstones
        # an entry's key and its row side by side (one cache line, one page per lookup)
        self.data = _zeros((cap, 2), np.uint64)  # all EMPTY, every cell NONE
        self.keys = self.data[:, 0]
        self.rows = self.data.view(np.int16).reshape(cap, 2 * INLINE)[:, INLINE:]
        self.mult = np.uint64(secrets.randbits(64) | 1)
        self.shift = np.uint64(64 - cap.bit_length() + 1)
        self.imult, self.ishift = int(self.mult), int(self.shift)
        # flat views for one-key access: plain ints, no numpy scalar per access (entry p's
        # key at 2p, its cells at 8p + 4 ... 8p + 7)
        self.key_view = memoryview(self.data.reshape(-1))
        self.row_view = memoryview(self.data.view(np.int16).reshape(-1))

    def home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * self.mult) >> self.shift).astype(np.int64)

    def find_one(self, k: int) -> int:
        view, mask = self.key_view, self.mask
        pos = ((k * self.imult) & _M64) >> self.ishift
        while True:
            t = view[2 * pos]
            if t == k:
                return pos
            if t == EMPTY:
                return -1
            pos = (pos + 1) & mask

    def insert_one(self, k: int) -> int:
        view, mask = self.key_view, self.mask
        pos = ((k * self.imult) & _M64) >> self.ishift
        while view[2 * pos] > TOMB:
            pos = (pos + 1) & mask
        self.used += view[2 * pos] == EMPTY
        view[2 * pos] = k
        return pos

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Entry of each key (int64), -1 where absent. Most keys are settled by their home
        entry (found there, or it is empty); the rest probe `WINDOW` entries at a time, the
        last `SCALAR_TAIL` one by one."""
        pos = self.home(keys)
        tk = self.keys[pos]
        hit = tk == keys
        out = np.where(hit, pos, -1)
        idx = np.flatnonzero(~hit & (tk != EMPTY))
        pos = (pos[idx] + 1) & self.mask
        while idx.size:
            if idx.size <= SCALAR_TAIL:  # the last few long probes, one by one
                view, mask = self.key_view, self.mask
                for i, p, k in zip(idx.tolist(), pos.tolist(), keys[idx].tolist(),
                                   strict=True):
                    while (t := view[2 * p]) != k and t != EMPTY:
                        p = (p + 1) & mask
                    if t == k:
                        out[i] = p
                break
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
        """Entries for distinct absent keys (the caller keeps the load under `MAX_LOAD`)."""
        out = np.empty(len(keys), np.int64)
        idx = np.arange(len(keys))
        pos = self.home(keys)
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
        return out


class BlockTable:
    """Block key -> entry (an int) whose `INLINE` holder cells `rows` / `set_rows` (batches)
    and `row` / `set_row` (one) read and write, in logical form (`NONE`, `OVER`, slots).

    Growth is incremental: when the table passes `MAX_LOAD` a new one (at most half full
    after the pending inserts) takes every insert, and each insert first moves `MIGRATE_PER_KEY`
    entries per inserted key (at least `MIGRATE_MIN`, `insert_one`s pooled) from the old one,
    so no write moves more than a bounded multiple of its own keys and the old table is
    drained before the new one fills. Lookups consult both meanwhile; an entry of the old
    table is numbered after the new table's (`cap` + its position)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.live = 0  # keys held
        # `version` changes whenever an entry's key does (entries found before go stale)
        self.version = 0
        self.rehashes = 0  # bumped whenever keys move between entries (found ones go stale)
        self.stamp = 0  # bumped by every write, rows included (rows read before go stale)
        self.moved = 0  # entries migrated by the last write (a bound the tests check)
        self._debt = 0  # entries owed to the migration by `insert_one`s
        self._cur = _Slab(max(MIN_CAP, 1 << (capacity - 1).bit_length()))
        self._old: _Slab | None = None
        self._cursor = 0  # the next old entry to migrate
        self._hint_slab: _Slab | None = None  # the table `_hint_pos` points into
        self._hint_pos = np.zeros(0, np.int64)

    @property
    def cap(self) -> int:
        return self._cur.cap

    @property
    def used(self) -> int:
        return self._cur.used

    def nbytes(self) -> int:
        slabs = [self._cur] if self._old is None else [self._cur, self._old]
        return sum(s.data.nbytes for s in slabs)

    # -- lookups ---------------------------------------------------------------------------
    def find_one(self, k: int) -> int:
        """`find` for one key (a Python int from `as_key`)."""
        p = self._cur.find_one(k)
        if p < 0 and self._old is not None:
            p = self._old.find_one(k)
            if p >= 0:
                p += self._cur.cap
        return p

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Entry of each key (int64), -1 where absent."""
        out = self._cur.find(keys)
        if self._old is not None:
            miss = np.flatnonzero(out < 0)
            if miss.size:
                po = self._old.find(keys[miss])
                out[miss] = np.where(po >= 0, po + self._cur.cap, -1)
        return out

    def key_of(self, entries: np.ndarray) -> np.ndarray:
        """The key at each entry (uint64)."""
        cap, out = self._cur.cap, self._cur.keys[np.minimum(entries, self._cur.cap - 1)]
        if self._old is not None:
            o = entries >= cap
            out[o] = self._old.keys[entries[o] - cap]
        return out

    def rows(self, entries: np.ndarray) -> np.ndarray:
        """The holder cells of each entry ((n, INLINE) int16, a copy); -1 reads as blank."""
        return self.words(entries).view(np.int16).reshape(-1, INLINE)

    def words(self, entries: np.ndarray) -> np.ndarray:
        """Each entry's `INLINE` holder cells as one int64 word (logical: its int16 view is
        the `rows` cells; a copy). Entry -1 reads the last entry: callers mask absent keys.
        One gather of whole 16-byte entries (a 2-D gather of the cells costs ~10x more)."""
        cur = self._cur
        if self._old is None:
            return ~cur.data.take(entries, axis=0)[:, 1].view(np.int64)
        o = entries >= cur.cap
        out = ~cur.data.take(np.where(o, -1, entries), axis=0)[:, 1].view(np.int64)
        if o.any():
            out[o] = ~self._old.data.take(entries[o] - cur.cap, axis=0)[:, 1].view(np.int64)
        return out

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(`find`, `words`) for a routing chain, with absent keys' words all `NONE`.

        Position hints first: a direct-mapped array (`HINT_BITS`, by the key's low bits) of
        the entry each key was last found at in the current table. A hint counts only when
        that entry still holds the key (a key sits in one entry; deletion and reuse change
        the entry's key, and hints are dropped when the table is replaced), so the answer is
        `find`'s; a repeated prefix (a shared system prompt, the next turn of a conversation)
        skips the probe sequences. Keys that miss their hint are found and hinted."""
        cur = self._cur
        if self._hint_slab is not cur:
            self._hint_pos = np.zeros(1 << HINT_BITS, np.int64)
            self._hint_slab = cur
        slot = (keys & np.uint64((1 << HINT_BITS) - 1)).view(np.int64)
        pos = self._hint_pos[slot]
        ent = cur.data.take(pos, axis=0)
        ok = ent[:, 0] == keys
        words = ~ent[:, 1].view(np.int64)
        if not ok.all():
            miss = np.flatnonzero(~ok)
            got = self.find(keys[miss])
            pos[miss] = got
            cells = self.words(got)
            cells[got < 0] = -1  # every cell NONE
            words[miss] = cells
            keep = (got >= 0) & (got < cur.cap)
            self._hint_pos[slot[miss[keep]]] = got[keep]
        return pos, words

    def set_rows(self, entries: np.ndarray, rows: np.ndarray) -> None:
        """Write holder cells (logical) at existing entries; `rows` is one row or one per
        entry."""
        cur, stored = self._cur, ~np.asarray(rows, np.int16)
        self.stamp += 1
        if self._old is None:
            cur.rows[entries] = stored
            return
        o = entries >= cur.cap
        if stored.ndim == 2:
            cur.rows[entries[~o]] = stored[~o]
            self._old.rows[entries[o] - cur.cap] = stored[o]
        else:
            cur.rows[entries[~o]] = stored
            self._old.rows[entries[o] - cur.cap] = stored

    def row(self, p: int) -> list[int]:
        """`rows` for one entry, as a list."""
        slab = self._cur
        if p >= slab.cap:
            p, slab = p - slab.cap, self._old
        at = (2 * p + 1) * INLINE
        return [~c for c in slab.row_view[at:at + INLINE].tolist()]

    def set_row(self, p: int, cells: list[int]) -> None:
        slab = self._cur
        self.stamp += 1
        if p >= slab.cap:
            p, slab = p - slab.cap, self._old
        at = (2 * p + 1) * INLINE
        slab.row_view[at:at + INLINE] = array(ROW_CODE, [~c for c in cells])

    # -- writes ----------------------------------------------------------------------------
    def insert_one(self, k: int) -> int:
        """`insert` for one key known to be absent."""
        self.moved = 0
        if self._cur.used + 1 > MAX_LOAD * self._cur.cap:
            self._grow(1)
        elif self._old is not None:
            self._debt += MIGRATE_PER_KEY
            if self._debt >= MIGRATE_MIN:
                self._migrate(self._debt)
                self._debt = 0
        p = self._cur.insert_one(k)
        self.live += 1
        self.version += 1
        self.stamp += 1
        return p

    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Entries for distinct keys known to be absent (rows all `NONE`); keys may move
        (`rehashes` changes), so entries found before are stale afterwards when it does."""
        self.moved = 0
        if self._cur.used + len(keys) > MAX_LOAD * self._cur.cap:
            self._grow(len(keys))
        elif self._old is not None:
            self._migrate(max(MIGRATE_MIN, MIGRATE_PER_KEY * len(keys)))
        out = self._cur.insert(keys)
        self.live += len(keys)
        self.version += 1
        self.stamp += 1
        return out

    def delete(self, entries: np.ndarray) -> None:
        """Free entries whose key holds no worker any more."""
        cur = self._cur
        if self._old is None:
            cur.keys[entries], cur.rows[entries] = TOMB, 0
        else:
            o = entries >= cur.cap
            cur.keys[entries[~o]], cur.rows[entries[~o]] = TOMB, 0
            at = entries[o] - cur.cap
            self._old.keys[at], self._old.rows[at] = TOMB, 0
        self.live -= len(entries)
        self.version += 1
        self.stamp += 1

    def _grow(self, extra: int) -> None:
        """Start moving into a table at most half full after `extra` more keys (the same
        size when tombstones made up the load). An old table still draining (only a batch
        far past the growth rate gets here) is finished first."""
        if self._old is not None:
            self._migrate(self._old.cap)
        cap = self._cur.cap
        while (self.live + extra) > MAX_LOAD * cap / 2 and cap < (1 << 40):
            cap *= 2
        self._old, self._cur, self._cursor = self._cur, _Slab(cap), 0
        self.version += 1
        self.stamp += 1
        self.rehashes += 1
        self._migrate(max(MIGRATE_MIN, MIGRATE_PER_KEY * extra))

    def _migrate(self, n: int) -> None:
        """Move the live keys of the old table's next `n` entries into the current one."""
        old, start = self._old, self._cursor
        assert old is not None
        end = min(old.cap, start + n)
        held = start + np.flatnonzero(old.keys[start:end] > TOMB)
        if held.size:
            at = self._cur.insert(old.keys[held])
            self._cur.rows[at] = old.rows[held]
            old.keys[held] = TOMB
        self.moved += end - start
        self._cursor = end
        self.version += 1
        self.stamp += 1
        self.rehashes += 1
        if end == old.cap:
            self._old = None
