"""Fan-out of the engine's KV events to gRPC subscribers, with sequence numbers.

Runs on the engine thread (`publish`, `subscribe`), hands batches to each subscriber's
asyncio loop. Subscribing on the engine thread makes the snapshot and the event sequence
consistent: a subscriber gets every hash held at `seq`, then exactly the events after it.
A subscriber more than `max_backlog` events behind is cut off (it resubscribes and gets a
fresh snapshot), so a stuck router cannot grow the worker's memory.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from dataclasses import dataclass, field

from tandem.protocol.block_hash import BlockHash
from tandem.protocol.kv_events import KVEvent

MAX_BACKLOG = 100_000


@dataclass
class Subscription:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # items: list[tuple[int, KVEvent]], or None when cut off
    snapshot_seq: int = 0
    snapshot: list[BlockHash] = field(default_factory=list)
    # blocks held only in the host / disk KV tiers at `snapshot_seq` (engine/kv_tiers)
    snapshot_host: list[BlockHash] = field(default_factory=list)
    snapshot_disk: list[BlockHash] = field(default_factory=list)
    backlog: int = 0  # events handed over but not yet taken (guarded by the hub's lock)


class KVEventHub:
    def __init__(self, max_backlog: int = MAX_BACKLOG) -> None:
        self.seq = 0
        self.instance_id = uuid.uuid4().hex  # this event sequence's name (see worker.proto)
        self.max_backlog = max_backlog
        self._subs: dict[int, Subscription] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def subscribe(self, held: list[BlockHash], loop: asyncio.AbstractEventLoop,
                  held_host: list[BlockHash] | None = None,
                  held_disk: list[BlockHash] | None = None) -> tuple[int, Subscription]:
        """Engine thread: register a subscriber whose snapshot is `held` (and the tiers'
        `held_host` / `held_disk`) at the current seq."""
        sub = Subscription(loop, asyncio.Queue(), self.seq, held, held_host or [],
                           held_disk or [])
        sid = next(self._ids)
        self._subs[sid] = sub
        return sid, sub

    def unsubscribe(self, sid: int) -> None:
        self._subs.pop(sid, None)

    def publish(self, events: list[KVEvent]) -> None:
        """Engine thread: number `events` and send them to every live subscriber."""
        if not events:
            return
        numbered = [(self.seq + i + 1, e) for i, e in enumerate(events)]
        self.seq += len(events)
        for sid, sub in list(self._subs.items()):
            with self._lock:
                sub.backlog += len(numbered)
                overflow = sub.backlog > self.max_backlog
            if overflow:
                self._subs.pop(sid, None)
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, None)
            else:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, numbered)

    async def next_batch(self, sub: Subscription) -> list[tuple[int, KVEvent]] | None:
        """Subscriber side: the next batch, or None once cut off for falling behind."""
        batch = await sub.queue.get()
        if batch is not None:
            with self._lock:
                sub.backlog -= len(batch)
        return batch
