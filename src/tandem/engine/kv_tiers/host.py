"""The host-memory tier: encoded block records (`codec`) keyed by block hash, at most
`capacity` bytes, least recently used first out. Thread-safe (the offload thread stores,
the engine thread looks up)."""

from __future__ import annotations

from tandem.engine.kv_tiers.lru import ByteLRU


class HostTier(ByteLRU[bytes]):
    """An LRU of records by bytes. `put` answers the records it pushed out (oldest first),
    which the caller hands to the next tier; a record bigger than the whole tier is not
    kept (it is answered as pushed out)."""

    medium = "host"
    _size = staticmethod(len)

    def put(self, block_hash: bytes, record: bytes) -> list[tuple[bytes, bytes]]:
        with self._lock:
            self._pop(block_hash)
            if len(record) > self.capacity:
                return [(block_hash, record)]
            out = self._trim(len(record))
            self._insert(block_hash, record)
            return out

    def get(self, block_hash: bytes) -> bytes | None:
        """The record (now most recently used), or None."""
        with self._lock:
            return self._touch(block_hash)

    def drop(self, block_hash: bytes) -> bool:
        with self._lock:
            return self._pop(block_hash) is not None
