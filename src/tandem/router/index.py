"""Which worker holds which KV block: the router's mirror of every worker's prefix cache.

Fed by each worker's `SubscribeKVEvents` stream: `reset(worker, snapshot)` on (re)connect,
then `stored` / `removed` / `cleared` events; `drop(worker)` when the stream breaks. Between
a routing decision and the worker's own `BlockStored` event, the routed blocks count as
present for `speculative_ttl_s` (`add_speculative`), so a burst of requests with the same new
prefix follows the first one instead of scattering.

`match(hashes)` returns, per worker, how many *leading* blocks of the chain it holds: a
block only helps if every block before it is there too.

Media (`BlockStored.medium` / `BlockRemoved.medium`): a block may be held in the device
pool, the host tier and the disk tier at once. The device pool's blocks live in this table;
each tier's in an index of its own (`TierIndex`, made on its first block, sharing this
index's worker slots), so a fleet without tiers pays nothing for them and an entry costs
the same 16 bytes in each medium that holds it. Removing a block from one medium leaves the
others; `cleared`, `reset` and `drop` cover every medium. `match` counts device blocks only;
`match_media` walks the chain in every medium (`Hit`).

Layout, sized for thousands of workers and tens of millions of blocks: each worker gets a bit
slot, each block maps to the bitmask of its holders, keyed by the first 8 bytes of its
SHA-256 (`block_key`; a collision can only mis-score a route, never corrupt a result, and is
~1e-5 likely at 10M blocks). `match` is one dict lookup and a few integer operations per
matched block, independent of the number of workers. Pure data structure: no I/O, no clock
of its own (callers pass `now`), unit-tested alone.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from tandem.protocol.block_hash import BlockHash
from tandem.protocol.kv_events import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST
from tandem.router import index_packed
from tandem.router.index_packed import INLINE, NONE, OVER, BlockTable, as_key, as_keys

_BLANK_ROW = int(np.full(INLINE, NONE, np.int16).view(np.int64)[0])  # every cell NONE
_OVER_ROW = int(np.full(INLINE, OVER, np.int16).view(np.int64)[0])
SCALAR_UP_TO = 64  # chains this short are matched block by block (numpy's fixed cost is more)
SPEC_BUCKETS = 1 << 20  # counters of speculative keys by their low bits (a vectorized test)


def block_key(h: BlockHash) -> int:
    """The index key of a block hash: its first 8 bytes as an unsigned integer."""
    return int.from_bytes(h[:8], "little")



def _any_cell(cells: np.ndarray) -> np.ndarray:
    """`cells.any(1)` for an (n, INLINE) bool array, reading each row's cells as one word."""
    if INLINE != 4:
        return cells.any(1)
    return np.ascontiguousarray(cells).view(np.uint32).ravel() != 0


def _live_bits(entry: dict[int, float] | None, now: float) -> int:
    """The holder bits of a block's speculative `entry` (slot -> expiry) unexpired at `now`."""
    bits = 0
    if entry:
        for slot, exp in entry.items():
            if exp > now:
                bits |= 1 << slot
    return bits

class Hit(tuple):
    """A worker's leading run of a chain by medium: `device` blocks, then `host` blocks
    (held in the host tier, or in the device pool after the run left it), then `disk`
    blocks (held anywhere after the run reached the disk tier). A block counts in the
    slowest medium the run has reached, so a run is device*, host*, disk*."""

    __slots__ = ()

    def __new__(cls, device: int, host: int = 0, disk: int = 0) -> Hit:
        return tuple.__new__(cls, (device, host, disk))

    @property
    def device(self) -> int:
        return self[0]

    @property
    def host(self) -> int:
        return self[1]

    @property
    def disk(self) -> int:
        return self[2]

    @property
    def total(self) -> int:
        return self[0] + self[1] + self[2]


TIERS = (MEDIUM_HOST, MEDIUM_DISK)


