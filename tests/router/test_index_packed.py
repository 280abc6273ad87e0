"""The packed PrefixIndex against a dict-of-sets reference over random event traces.

Each trace mixes the KV event stream (stored, removed, cleared, reset, drop) with routing
(add_speculative, retract_speculative, expire, match at a moving clock) over a few prefix
chains, with enough workers on some blocks to move them out of the inline holder cells
(`OVER`) and a tiny starting table so rehashes and tombstone reuse happen often.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from tandem.router import index as index_module
from tandem.router import index_packed
from tandem.router.index import PrefixIndex, block_key
from tandem.router.index_packed import INLINE, BlockTable, as_keys


class Reference:
    """What the index must answer, written the obvious way."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.held: dict[str, set[bytes]] = {}  # every worker the index knows
        self.spec: dict[tuple[str, bytes], float] = {}

    def stored(self, w: str, hs: list[bytes]) -> None:
        self.held.setdefault(w, set()).update(hs)
        for h in hs:
            self.spec.pop((w, h), None)

    def removed(self, w: str, hs: list[bytes]) -> None:
        if w in self.held:
            self.held[w].difference_update(hs)

    def cleared(self, w: str) -> None:
        if w in self.held:
            self.held[w].clear()

    def drop(self, w: str) -> None:
        self.held.pop(w, None)
        self.spec = {k: v for k, v in self.spec.items() if k[0] != w}

    def add_speculative(self, w: str, hs: list[bytes], now: float) -> float:
        held = self.held.setdefault(w, set())
        for h in hs:
            if h not in held:
                self.spec[(w, h)] = now + self.ttl
        return now + self.ttl

    def retract(self, w: str, hs: list[bytes], expiry: float) -> None:
        for h in hs:
            if self.spec.get((w, h)) == expiry:
                del self.spec[(w, h)]

    def expire(self, now: float) -> int:
        gone = [k for k, exp in self.spec.items() if exp <= now]
        for k in gone:
            del self.spec[k]
        return len(gone)

    def match(self, hs: list[bytes], now: float, workers: set[str] | None) -> dict[str, int]:
        out = {}
        for w, held in self.held.items():
            if workers is not None and w not in workers:
                continue
            n = 0
            while n < len(hs) and (hs[n] in held or self.spec.get((w, hs[n]), -1.0) > now):
                n += 1
            if n:
                out[w] = n
        return out


