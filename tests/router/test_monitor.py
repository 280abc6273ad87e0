"""The monitor's KV-event consumer against a scripted stream (no sockets): big snapshots are
indexed in slices that let other requests run, then live events apply in order."""

from __future__ import annotations

import asyncio
import os

import pytest

from tandem.protocol import worker_pb2
from tandem.router.index import PrefixIndex
from tandem.router.monitor import SNAPSHOT_SLICE, MonitorSettings, WorkerMonitor
from tandem.router.workers import Worker


class _Stub:
    def __init__(self, batches: list[worker_pb2.KVEventBatch]) -> None:
        self.batches = batches

    async def _stream(self):  # noqa: ANN202
        for b in self.batches:
            yield b

    def SubscribeKVEvents(self, request, metadata=None):  # noqa: N802, ANN001, ANN201
        return self._stream()


def test_a_big_snapshot_is_indexed_in_slices_between_other_work():
    held = [os.urandom(32) for _ in range(SNAPSHOT_SLICE * 2 + 5)]
    new = os.urandom(32)
    stub = _Stub([
        worker_pb2.KVEventBatch(block_size=16, snapshot=worker_pb2.Snapshot(
            seq=7, block_hashes=held, instance_id="inst")),
        worker_pb2.KVEventBatch(events=[
            worker_pb2.KVEvent(seq=8, stored=worker_pb2.BlockStored(block_hashes=[new])),
            worker_pb2.KVEvent(seq=9, removed=worker_pb2.BlockRemoved(block_hashes=held[:1]))]),
    ])
    index = PrefixIndex()
    index.stored("w", [os.urandom(32)])  # stale: the snapshot replaces it
    mon = WorkerMonitor(Worker(id="w"), index, http=None, settings=MonitorSettings())

    async def run() -> int:
        ticks = 0
        done = False

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        await mon._consume(stub)
        done = True
        await t
        return ticks

    ticks = asyncio.run(run())
    assert ticks >= 2  # the loop ran other work between the snapshot's slices
    assert index.num_blocks("w") == len(held)  # -1 removed, +1 stored
    assert index.match([new], 0) == {"w": 1} and index.match(held[:1], 0) == {}
    view = mon.index_view()
    assert view is not None and (view.instance_id, view.seq) == ("inst", 9)


class _Store:
    def __init__(self) -> None:
        self.writes: list = []

    def publish(self, write) -> None:  # noqa: ANN001
        self.writes.append(write)


def test_snapshot_tiers_and_media_events_reach_the_index_and_the_store_gets_device_only():
    dev, host, disk, moved = ([os.urandom(32) for _ in range(3)] for _ in range(4))
    stub = _Stub([
        worker_pb2.KVEventBatch(block_size=16, snapshot=worker_pb2.Snapshot(
            seq=1, block_hashes=dev + moved, host_block_hashes=host, disk_block_hashes=disk,
            instance_id="inst")),
        worker_pb2.KVEventBatch(events=[  # a device eviction the host tier saved
            worker_pb2.KVEvent(seq=2, removed=worker_pb2.BlockRemoved(
                block_hashes=moved, medium="device")),
            worker_pb2.KVEvent(seq=3, stored=worker_pb2.BlockStored(
                block_hashes=moved, medium="host"))]),
    ])
    index, store = PrefixIndex(), _Store()
    mon = WorkerMonitor(Worker(id="w"), index, http=None, settings=MonitorSettings(),
                        store=store)
    asyncio.run(mon._consume(stub))
    assert index.match_media(dev + moved, 0) == {"w": (3, 3, 0)}
    assert index.match_media(host + disk, 0) == {"w": (0, 3, 3)}
    assert index.keys("w") == {int.from_bytes(h[:8], "little") for h in dev}
    snap, events = store.writes
    assert list(snap.snapshot) == dev + moved  # the shared store holds device blocks only
    assert [(e.seq, e.kind, list(e.hashes)) for e in events.events] == [
        (2, "removed", moved), (3, "stored", [])]  # the host event: only its seq


def test_an_event_in_an_unknown_medium_breaks_the_stream():
    stub = _Stub([
        worker_pb2.KVEventBatch(block_size=16, snapshot=worker_pb2.Snapshot(seq=1)),
        worker_pb2.KVEventBatch(events=[worker_pb2.KVEvent(seq=2, stored=worker_pb2.BlockStored(
            block_hashes=[os.urandom(32)], medium="tape"))])])
    mon = WorkerMonitor(Worker(id="w"), PrefixIndex(), http=None, settings=MonitorSettings())
    with pytest.raises(Exception, match="unknown KV medium 'tape'"):
        asyncio.run(mon._consume(stub))
