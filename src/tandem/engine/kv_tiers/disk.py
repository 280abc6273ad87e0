"""The disk tier: one file per block record (`<block hash hex>.kvb`) under a directory, at
most `capacity` bytes, least recently used first out.

Crash-safe: a record is written to a temporary file, fsynced, then renamed into place (and
the directory fsynced), so a file under its final name is whole or absent. On start the
index is rebuilt from the directory: temporary files are deleted, and every record is read
and verified (`codec.verify`: framing and digest, and its name must be its block hash);
one that does not verify is deleted, so a kill -9 mid-write never leaves a page to serve.
Reads are verified again by the caller (`codec.decode`). Thread-safe."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from tandem.engine.kv_tiers.codec import CorruptBlock, verify
from tandem.engine.kv_tiers.lru import ByteLRU

logger = logging.getLogger(__name__)
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"


class DiskTier(ByteLRU[int]):
    """`_records`: block hash -> its file's bytes."""

    medium = "disk"

    def __init__(self, path: str | os.PathLike[str], capacity: int) -> None:
        super().__init__(capacity)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.dropped_on_start = 0  # files that did not verify when the index was rebuilt
        self._rebuild()

    @staticmethod
    def _size(entry: int) -> int:
        return entry

    def _file(self, block_hash: bytes) -> Path:
        return self.path / (block_hash.hex() + SUFFIX)

    def _rebuild(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for entry in os.scandir(self.path):
            if not entry.is_file():
                continue
            if entry.name.endswith(TMP_SUFFIX):
                os.unlink(entry.path)  # a write that never finished
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                data = Path(entry.path).read_bytes()
                block_hash = verify(data)
                if block_hash.hex() + SUFFIX != entry.name:
                    raise CorruptBlock("record is not the block its file name says")
            except (OSError, CorruptBlock) as exc:
                logger.warning("KV disk tier: dropping %s (%s)", entry.name, exc)
                self.dropped_on_start += 1
                os.unlink(entry.path)
                continue
            found.append((entry.stat().st_mtime, block_hash, len(data)))
        for _, block_hash, size in sorted(found):
            self._insert(block_hash, size)
        for block_hash, _ in self._trim(0):
            self._remove(block_hash)

    def _remove(self, block_hash: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(block_hash))

    def put(self, block_hash: bytes, record: bytes) -> list[bytes]:
        """Store `record` durably; answers the hashes it evicted (and `block_hash` itself if
        the record is bigger than the tier)."""
        if len(record) > self.capacity:
            return [block_hash]
        final = self._file(block_hash)
        tmp = final.with_name(final.name + f".{threading.get_ident()}{TMP_SUFFIX}")
        with open(tmp, "wb") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
        with self._lock:
            self._pop(block_hash)
            evicted = [h for h, _ in self._trim(len(record))]
            os.replace(tmp, final)
            self._insert(block_hash, len(record))
            for h in evicted:
                self._remove(h)
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return evicted

    def get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            if self._touch(block_hash) is None:
                return None
        try:
            return self._file(block_hash).read_bytes()
        except OSError:
            self.drop(block_hash)
            return None

    def drop(self, block_hash: bytes) -> bool:
        with self._lock:
            if self._pop(block_hash) is None:
                return False
            self._remove(block_hash)
            return True
