"""What the host and disk tiers share: entries by block hash, at most `capacity` bytes,
least recently used first out, under one lock (the offload thread stores, the engine thread
looks up)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """`_records`: block hash -> entry, least recently used first; `used`: the entries'
    bytes (`_size`). The `_` methods are called under `_lock`."""

    medium = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{self.medium} tier capacity must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._records: OrderedDict[bytes, V] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _size(entry: V) -> int:
        raise NotImplementedError

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._records

    def __len__(self) -> int:
        return len(self._records)

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._records)

    def _insert(self, block_hash: bytes, entry: V) -> None:
        self._records[block_hash] = entry
        self.used += self._size(entry)

    def _pop(self, block_hash: bytes) -> V | None:
        entry = self._records.pop(block_hash, None)
        if entry is not None:
            self.used -= self._size(entry)
        return entry

    def _touch(self, block_hash: bytes) -> V | None:
        """The entry (now most recently used), or None."""
        entry = self._records.get(block_hash)
        if entry is not None:
            self._records.move_to_end(block_hash)
        return entry

    def _trim(self, incoming: int) -> list[tuple[bytes, V]]:
        """Take least recently used entries out until `incoming` more bytes fit; them."""
        out = []
        while self._records and self.used + incoming > self.capacity:
            h, entry = self._records.popitem(last=False)
            self.used -= self._size(entry)
            out.append((h, entry))
        return out
