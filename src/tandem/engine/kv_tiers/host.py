"""The host-memory tier: encoded block records (`codec`) keyed by block hash, at most
`capacity` bytes, least recently used first out. Thread-safe (the offload thread stores,
the engine thread looks up)."""

from __future__ import annotations

import threading
from collections import OrderedDict


class HostTier:
    """An LRU of records by bytes. `put` answers the records it pushed out (oldest first),
    which the caller hands to the next tier; a record bigger than the whole tier is not
    kept (it is answered as pushed out)."""

    medium = "host"

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"host tier capacity must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._records: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._records

    def __len__(self) -> int:
        return len(self._records)

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._records)

    def put(self, block_hash: bytes, record: bytes) -> list[tuple[bytes, bytes]]:
        with self._lock:
            out: list[tuple[bytes, bytes]] = []
            old = self._records.pop(block_hash, None)
            if old is not None:
                self.used -= len(old)
            if len(record) > self.capacity:
                return [(block_hash, record)]
            while self.used + len(record) > self.capacity:
                h, r = self._records.popitem(last=False)
                self.used -= len(r)
                out.append((h, r))
            self._records[block_hash] = record
            self.used += len(record)
            return out

    def get(self, block_hash: bytes) -> bytes | None:
        """The record (now most recently used), or None."""
        with self._lock:
            record = self._records.get(block_hash)
            if record is not None:
                self._records.move_to_end(block_hash)
            return record

    def drop(self, block_hash: bytes) -> bool:
        with self._lock:
            record = self._records.pop(block_hash, None)
            if record is None:
                return False
            self.used -= len(record)
            return True