def run_trace(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    ttl = 2.0
    idx, ref = PrefixIndex(speculative_ttl_s=ttl, capacity=16), Reference(ttl)
    chains = [[rng.randbytes(32) for _ in range(rng.randint(2, 24))] for _ in range(8)]
    universe = [h for c in chains for h in c]
    names = [f"w{i}" for i in range(rng.choice((3, 10, 40)))]
    now, routed = 0.0, []
    for _ in range(steps):
        w, op = rng.choice(names), rng.random()
        now += rng.random() * 0.7
        if op < 0.30:
            c = rng.choice(chains)
            hs = c[:rng.randint(1, len(c))] if rng.random() < 0.7 else \
                rng.sample(universe, rng.randint(1, 6))
            idx.stored(w, hs)
            ref.stored(w, hs)
        elif op < 0.45:
            hs = rng.sample(universe, rng.randint(1, 8))
            idx.removed(w, hs)
            ref.removed(w, hs)
        elif op < 0.49:
            idx.cleared(w)
            ref.cleared(w)
        elif op < 0.52:
            idx.drop(w)
            ref.drop(w)
            routed = [r for r in routed if r[0] != w]
        elif op < 0.55:
            snap = rng.sample(universe, rng.randint(0, 30))
            idx.reset(w, snap)
            ref.cleared(w)
            ref.stored(w, snap)
        elif op < 0.75:  # the whole chain object at times: `match` saw it last
            c = rng.choice(chains)
            hs = c if rng.random() < 0.5 else c[:rng.randint(1, len(c))]
            e1 = idx.add_speculative(w, hs, now)
            e2 = ref.add_speculative(w, hs, now)
            assert e1 == e2
            routed.append((w, hs, e1))
        elif op < 0.82 and routed:
            rw, hs, exp = routed.pop(rng.randrange(len(routed)))
            idx.retract_speculative(rw, hs, exp)
            ref.retract(rw, hs, exp)
        elif op < 0.85:
            assert idx.expire(now) == ref.expire(now)
        c = rng.choice(chains)
        probe = c if rng.random() < 0.8 else c[:rng.randint(0, len(c))]
        subset = set(rng.sample(names, max(1, len(names) // 3))) if rng.random() < 0.3 \
            else None
        assert idx.match(probe, now, subset) == ref.match(probe, now, subset)
    assert idx.workers() == sorted(ref.held)
    # the speculative keys' bucket counters (match's vectorized test) agree with the entries
    want = Counter(k & (index_module.SPEC_BUCKETS - 1) for k in idx._speculative)
    got = np.flatnonzero(idx._spec_count)
    assert dict(zip(got.tolist(), idx._spec_count[got].tolist(), strict=True)) == want
    # past every TTL nothing speculative is left: entries, retraction records, counters
    assert idx.expire(now + 10 * ttl) == ref.expire(now + 10 * ttl)
    assert not idx._speculative and not idx._added and not idx._spec_count.any()
    assert idx.num_blocks() == len(set().union(*ref.held.values()) if ref.held else set())
    for w, held in ref.held.items():
        assert idx.num_blocks(w) == len(held)
        assert idx.keys(w) == {block_key(h) for h in held}


@pytest.fixture(params=["vectorized", "scalar", "narrow-vectorized", "narrow-scalar"])
def path(request, monkeypatch):
    """Every chain and batch through the numpy path, or every one block by block; "narrow":
    only slots 0-4 stored inline (the others always go to `over`). Tables start at 8 entries
    and migrate a few entries per insert, so traces run across many incremental growths."""
    monkeypatch.setattr(index_packed, "MIN_CAP", 8)
    monkeypatch.setattr(index_packed, "MIGRATE_MIN", 3)
    monkeypatch.setattr(index_packed, "MIGRATE_PER_KEY", 2)
    if request.param.startswith("narrow"):
        monkeypatch.setattr(index_packed, "CELL_MAX", 5)
    monkeypatch.setattr(index_module, "SCALAR_UP_TO", 0 if request.param.endswith("vectorized")
                        else 10**9)
    return request.param


@pytest.mark.parametrize("seed", range(6))
def test_random_traces_match_the_reference(seed, path):
    run_trace(seed, 600)


def test_popular_blocks_leave_the_inline_cells_and_come_back_empty():
    idx = PrefixIndex()
    chain = [bytes([i]) * 32 for i in range(1, 5)]
    names = [f"w{i}" for i in range(INLINE * 3)]
    for w in names:
        idx.stored(w, chain)
    assert idx.match(chain, 0) == dict.fromkeys(names, 4)
    for w in names[:-1]:
        idx.removed(w, chain[2:])
    assert idx.match(chain, 0) == {**dict.fromkeys(names[:-1], 2), names[-1]: 4}
    for w in names:
        idx.drop(w)
    assert idx.num_blocks() == 0 and idx.match(chain, 0) == {}


def test_table_finds_every_key_after_rehashes_and_tombstones():
    rng = np.random.default_rng(3)
    table, live = BlockTable(16), set()
    for _ in range(40):
        keys = np.setdiff1d(rng.integers(2, 1 << 62, 500, dtype=np.uint64),
                            np.array(sorted(live), np.uint64))
        table.insert(keys)
        live.update(keys.tolist())
        gone = np.array(rng.choice(sorted(live), 200, replace=False), np.uint64)
        table.delete(table.find(gone))
        live.difference_update(gone.tolist())
        probe = np.concatenate([np.array(sorted(live), np.uint64), gone])
        found = table.find(probe)
        assert (found[:len(live)] >= 0).all() and (found[len(live):] < 0).all()
        assert (table.key_of(found[:len(live)]) == probe[:len(live)]).all()
        assert table.live == len(live) and table.used <= 0.7 * table.cap


def test_growth_moves_a_bounded_number_of_entries_per_write():
    """Growing from 1,024 entries to 2^18 through single inserts, batches and deletes: no
    write moves more than `MIGRATE_PER_KEY` old entries per key it inserts (at least
    `MIGRATE_MIN`), yet each old table is drained before the next growth, and every key
    stays findable throughout (lookups consult both tables)."""
    rng = np.random.default_rng(7)
    table, live, growths = BlockTable(1024), [], 0
    for step in range(400):
        if step % 3:
            n = int(rng.integers(1, 64))
            keys = rng.integers(2, 1 << 62, n, dtype=np.uint64)
            for k in keys.tolist():
                rehashes = table.rehashes
                table.insert_one(k)
                assert table.moved <= index_packed.MIGRATE_MIN
                growths += table.cap > 1024 and table.rehashes != rehashes and table.moved
        else:
            n = int(rng.integers(64, 2000))
            keys = rng.integers(2, 1 << 62, n, dtype=np.uint64)
            table.insert(keys)
            assert table.moved <= max(index_packed.MIGRATE_MIN,
                                      index_packed.MIGRATE_PER_KEY * n)
        live.extend(keys.tolist())
        if step % 7 == 0:
            gone = np.array(live[-50:], np.uint64)
            table.delete(table.find(gone))
            del live[-50:]
            assert (table.find(gone) < 0).all()
        if step % 25 == 0:
            probe = np.array(live, np.uint64)
            found = table.find(probe)
            assert (found >= 0).all() and (table.key_of(found) == probe).all()
        assert table.used <= index_packed.MAX_LOAD * table.cap
    assert table.cap >= 1 << 18 and table.live == len(live) and growths
    assert (table.key_of(table.find(np.array(live, np.uint64))) == np.array(live)).all()


def test_keys_are_the_first_eight_bytes_and_short_hashes_work():
    hs = [bytes(range(32)), b"\x05\x00", b"\x00" * 32]
    assert as_keys(hs).tolist() == [block_key(hs[0]), 5, 2]  # 0 is stored as 2


def test_thousands_of_short_traces_match_the_reference(path):
    for seed in range(100, 600):
        run_trace(seed, 25)


def test_stored_after_a_rehash_that_keeps_the_size():
    """Tombstones fill the table until a rehash of the same size clears them, in the
    middle of a `stored` batch: every block stays findable."""
    idx = PrefixIndex(capacity=1024)
    rng = random.Random(5)
    held = [rng.randbytes(32) for _ in range(50)]  # found before the batch's inserts
    idx.stored("b", held)
    for _ in range(30):
        chain = [rng.randbytes(32) for _ in range(300)]
        idx.stored("a", held + chain)
        idx.stored("b", chain[:150])
        assert idx.match(held + chain, 0) == {"a": 350, "b": 200}
        assert idx.match(chain, 0) == {"a": 300, "b": 150}
        idx.removed("a", held + chain)
        idx.removed("b", chain)
    assert idx._table.cap == 1024 and idx._table.rehashes > 0


def test_lookup_hints_agree_with_find_through_deletes_reuse_and_growth(monkeypatch):
    """`BlockTable.lookup` (position hints, then `find`) answers exactly `find` and `rows`
    while keys are deleted, their entries reused by others and the table grows and drains,
    with few hint slots so hints collide and go stale all the time."""
    monkeypatch.setattr(index_packed, "HINT_BITS", 4)
    monkeypatch.setattr(index_packed, "MIGRATE_MIN", 3)
    monkeypatch.setattr(index_packed, "MIGRATE_PER_KEY", 2)
    rng = np.random.default_rng(11)
    table, live = BlockTable(8), []
    hinted = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.4 or not live:
            keys = np.setdiff1d(rng.integers(2, 1 << 40, rng.integers(1, 20), dtype=np.uint64),
                                np.array(live, np.uint64))
            at = table.insert(keys)
            table.set_rows(at, np.sort(rng.integers(-1, 9, (len(keys), INLINE)), axis=1)
                           .astype(np.int16))
            live += keys.tolist()
        elif op < 0.6:
            gone = rng.choice(live, min(len(live), int(rng.integers(1, 10))), replace=False)
            table.delete(table.find(np.array(gone, np.uint64)))
            live = [k for k in live if k not in set(gone.tolist())]
        probe = np.array(rng.choice(live + [5, 7, 1 << 41], int(rng.integers(1, 40))),
                         np.uint64)
        pos, words = table.lookup(probe)
        want = table.find(probe)
        assert (pos == want).all()
        rows = table.rows(want)
        rows[want < 0] = index_packed.NONE
        assert (words.view(np.int16).reshape(-1, INLINE) == rows).all()
        hinted += int((table._hint_pos[(probe & np.uint64(15)).view(np.int64)] == pos).sum())
    assert hinted > 0