class PrefixIndex:
    speculates = True  # holds speculative entries (`add_speculative`); a tier holds none

    def __init__(self, speculative_ttl_s: float = 2.0, capacity: int = 1 << 16) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        self._slot: dict[str, int] = {}  # worker -> bit position
        self._names: dict[int, str] = {}  # bit position -> worker
        self._free: list[int] = []  # released slots, reused first
        self._all = 0  # bitmask of every slot in use
        self._table = BlockTable(capacity)  # block key -> its confirmed holders
        self._over: dict[int, int] = {}  # key -> bitmask, for keys marked OVER in the table
        self._count: dict[str, int] = {}  # worker -> how many blocks it has confirmed
        # worker -> keys it stored (some since removed; `cleared` and `keys` check)
        self._log: dict[str, array] = {}
        # block key -> {slot: expiry}; only for blocks the worker has not (yet) confirmed
        self._speculative: dict[int, dict[int, float]] = {}
        # (slot, expiry) -> the keys `add_speculative` set for it: a retraction visits only
        # those, not the whole chain (dropped with the entries by `expire` and `drop`)
        self._added: dict[tuple[int, float], set[int]] = {}
        # per bucket of key & (SPEC_BUCKETS - 1): how many keys `_speculative` holds there;
        # `match` reads it for a whole chain at once (a false positive only costs a step)
        self._spec_count = np.zeros(SPEC_BUCKETS if self.speculates else 1, np.uint32)
        self._spec_view = memoryview(self._spec_count)
        # (chain, table stamp, keys, entries, rows) of the last chain looked up
        self._last: tuple = (None, 0, None, None, None)
        self._tiers: dict[str, TierIndex] = {}  # medium -> its blocks (made on first use)

    def _tier(self, medium: str) -> TierIndex:
        """The index of `medium` (host or disk); ValueError for another name."""
        tier = self._tiers.get(medium)
        if tier is None:
            if medium not in TIERS:
                raise ValueError(f"unknown KV medium {medium!r}")
            tier = self._tiers[medium] = TierIndex(self)
        return tier

    def has_tiers(self) -> bool:
        """Whether any host or disk block is held (else `match_media` is `match`)."""
        return any(t._table.live for t in self._tiers.values())

    def _lookup(self, hashes: Sequence[BlockHash]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, table entries, holder rows: blank where absent) of a routing chain; the
        last chain's are kept while the table is unwritten, so `add_speculative` after
        `match` on the same chain (one routing decision) finds and reads its blocks once.
        Callers must not modify them."""
        chain, stamp, keys, pos, rows = self._last
        now = self._table.stamp  # read first: a later write can only make the copy stale
        if chain is not hashes or stamp != now or len(keys) != len(hashes):
            keys = as_keys(hashes, digests=True)
            pos, words = self._table.lookup(keys)
            rows = words.view(np.int16).reshape(-1, INLINE)
            self._last = (hashes, now, keys, pos, rows)
        return keys, pos, rows

    def _slot_of(self, worker: str) -> int:
        slot = self._slot.get(worker)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot)
            self._slot[worker] = slot
            self._names[slot] = worker
            self._all |= 1 << slot
            self._count.setdefault(worker, 0)
            self._log.setdefault(worker, array("Q"))
        return slot

    def _bits_one(self, k: int) -> int:
        """The confirmed holders of key `k` as a bitmask of slots."""
        table = self._table
        p = table.find_one(k)
        if p < 0:
            return 0
        return self._row_bits(k, table.row(p))

    def _row_bits(self, k: int, cells: Sequence[int]) -> int:
        """The confirmed holders of key `k` as a bitmask of slots, from its row's cells."""
        if cells[0] == OVER:
            return self._over[k]
        bits = 0
        for s in cells:
            if s >= 0:
                bits |= 1 << s
        return bits

    def _holds_one(self, k: int, slot: int) -> bool:
        """`_bits_one(k)` has `slot`'s bit (without building the whole mask)."""
        table = self._table
        p = table.find_one(k)
        if p < 0:
            return False
        cells = table.row(p)
        if cells[0] == OVER:
            return bool(self._over[k] >> slot & 1)
        return slot in cells

    def _held(self, keys: np.ndarray, pos: np.ndarray, slot: int,
              rows: np.ndarray | None = None) -> np.ndarray:
        """Per key: is it confirmed on `slot` (`pos`: its entries, -1 absent; `rows`: their
        holder cells when already read)."""
        if rows is None:
            rows = self._table.rows(pos)
        held = (pos >= 0) & _any_cell(rows == slot)
        over = (pos >= 0) & (rows[:, 0] == OVER)
        if over.any():
            bit, table = 1 << slot, self._over
            held[over] = [bool(table[k] & bit) for k in keys[over].tolist()]
        return held

    # -- fed by KV events ------------------------------------------------------------------
    def reset(self, worker: str, hashes: Iterable[BlockHash],
              host: Iterable[BlockHash] = (), disk: Iterable[BlockHash] = ()) -> None:
        """Replace everything known about `worker` with a snapshot (device pool, host and
        disk tiers)."""
        self.cleared(worker)
        self.stored(worker, hashes)
        for medium, tier_hashes in ((MEDIUM_HOST, host), (MEDIUM_DISK, disk)):
            tier_hashes = list(tier_hashes)
            if tier_hashes:
                self._tier(medium).stored(worker, tier_hashes)

    def stored(self, worker: str, hashes: Iterable[BlockHash],
               medium: str = MEDIUM_DEVICE) -> None:
        """`hashes` are now held by `worker` in `medium` ("" or device, host, disk)."""
        if medium and medium != MEDIUM_DEVICE:
            self._tier(medium).stored(worker, hashes)
            return
        slot = self._slot_of(worker)
        hashes = list(hashes)
        if len(hashes) <= SCALAR_UP_TO:
            self._stored_scalar(worker, slot, hashes)
            return
        keys = np.unique(as_keys(hashes))
        if not keys.size:
            return
        table = self._table
        pos = table.find(keys)
        new = pos < 0
        if new.any():
            rehashes = table.rehashes
            at = table.insert(keys[new])
            if table.rehashes == rehashes:
                pos[new] = at
            else:  # it rehashed: every entry moved
                pos = table.find(keys)
        rows = table.rows(pos)
        over = rows[:, 0] == OVER
        add = ~over & ~(rows == slot).any(1)
        free = rows == NONE
        inline = add & free.any(1) & (slot < index_packed.CELL_MAX)
        if inline.any():
            at = pos[inline]
            rows[inline, free[inline].argmax(1)] = slot
            table.set_rows(at, np.sort(rows[inline], axis=1))
        added = inline
        full = add & ~inline
        bit = 1 << slot
        for p, k, row in zip(pos[full].tolist(), keys[full].tolist(), rows[full].tolist(),
                             strict=True):  # a popular block: its holders move to `over`
            self._over[k] = sum(1 << s for s in row if s >= 0) | bit
            table.set_row(p, [OVER] * INLINE)
        added = added | full
        if over.any():
            got = []
            for k in keys[over].tolist():
                bits = self._over[k]
                got.append(not bits & bit)
                self._over[k] = bits | bit
            added[over] = got
        new_keys = keys[added]
        self._count[worker] += len(new_keys)
        log = self._log[worker]
        log.frombytes(new_keys.tobytes())
        if len(log) > 2 * self._count[worker] + 4096:
            self._compact(worker, slot)
        spec = self._speculative
        if spec:
            for k in keys.tolist():
                entry = spec.get(k)
                if entry is not None and entry.pop(slot, None) is not None and not entry:
                    del spec[k]
                    self._spec_view[k & (SPEC_BUCKETS - 1)] -= 1

    def _stored_scalar(self, worker: str, slot: int, hashes: list[BlockHash]) -> None:
        """`stored` block by block, for a short batch (one request's new blocks)."""
        table, over, spec, bit = self._table, self._over, self._speculative, 1 << slot
        log, added = self._log[worker], 0
        for k in {as_key(h) for h in hashes}:
            p = table.find_one(k)
            if p < 0:
                p = table.insert_one(k)
            cells = table.row(p)
            if cells[0] == OVER:
                bits = over[k]
                if bits & bit:
                    continue
                over[k] = bits | bit
            elif slot in cells:
                continue
            elif NONE in cells and slot < index_packed.CELL_MAX:
                cells[cells.index(NONE)] = slot
                table.set_row(p, sorted(cells))
            else:  # a popular block: its holders move to `over`
                over[k] = sum(1 << s for s in cells if s >= 0) | bit
                table.set_row(p, [OVER] * INLINE)
            added += 1
            log.append(k)
        self._count[worker] += added
        if len(log) > 2 * self._count[worker] + 4096:
            self._compact(worker, slot)
        if spec:
            for h in hashes:
                k = as_key(h)
                entry = spec.get(k)
                if entry is not None and entry.pop(slot, None) is not None and not entry:
                    del spec[k]
                    self._spec_view[k & (SPEC_BUCKETS - 1)] -= 1

    def _compact(self, worker: str, slot: int) -> None:
        keys = np.unique(np.frombuffer(self._log[worker], np.uint64))
        keys = keys[self._held(keys, self._table.find(keys), slot)]
        self._log[worker] = array("Q", keys.tobytes())

    def removed(self, worker: str, hashes: Iterable[BlockHash],
                medium: str = MEDIUM_DEVICE) -> None:
        """`hashes` left `worker`'s `medium`; the other media keep theirs."""
        if medium and medium != MEDIUM_DEVICE:
            tier = self._tiers.get(medium)
            if tier is None and medium not in TIERS:
                raise ValueError(f"unknown KV medium {medium!r}")
            if tier is not None:
                tier.removed(worker, hashes)
            return
        slot = self._slot.get(worker)
        if slot is None:
            return
        hashes = list(hashes)
        if len(hashes) <= SCALAR_UP_TO:
            self._removed_scalar(worker, slot, hashes)
        else:
            self._remove(worker, slot, np.unique(as_keys(hashes)))

    def _removed_scalar(self, worker: str, slot: int, hashes: list[BlockHash]) -> None:
        """`removed` block by block, for a short batch."""
        table, over, bit, removed = self._table, self._over, 1 << slot, 0
        for k in {as_key(h) for h in hashes}:
            p = table.find_one(k)
            if p < 0:
                continue
            cells = table.row(p)
            if cells[0] == OVER:
                bits = over[k]
                if not bits & bit:
                    continue
                if bits == bit:
                    del over[k]
                    table.delete(np.array([p], np.int64))
                else:
                    over[k] = bits & ~bit
            elif slot in cells:
                if cells.count(NONE) == INLINE - 1:
                    table.delete(np.array([p], np.int64))
                else:
                    cells[cells.index(slot)] = NONE
                    table.set_row(p, sorted(cells))
            else:
                continue
            removed += 1
        self._count[worker] -= removed

    def _remove(self, worker: str, slot: int, keys: np.ndarray) -> None:
        table = self._table
        pos = table.find(keys)
        keys, pos = keys[pos >= 0], pos[pos >= 0]
        rows = table.rows(pos)
        cells = rows == slot
        mine = cells.any(1)
        removed = int(mine.sum())
        emptied = []
        if removed:
            rows[cells] = NONE
            table.set_rows(pos[mine], np.sort(rows[mine], axis=1))
            emptied.append(pos[mine & (rows == NONE).all(1)])
        over = rows[:, 0] == OVER
        if over.any():
            clear, gone = ~(1 << slot), []
            for p, k in zip(pos[over].tolist(), keys[over].tolist(), strict=True):
                bits = self._over[k]
                if bits & ~clear:
                    removed += 1
                    bits &= clear
                    if bits:
                        self._over[k] = bits
                    else:
                        del self._over[k]
                        gone.append(p)
            emptied.append(np.array(gone, np.int64))
        if emptied:
            table.delete(np.concatenate(emptied))
        self._count[worker] -= removed

    def cleared(self, worker: str) -> None:
        """Forget every block `worker` holds, in every medium."""
        for tier in self._tiers.values():
            tier.cleared(worker)
        slot = self._slot.get(worker)
        if slot is not None and self._log[worker]:
            if self._count[worker]:
                self._remove(worker, slot,
                             np.unique(np.frombuffer(self._log[worker], np.uint64)))
            self._log[worker] = array("Q")

    def drop(self, worker: str) -> None:
        """Forget `worker` (its stream broke, or it left); its slot is reused later."""
        for tier in self._tiers.values():
            tier.drop(worker)
        self.cleared(worker)
        slot = self._slot.pop(worker, None)
        if slot is None:
            return
        del self._count[worker], self._log[worker], self._names[slot]
        self._all &= ~(1 << slot)
        for k in [k for k, entry in self._speculative.items() if slot in entry]:
            entry = self._speculative[k]
            del entry[slot]
            if not entry:
                del self._speculative[k]
                self._spec_view[k & (SPEC_BUCKETS - 1)] -= 1
        for key in [key for key in self._added if key[0] == slot]:
            del self._added[key]
        self._free.append(slot)

    # -- routing ---------------------------------------------------------------------------
    def add_speculative(self, worker: str, hashes: Sequence[BlockHash], now: float) -> float:
        """Count `hashes` as held by `worker` until `now` + the TTL (blocks it has confirmed
        are left alone); returns that expiry, which `retract_speculative` takes."""
        slot = self._slot_of(worker)
        expiry = now + self.speculative_ttl_s
        if len(hashes) <= SCALAR_UP_TO:
            holds = self._holds_one
            new = [k for k in map(as_key, hashes) if not holds(k, slot)]
        else:
            keys, pos, rows = self._lookup(hashes)
            new = keys[~self._held(keys, pos, slot, rows)].tolist() if keys.size else []
        if new:
            spec, counts = self._speculative, self._spec_view
            for k in new:
                entry = spec.get(k)
                if entry is None:
                    spec[k] = {slot: expiry}
                    counts[k & (SPEC_BUCKETS - 1)] += 1
                else:
                    entry[slot] = expiry
            added = self._added.get((slot, expiry))
            if added is None:
                self._added[(slot, expiry)] = set(new)
            else:
                added.update(new)
        return expiry

    def retract_speculative(self, worker: str, hashes: Sequence[BlockHash],
                            expiry: float) -> None:
        """Undo `add_speculative(worker, hashes, ...)` that returned `expiry` (the request
        never reached the worker); entries a later routing refreshed stay. Visits only the
        keys that adds with this expiry set, not the whole chain."""
        slot = self._slot.get(worker)
        added = self._added.get((slot, expiry)) if slot is not None else None
        if not added:
            return
        if len(hashes) <= SCALAR_UP_TO or len(added) * 8 > len(hashes):
            keys = as_keys(hashes, digests=True).tolist()
        else:  # the chain's keys among those added
            chain, stamp, last, _, _ = self._last
            keys = last if chain is hashes and len(last) == len(hashes) else \
                as_keys(hashes, digests=True)
            mine = np.fromiter(added, np.uint64, len(added))
            keys = mine[np.isin(mine, keys)].tolist()
        spec = self._speculative
        for k in keys:
            if k not in added:
                continue
            added.discard(k)
            entry = spec.get(k)
            if entry is not None and entry.get(slot) == expiry:
                del entry[slot]
                if not entry:
                    del spec[k]
                    self._spec_view[k & (SPEC_BUCKETS - 1)] -= 1
        if not added:
            del self._added[(slot, expiry)]

    def match(self, hashes: Sequence[BlockHash], now: float,
              workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (confirmed or speculative, unexpired);
        only workers in `workers` when given. Workers with no hit are absent. `hashes` is a
        routing chain (`add_speculative` and `retract_speculative` take one too): 32-byte
        digests, as `prompt.block_hashes` makes them (`index_packed.as_keys`' `digests`).

        Vectorized: the chain's entries are found at once, and the walk visits only the
        blocks where the holder set changes (a speculative entry or a popular block counts
        as a change), so a long prefix on a few workers costs a handful of steps."""
        if workers is None:
            mask = self._all
        else:
            slots = self._slot
            mask = 0
            for w in workers:
                s = slots.get(w)
                if s is not None:
                    mask |= 1 << s
        if not mask or not hashes:
            return {}
        if len(hashes) <= SCALAR_UP_TO:
            return self._match_scalar(hashes, now, mask)
        keys, pos, rows = self._lookup(hashes)
        whole = rows.view(np.int64).ravel()  # a row's 4 int16 cells as one number
        special = whole == _OVER_ROW
        spec = self._speculative
        if spec:
            special |= self._spec_count[keys & np.uint64(SPEC_BUCKETS - 1)] > 0
        blank = np.flatnonzero((whole == _BLANK_ROW) & ~special)
        n = int(blank[0]) if blank.size else len(keys)
        if not n:
            return {}
        whole, special = whole[:n], special[:n]
        change = np.empty(n, bool)
        change[0] = True
        change[1:] = (whole[1:] != whole[:-1]) | special[1:] | special[:-1]
        at = np.flatnonzero(change)
        result: dict[str, int] = {}
        row_bits = self._row_bits
        for i, k, row, sp in zip(at.tolist(), keys[at].tolist(), rows[at].tolist(),
                                 special[at].tolist(), strict=True):
            bits = row_bits(k, row)
            if sp:
                bits |= _live_bits(spec.get(k), now)
            kept = mask & bits
            if kept != mask and i:
                self._record(mask & ~kept, i, result)
            mask = kept
            if not mask:
                return result
        self._record(mask, n, result)
        return result
    def _match_scalar(self, hashes: Sequence[BlockHash], now: float,
                      mask: int) -> dict[str, int]:
        """`match` block by block, for short chains."""
        result: dict[str, int] = {}
        spec = self._speculative
        n = 0
        for h in hashes:
            k = as_key(h)
            bits = self._bits_one(k)
            if spec:
                bits |= _live_bits(spec.get(k), now)
            kept = mask & bits
            if kept != mask and n:
                self._record(mask & ~kept, n, result)
            mask = kept
            if not mask:
                return result
            n += 1
        self._record(mask, n, result)
        return result

    def _record(self, bits: int, n: int, result: dict[str, int]) -> None:
        names = self._names
        while bits:
            low = bits & -bits
            result[names[low.bit_length() - 1]] = n
            bits ^= low

    def _runs(self, hashes: Sequence[BlockHash], now: float, speculative: bool = True
              ) -> tuple[list[int], list[int], int]:
        """(positions where the chain's holder set may change, the holder bits from each,
        n): the holders of every block (confirmed, or with `speculative` also speculative
        unexpired at `now`); none from block `n` on."""
        if not hashes:
            return [], [], 0
        keys, pos, rows = self._lookup(hashes)
        whole = rows.view(np.int64).ravel()
        special = whole == _OVER_ROW
        spec = self._speculative if speculative else None
        if spec:
            special |= self._spec_count[keys & np.uint64(SPEC_BUCKETS - 1)] > 0
        held = np.flatnonzero((whole != _BLANK_ROW) | special)
        n = int(held[-1]) + 1 if held.size else 0
        if not n:
            return [], [], 0
        whole, special = whole[:n], special[:n]
        change = np.empty(n, bool)
        change[0] = True
        change[1:] = (whole[1:] != whole[:-1]) | special[1:] | special[:-1]
        at = np.flatnonzero(change)
        out, row_bits = [], self._row_bits
        for k, row, sp in zip(keys[at].tolist(), rows[at].tolist(), special[at].tolist(),
                              strict=True):
            bits = row_bits(k, row)
            if sp:
                bits |= _live_bits(spec.get(k), now)
            out.append(bits)
        return at.tolist(), out, n

    def match_media(self, hashes: Sequence[BlockHash], now: float,
                    workers: Iterable[str] | None = None,
                    speculative: bool = True) -> dict[str, Hit]:
        """Each worker's leading run of `hashes` by medium (`Hit`), over the device pool
        (with `speculative`, its speculative entries too, as `match`) and the host and disk
        tiers; workers with no hit are absent. Without tier blocks (and with `speculative`
        or no speculative entry) it is `match`'s answer as device hits."""
        tiers = [self._tiers.get(MEDIUM_HOST), self._tiers.get(MEDIUM_DISK)]
        if (speculative or not self._speculative) and not any(
                t is not None and t._table.live for t in tiers):
            return {w: Hit(n) for w, n in self.match(hashes, now, workers).items()}
        if workers is None:
            mask = self._all
        else:
            mask = 0
            for w in workers:
                s = self._slot.get(w)
                if s is not None:
                    mask |= 1 << s
        if not mask or not hashes:
            return {}
        runs = [self._runs(hashes, now, speculative)] + [
            t._runs(hashes, now) if t is not None and t._table.live else ([], [], 0)
            for t in tiers]
        points = sorted({p for at, _, n in runs for p in (*at, n) if p < len(hashes)})
        cur, nxt = [0, 0, 0], [0, 0, 0]
        dev = hd = alive = mask
        ends: tuple[dict[str, int], dict[str, int], dict[str, int]] = ({}, {}, {})
        for i in points:
            for m, (at, bits, n) in enumerate(runs):
                if nxt[m] < len(at) and at[nxt[m]] == i:
                    cur[m] = bits[nxt[m]]
                    nxt[m] += 1
                if i >= n:
                    cur[m] = 0
            held = cur[0] | cur[1]
            for m, (before, now_held) in enumerate(((dev, dev & cur[0]), (hd, hd & held),
                                                    (alive, alive & (held | cur[2])))):
                if before != now_held and i:
                    self._record(before & ~now_held, i, ends[m])
            dev, hd, alive = dev & cur[0], hd & held, alive & (held | cur[2])
            if not alive:
                break
        for m, bits in enumerate((dev, hd, alive)):
            self._record(bits, len(hashes), ends[m])
        d_end, hd_end = ends[0], ends[1]
        result = {}
        for w, total in ends[2].items():
            d = d_end.get(w, 0)
            h = hd_end.get(w, 0)
            result[w] = Hit(d, h - d, total - h)
        return result

    def expire(self, now: float) -> int:
        """Drop expired speculative entries; returns how many."""
        count = 0
        for k in list(self._speculative):
            entry = self._speculative[k]
            for s in [s for s, exp in entry.items() if exp <= now]:
                del entry[s]
                count += 1
            if not entry:
                del self._speculative[k]
                self._spec_view[k & (SPEC_BUCKETS - 1)] -= 1
        for key in [key for key in self._added if key[1] <= now]:
            del self._added[key]
        return count

    # -- introspection ---------------------------------------------------------------------
    def num_blocks(self, worker: str | None = None) -> int:
        if worker is None:
            return self._table.live
        return self._count.get(worker, 0)

    def workers(self) -> list[str]:
        return sorted(self._count)

    def keys(self, worker: str) -> set[int]:
        """A copy of the block keys confirmed for `worker`."""
        slot = self._slot.get(worker)
        if slot is None:
            return set()
        self._compact(worker, slot)
        return set(np.frombuffer(self._log[worker], np.uint64).tolist())

    def nbytes(self) -> int:
        """Bytes the confirmed index holds in arrays (the table and the per-worker logs)."""
        return self._table.nbytes() + sum(a.itemsize * len(a) for a in self._log.values())


class TierIndex(PrefixIndex):
    """The blocks of one tier (host or disk): a `PrefixIndex` whose worker slots are its
    owner's (one bit per worker across media, so `match_media` combines them directly).
    It holds no speculative entries."""

    speculates = False

    def __init__(self, owner: PrefixIndex) -> None:
        super().__init__(0.0, index_packed.MIN_CAP)
        self._owner = owner

    def _slot_of(self, worker: str) -> int:
        slot = self._slot.get(worker)
        if slot is None:
            slot = self._owner._slot_of(worker)
            self._slot[worker] = slot
            self._names[slot] = worker
            self._all |= 1 << slot
            self._count.setdefault(worker, 0)
            self._log.setdefault(worker, array("Q"))
        return slot

    def drop(self, worker: str) -> None:
        super().drop(worker)
        self._free.clear()  # the owner hands out slots

    def add_speculative(self, worker: str, hashes: Sequence[BlockHash], now: float) -> float:
        raise TypeError("a tier index holds no speculative entries")


class ApproximateIndex:
    """For workers that publish no KV events (stock vLLM): per worker, an LRU of the block
    hashes the router itself sent there, `capacity` entries each. A guess, not the truth:
    the worker may have evicted them already."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._lru: dict[str, OrderedDict[BlockHash, int]] = {}  # hash -> last routing's seq
        self._seq = 0

    def routed(self, worker: str, hashes: Sequence[BlockHash]) -> tuple[int, list[BlockHash]]:
        """Record `hashes` as sent to `worker`; (this routing's sequence number, the hashes
        it added), for `retract`."""
        self._seq += 1
        lru = self._lru.setdefault(worker, OrderedDict())
        added = []
        for h in hashes:
            if h not in lru:
                added.append(h)
            lru[h] = self._seq
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return self._seq, added

    def retract(self, worker: str, seq: int, added: Sequence[BlockHash]) -> None:
        """Take back what routing `seq` added, except hashes a later routing refreshed."""
        lru = self._lru.get(worker)
        if lru:
            for h in added:
                if lru.get(h) == seq:
                    del lru[h]

    def match(self, hashes: Sequence[BlockHash], workers: Iterable[str]) -> dict[str, int]:
        result = {}
        for w in workers:
            lru = self._lru.get(w)
            if not lru:
                continue
            n = 0
            for h in hashes:
                if h not in lru:
                    break
                n += 1
            if n:
                result[w] = n
        return result

    def drop(self, worker: str) -> None:
        self._lru.pop(worker, None)
