"""The KV tiers behind the offload connector: blocks the device pool evicts go to host
memory, blocks the host tier evicts go to disk (if configured), and a prefix miss in the
device pool loads from them.

`save` (engine thread, as the device pool evicts) takes copies of the blocks' pages and
returns at once: they are held as *pending* (served from host memory already) while the
offload thread encodes them (`codec`: digest, compression) into the host tier and spills
what that pushes out to disk. `fetch` (engine thread) answers a block's pages only if its
record verifies as that block (hash, digest, layout, dtype, adapter digest); one that does
not is dropped from its tier and counted (`validation_failures`): the caller computes it.
KV events (`BlockStored` / `BlockRemoved` with the medium) queue up for `take_events`.
`lookup` answers the leading run of hashes the tiers hold (for a peer's pull)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.engine.kv_tiers.codec import BlockMeta, CorruptBlock, decode, encode
from tandem.engine.kv_tiers.counters import TierCounters
from tandem.engine.kv_tiers.disk import DiskTier
from tandem.engine.kv_tiers.host import HostTier
from tandem.protocol.kv_events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)
EWMA_ALPHA = 0.2


@dataclass(frozen=True)
class EventInfo:
    """What a tier's `BlockStored` event names besides the hash."""

    parent_hash: bytes
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""
    lora_digest: str = ""


@dataclass
class _Pending:
    """A saved block until the offload thread encodes it: its pages, every layer's
    `[2, 1, KVH, bs, row]` (one `[L, ...]` tensor, or one tensor per layer: views into the
    eviction's copy, stacked off the engine thread)."""

    pages: torch.Tensor | Sequence[torch.Tensor]
    meta: BlockMeta

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pages)

    def stacked(self) -> torch.Tensor:
        """`[L, 2, 1, KVH, bs, row]`."""
        pages = self.pages
        return pages if isinstance(pages, torch.Tensor) else torch.stack(list(pages))


