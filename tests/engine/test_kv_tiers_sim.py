"""The KV tiers (`engine/kv_tiers`) over thousands of seeded random traces: saves, fetches,
host records and disk files flipped, truncated (a torn write), swapped between keys,
restarts that rebuild the disk index; the offload thread runs concurrently or is waited
for. Invariants: a fetch answers exactly the pages saved under that key or nothing (never
another block's, never altered bytes); tier bytes never exceed their caps; nothing is left
pending once the thread is idle; every corrupted record that is fetched counts a validation
failure and is dropped. Also: the crash-safe disk index, and the KV events' media."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tandem.engine.kv_tiers.codec import BlockMeta, CorruptBlock, decode, encode
from tandem.engine.kv_tiers.disk import DiskTier
from tandem.engine.kv_tiers.store import EventInfo, TierStore
from tandem.protocol.kv_events import BlockRemoved, BlockStored

SHAPE = (2, 2, 1, 2, 4, 4)  # layers, K/V, one block, KV heads, tokens, head dim
TRACES = 1500
KEYS = [bytes([i]) * 8 for i in range(10)]


def _pages(h: bytes, dtype=torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(h[:4], "little"))
    return torch.randn(SHAPE, generator=g).to(dtype)


def _meta(h: bytes) -> tuple[BlockMeta, EventInfo, torch.Tensor]:
    return BlockMeta(h, b"p" * 8), EventInfo(b"p" * 8, (1, 2, 3, 4), 4), _pages(h)


RECORD = len(encode(_pages(KEYS[0]), BlockMeta(KEYS[0], b"p" * 8)))


def _scratch() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # fsync is cheap there
    return tempfile.mkdtemp(prefix="tandem-kv-sim-", dir=base)


def _corrupt(store: TierStore, rng: random.Random) -> bytes | None:
    """Alter one stored record at random; the key altered (None if nothing was held)."""
    choices = [("host", h) for h in store.host.hashes()]
    if store.disk is not None:
        choices += [("disk", h) for h in store.disk.hashes()]
    if not choices:
        return None
    tier, h = rng.choice(choices)
    kind = rng.choice(["flip", "truncate", "swap"])
    if tier == "host":
        with store.host._lock:
            record = store.host._records.get(h)
            if record is None:
                return None
            if kind == "swap":
                others = [r for k, r in store.host._records.items() if k != h]
                if not others:
                    return None
                new = rng.choice(others)
            elif kind == "flip":
                i = rng.randrange(len(record))
                new = record[:i] + bytes([record[i] ^ (1 << rng.randrange(8))]) + record[i + 1:]
            else:
                new = record[:rng.randrange(len(record))]
            # as long as the original, so the tier's byte accounting stays true
            store.host._records[h] = (new + bytes(len(record)))[:len(record)]
        return h
    path = store.disk._file(h)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if kind == "swap":
        others = [p for p in path.parent.glob("*.kvb") if p != path]
        if not others:
            return None
        new = rng.choice(others).read_bytes()
    elif kind == "flip":
        i = rng.randrange(len(data))
        new = data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    else:
        new = data[:rng.randrange(len(data))]
    path.write_bytes(new)
    return h


def run_trace(seed: int) -> dict:
    rng = random.Random(seed)
    root = _scratch()
    host_cap = rng.randint(1, 6) * RECORD + rng.randrange(RECORD)
    disk_cap = rng.choice([0, rng.randint(1, 8) * RECORD + rng.randrange(RECORD)])
    comp = rng.choice(["none", "zlib"])

    def make() -> TierStore:
        return TierStore(host_cap, root if disk_cap else None, disk_cap, comp)

    store = make()
    stats = {"served": 0, "corrupt_fetched": 0}
    corrupted: set[bytes] = set()
    try:
        for _ in range(rng.randint(8, 30)):
            op = rng.random()
            if op < 0.35:
                keys = rng.sample(KEYS, rng.randint(1, 3))
                store.save([_meta(h) for h in keys])
                corrupted -= set(keys)  # a fresh save replaces the host copy
            elif op < 0.75:
                h = rng.choice(KEYS)
                failures = sum(c.validation_failures for c in store.stats())
                got = store.fetch(h, SHAPE, torch.float16, "")
                if got is not None:
                    assert torch.equal(got, _pages(h)), f"seed {seed}: wrong pages for {h}"
                    stats["served"] += 1
                elif h in corrupted and sum(
                        c.validation_failures for c in store.stats()) > failures:
                    stats["corrupt_fetched"] += 1
                    assert store.holds(h) is None or h in store.disk_hashes()
            elif op < 0.85:
                store.flush()
                h = _corrupt(store, rng)
                if h is not None:
                    corrupted.add(h)
            elif op < 0.92 and disk_cap:  # restart: the host tier is gone, disk rebuilt
                store.flush()
                store.close()
                store = make()
                corrupted &= set(store.disk_hashes())
            else:
                store.flush()
            assert store.host.used <= host_cap
            assert store._pending_bytes <= host_cap  # saves wait once the thread is behind
            if store.disk is not None:
                assert store.disk.used <= disk_cap
        store.flush()
        assert not store._pending and not store._spilling  # nothing left pinned
        assert store._pending_bytes == 0
        if store.disk is not None:
            # every file is indexed and no other (the test's corruptions change sizes)
            on_disk = {p.name for p in Path(root).iterdir()}
            assert on_disk == {h.hex() + ".kvb" for h in store.disk_hashes()}
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return stats


def test_random_traces_serve_only_what_was_saved_within_the_caps():
    served = corrupt_fetched = 0
    for seed in range(TRACES):
        s = run_trace(seed)
        served += s["served"]
        corrupt_fetched += s["corrupt_fetched"]
    # not vacuous: most traces serve blocks, and hundreds of corrupted records were caught
    assert served > 2 * TRACES, (served, corrupt_fetched)
    assert corrupt_fetched > TRACES // 10, (served, corrupt_fetched)


def test_a_torn_write_is_dropped_when_the_index_is_rebuilt(tmp_path):
    tier = DiskTier(tmp_path, 10 * RECORD)
    good, torn, stray = KEYS[:3]
    tier.put(good, encode(_pages(good), BlockMeta(good)))
    record = encode(_pages(torn), BlockMeta(torn))
    # a kill -9 mid-write: the temporary file is half written, never renamed ...
    (tmp_path / (torn.hex() + ".kvb.123.tmp")).write_bytes(record[:100])
    # ... and, had a file system lost the rename's ordering, a torn final file
    (tmp_path / (torn.hex() + ".kvb")).write_bytes(record[:-10])
    # a whole record under another block's name
    (tmp_path / (stray.hex() + ".kvb")).write_bytes(encode(_pages(good), BlockMeta(good)))
    rebuilt = DiskTier(tmp_path, 10 * RECORD)
    assert rebuilt.hashes() == [good] and rebuilt.dropped_on_start == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.hex() + ".kvb"]
    assert rebuilt.used == len(rebuilt.get(good))
    assert torch.equal(decode(rebuilt.get(good), good, SHAPE, torch.float16, ""), _pages(good))


def test_decode_refuses_another_layout_dtype_block_or_adapter():
    h = KEYS[0]
    record = encode(_pages(h), BlockMeta(h, lora_digest="abc"), "zlib")
    assert torch.equal(decode(record, h, SHAPE, torch.float16, "abc"), _pages(h))
    for args, what in [((KEYS[1], SHAPE, torch.float16, "abc"), "block hash"),
                       ((h, (2, 2, 1, 1, 4, 8), torch.float16, "abc"), "layout"),
                       ((h, SHAPE, torch.bfloat16, "abc"), "dtype"),
                       ((h, SHAPE, torch.float16, ""), "adapter digest")]:
        with pytest.raises(CorruptBlock, match=what):
            decode(record, *args)


def test_tier_events_carry_the_medium(tmp_path):
    store = TierStore(RECORD, str(tmp_path), RECORD)  # one record in each tier
    a, b, c = KEYS[:3]
    try:
        store.save([_meta(a)])
        store.flush()
        store.save([_meta(b)])  # pushes a to disk
        store.flush()
        store.save([_meta(c)])  # pushes b to disk, which pushes a out
        store.flush()
        events = store.take_events()
    finally:
        store.close()
    got = [(type(e).__name__, e.block_hashes, e.medium) for e in events]
    assert got == [
        ("BlockStored", (a,), "host"),
        ("BlockStored", (b,), "host"),
        ("BlockRemoved", (a,), "host"), ("BlockStored", (a,), "disk"),
        ("BlockStored", (c,), "host"),
        ("BlockRemoved", (b,), "host"), ("BlockStored", (b,), "disk"),
        ("BlockRemoved", (a,), "disk"),
    ]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert all(e.parent_hash == b"p" * 8 and e.block_size == 4 for e in stored)
    assert isinstance(events[2], BlockRemoved)
    assert store.host_hashes() == [c] and store.disk_hashes() == [b]
    # a peer's pull asks for the leading run the tiers hold
    assert store.lookup([c, b, a]) == 2 and store.lookup([a, c]) == 0


def test_the_medium_goes_on_the_wire_and_the_device_stays_as_it_was():
    from tandem.serving.grpc_server import event_to_proto

    host = event_to_proto(1, BlockStored((KEYS[0],), b"p" * 8, (), 4, medium="host"))
    disk = event_to_proto(2, BlockRemoved((KEYS[0],), medium="disk"))
    device = event_to_proto(3, BlockRemoved((KEYS[0],)))
    assert (host.stored.medium, disk.removed.medium, device.removed.medium) == (
        "host", "disk", "")
    assert device.SerializeToString() == event_to_proto(3, BlockRemoved(
        (KEYS[0],), medium="device")).SerializeToString()