@dataclass
class TierStore:
    host_bytes: int
    disk_path: str | None = None
    disk_bytes: int = 0
    compression: str = "none"
    events_enabled: bool = True
    load_s_per_block: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.host = HostTier(self.host_bytes)
        self.disk = DiskTier(Path(self.disk_path), self.disk_bytes) if self.disk_path else None
        self.counters = {MEDIUM_HOST: TierCounters(MEDIUM_HOST, self.host_bytes)}
        if self.disk is not None:
            self.counters[MEDIUM_DISK] = TierCounters(MEDIUM_DISK, self.disk_bytes)
            self.counters[MEDIUM_DISK].validation_failures = self.disk.dropped_on_start
        self.block_bytes = 0  # one block's pages, every layer (0: none saved yet)
        self._pending: dict[bytes, _Pending] = {}
        self._pending_bytes = 0  # bounded by host_bytes: `save` waits for the thread beyond
        # records the host tier pushed out, until the disk tier has them (still served)
        self._spilling: dict[bytes, bytes] = {}
        self._info: dict[bytes, EventInfo] = {}  # held blocks' event fields
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tandem-kv-offload",
                                        daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------
    def holds(self, block_hash: bytes) -> str | None:
        """The medium holding `block_hash` (host before disk), or None."""
        if (block_hash in self._pending or block_hash in self.host
                or block_hash in self._spilling):
            return MEDIUM_HOST
        if self.disk is not None and block_hash in self.disk:
            return MEDIUM_DISK
        return None

    def lookup(self, hashes: list[bytes]) -> int:
        """How many leading `hashes` the tiers hold (unverified: a fetch may still fail)."""
        n = 0
        while n < len(hashes) and self.holds(hashes[n]) is not None:
            n += 1
        return n

    def save(self, blocks: list[tuple[BlockMeta, EventInfo,
                                      torch.Tensor | Sequence[torch.Tensor]]]) -> None:
        """Copies of evicted blocks' pages (`[L, 2, 1, KVH, bs, row]` each, or its L layers,
        the caller's to give): held at once, encoded on the offload thread (replacing a host
        copy)."""
        stored = []
        with self._lock:
            for meta, info, pages in blocks:
                h = meta.block_hash
                pending = _Pending(pages, meta)
                self.block_bytes = pending.nbytes
                if h in self._pending:
                    continue
                # a host copy is replaced: these pages were just computed (or verified)
                self._pending[h] = pending
                self._pending_bytes += self.block_bytes
                self._info[h] = info
                self.counters[MEDIUM_HOST].stores += 1
                stored.append(h)
                self._queue.put(h)
            for h in stored:
                self._stored(h, MEDIUM_HOST)
            behind = self._pending_bytes > self.host_bytes
        if behind:  # the offload thread fell behind: hold the engine until it catches up
            self.flush()

    def fetch(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype,
              lora_digest: str) -> torch.Tensor | None:
        """Block `block_hash`'s pages (`shape`, `dtype`) from the nearest tier holding it,
        verified; None if none holds it or its record fails verification (then dropped)."""
        t0 = time.perf_counter()
        medium = self.holds(block_hash)
        if medium is None:
            return None
        c = self.counters[medium]
        c.hits += 1
        with self._lock:
            pending = self._pending.get(block_hash)
            spilling = self._spilling.get(block_hash)
        try:
            if pending is not None:  # saved and not encoded yet: the very pages saved
                m, first = pending.meta, pending.pages[0]
                if (m.block_hash != block_hash or m.lora_digest != lora_digest
                        or (len(pending.pages), *first.shape) != tuple(shape)
                        or first.dtype != dtype):
                    raise CorruptBlock("pending block does not match")
                pages = pending.stacked()
            else:
                tier = self.host if medium == MEDIUM_HOST else self.disk
                record = spilling if spilling is not None else tier.get(block_hash)
                if record is None:
                    return None
                pages = decode(record, block_hash, shape, dtype, lora_digest)
        except CorruptBlock as exc:
            logger.warning("KV %s tier: block %s does not verify (%s): dropped, recomputed",
                           medium, block_hash.hex()[:16], exc)
            c.validation_failures += 1
            self.drop(block_hash, medium)
            return None
        c.loads += 1
        took = time.perf_counter() - t0
        old = self.load_s_per_block.get(medium, 0.0)
        self.load_s_per_block[medium] = took if not old else (
            old + EWMA_ALPHA * (took - old))
        return pages

    def drop(self, block_hash: bytes, medium: str) -> None:
        with self._lock:
            if medium == MEDIUM_HOST:
                gone = self._unpend(block_hash)
                gone = self._spilling.pop(block_hash, None) is not None or gone
                gone = self.host.drop(block_hash) or gone
            else:
                gone = self.disk is not None and self.disk.drop(block_hash)
            if gone:
                self._removed(block_hash, medium)

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def host_hashes(self) -> list[bytes]:
        with self._lock:
            return list(dict.fromkeys([*self._pending, *self.host.hashes()]))

    def disk_hashes(self) -> list[bytes]:
        return [] if self.disk is None else self.disk.hashes()

    def stats(self) -> list[TierCounters]:
        self.counters[MEDIUM_HOST].used_bytes = self.host.used
        if self.disk is not None:
            self.counters[MEDIUM_DISK].used_bytes = self.disk.used
        return list(self.counters.values())

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every saved block is encoded (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        q = self._queue
        with q.all_tasks_done:
            while q.unfinished_tasks and (left := deadline - time.monotonic()) > 0:
                q.all_tasks_done.wait(left)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # -- bookkeeping (under the lock) ------------------------------------------------------
    def _unpend(self, h: bytes) -> bool:
        pending = self._pending.pop(h, None)
        if pending is None:
            return False
        self._pending_bytes -= pending.nbytes
        return True

    def _stored(self, h: bytes, medium: str) -> None:
        info = self._info.get(h)
        if self.events_enabled and info is not None:
            self._events.append(BlockStored((h,), info.parent_hash, info.token_ids,
                                            info.block_size, info.lora_name, info.lora_digest,
                                            medium=medium))

    def _removed(self, h: bytes, medium: str) -> None:
        if self.events_enabled:
            self._events.append(BlockRemoved((h,), medium=medium))
        if self.holds(h) is None:
            self._info.pop(h, None)

    # -- the offload thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            h = self._queue.get()
            try:
                if h is None:
                    return
                self._encode(h)
            except Exception:  # noqa: BLE001 - a failed save loses one block, not the thread
                logger.exception("KV offload: saving block %s failed", h.hex()[:16] if h else h)
                if h is not None:
                    self.drop(h, MEDIUM_HOST)
            finally:
                self._queue.task_done()

    def _encode(self, h: bytes) -> None:
        with self._lock:
            pending = self._pending.get(h)
        if pending is None:  # dropped meanwhile
            return
        record = encode(pending.stacked(), pending.meta, self.compression)
        with self._lock:
            if not self._unpend(h):
                return
            spilled = self.host.put(h, record)
            if self.disk is not None:
                self._spilling.update(spilled)
        for sh, srecord in spilled:
            self._spill(sh, srecord)

    def _spill(self, h: bytes, record: bytes) -> None:
        """A record the host tier pushed out: to disk if there is one, else gone."""
        self.counters[MEDIUM_HOST].evictions += 1
        if self.disk is None or h in self.disk:
            with self._lock:
                self._spilling.pop(h, None)
                self._removed(h, MEDIUM_HOST)
            return
        evicted = self.disk.put(h, record)
        disk = self.counters[MEDIUM_DISK]
        with self._lock:
            if self._spilling.pop(h, None) is None:  # dropped meanwhile (it did not verify)
                self.disk.drop(h)
                evicted = [e for e in evicted if e != h]
            else:
                self._removed(h, MEDIUM_HOST)
            if h not in evicted and h in self.disk:
                disk.stores += 1
                self._stored(h, MEDIUM_DISK)
            for e in evicted:
                disk.evictions += 1
                self._removed(e, MEDIUM_DISK)
