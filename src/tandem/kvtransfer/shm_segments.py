"""Shared-memory segments of the `shm` transfer backend: names, node identity, lifetime.

A segment is a file under `SHM_DIR` (/dev/shm: POSIX shared memory on Linux) named
`tandem-kv-<instance>-<128 random bits>`, mode 0600, created by the receiver (decode
worker) for one transfer. `<instance>` names the receiving process: each process that
creates segments holds an exclusive `flock` on `tandem-kv-<instance>.lock` for its whole
life, which the kernel drops when the process dies, even by kill -9. `sweep()` (run when a
receiver starts, and at most once a minute after) removes every segment whose instance's
lock is free or gone, so a killed receiver leaks nothing past the next sweep on its node.

Layout: a 4096-byte control page (magic, then the number of layers the receiver is done
with, `consumed`, which only the receiver writes), then `slots` slots of `slot_bytes` each.

Node identity (`node_identity`): the kernel's boot id and the device number of the shared
memory filesystem. Two processes get the same identity only when they run on one kernel and
see the same /dev/shm (Kubernetes pods have their own /dev/shm unless they share one), which
is exactly when a segment one creates can be opened by the other.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass, field

from tandem.kvtransfer import futex

logger = logging.getLogger(__name__)
SHM_DIR = os.environ.get("TANDEM_SHM_DIR", "/dev/shm")
PREFIX = "tandem-kv-"
SEGMENT_NAME = re.compile(r"tandem-kv-[0-9a-f]{16}-[0-9a-f]{32}")
CONTROL_BYTES = 4096
CONSUMED_AT = 8  # the control page's `consumed` counter (its low 32 bits: a futex word)
_UNSET = object()
MAGIC = 0x54414E44454D4B56  # "TANDEMKV"
MAX_SLOTS = 256  # a sender refuses (and sends by grpc) a segment claiming more
SWEEP_EVERY_S = 60.0


def node_identity() -> str:
    """This process's node identity (see the module docstring); "" without shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}/{st.st_dev:x}"


@dataclass(eq=False)
class Segment:
    """A mapped segment: `control` page and `slots` slots of `slot_bytes` (page aligned)."""

    name: str
    map: mmap.mmap
    slots: int
    slot_bytes: int
    peer: str = ""  # receiver: the prefill worker it is kept for between transfers
    idle_since: float = 0.0
    _futex: object = field(default=_UNSET, init=False, repr=False)  # `_word`'s, once known

    def slot(self, i: int, nbytes: int) -> memoryview:
        start = CONTROL_BYTES + i * self.slot_bytes
        return memoryview(self.map)[start:start + nbytes]

    @property
    def consumed(self) -> int:
        return struct.unpack_from("<Q", self.map, CONSUMED_AT)[0]

    @consumed.setter
    def consumed(self, n: int) -> None:
        """Receiver: the layers it is done with; a change wakes a sender asleep on it."""
        with contextlib.suppress(ValueError):  # unmapped: the transfer is over
            if struct.unpack_from("<Q", self.map, CONSUMED_AT)[0] != n:
                struct.pack_into("<Q", self.map, CONSUMED_AT, n)
                self.wake()

    def wait_consumed(self, seen: int, timeout_s: float) -> bool:
        """Sender: sleep while `consumed` still reads `seen`, for at most `timeout_s`, until
        the receiver changes it (or `wake`); False at once where there is no futex (the
        caller polls). May return early: the caller re-checks."""
        word = self._word()
        if word is None:
            return False
        futex.wait(word, seen, timeout_s)
        return True

    def wake(self) -> None:
        """Wake whoever sleeps in `wait_consumed` (a no-op unmapped or without futexes)."""
        word = self._word()
        if word is not None and not self.map.closed:
            futex.wake(word)

    def _word(self) -> int | None:
        """The futex word (`consumed`'s low 32 bits), looked up once."""
        if self._futex is _UNSET:
            self._futex = None if self.map.closed else futex.address(self.map, CONSUMED_AT)
        return self._futex  # type: ignore[return-value]

    def close(self) -> None:
        """Unmap (left to the garbage collector while a view of it is still alive)."""
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()


def path_of(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path_of(name))


class Instance:
    """This process's segment namespace: its lock (held while it lives) and its names."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)
        self._lock_fd: int | None = None
        self._last_sweep = float("-inf")

    def _lock(self) -> None:
        if self._lock_fd is None:
            fd = os.open(path_of(f"{PREFIX}{self.id}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._lock_fd = fd

    def create(self, slots: int, slot_bytes: int) -> Segment:
        """A fresh segment of `slots` slots of at least `slot_bytes` each, its memory
        allocated; OSError (e.g. ENOSPC) when shared memory cannot hold it."""
        self._lock()
        slot_bytes = -(-max(slot_bytes, 1) // 4096) * 4096
        name = f"{PREFIX}{self.id}-{secrets.token_hex(16)}"
        fd = os.open(path_of(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = CONTROL_BYTES + slots * slot_bytes
            # the memory now, or ENOSPC now (a full /dev/shm, e.g. a container's 64 MiB):
            # never a SIGBUS at first touch
            os.posix_fallocate(fd, 0, size)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(fd)
            unlink(name)
            raise
        os.close(fd)
        struct.pack_into("<QQ", m, 0, MAGIC, 0)
        return Segment(name, m, slots, slot_bytes)

    def maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep >= SWEEP_EVERY_S:
            self._last_sweep = now
            sweep(keep=self.id)

    def close(self) -> None:
        if self._lock_fd is not None:
            unlink(f"{PREFIX}{self.id}.lock")
            os.close(self._lock_fd)
            self._lock_fd = None


def open_segment(name: str, slots: int, slot_bytes: int) -> Segment:
    """Sender: map the receiver's segment `name`. Raises OSError when it cannot be opened
    here (another node, another user) and ValueError when it is not a valid segment."""
    if not SEGMENT_NAME.fullmatch(name) or not 1 <= slots <= MAX_SLOTS or slot_bytes < 1:
        raise ValueError(f"not a KV segment: {name[:64]!r} ({slots} x {slot_bytes} bytes)")
    fd = os.open(path_of(name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = CONTROL_BYTES + slots * slot_bytes
        if os.fstat(fd).st_size != size:
            raise ValueError(f"segment {name} is not {size} bytes")
        # the page tables in one call: a transfer then takes no page fault per 4 KiB
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    if struct.unpack_from("<Q", m, 0)[0] != MAGIC:
        m.close()
        raise ValueError(f"segment {name} is not a KV segment")
    return Segment(name, m, slots, slot_bytes)


def sweep(keep: str | None = None) -> list[str]:
    """Remove the segments (and lock files) of every instance but `keep` whose process is
    gone (its lock is free or missing); the names removed."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return []
    locks = {n[len(PREFIX):-len(".lock")] for n in names if n.endswith(".lock")}
    dead: set[str] = set()
    for inst in locks - {keep}:
        try:
            fd = os.open(path_of(f"{PREFIX}{inst}.lock"), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # held: that process is alive
            continue
        dead.add(inst)
        unlink(f"{PREFIX}{inst}.lock")
        os.close(fd)
    removed = []
    for n in names:
        if SEGMENT_NAME.fullmatch(n):
            inst = n[len(PREFIX):len(PREFIX) + 16]
            if inst != keep and (inst in dead or inst not in locks):
                unlink(n)
                removed.append(n)
    if removed:
        logger.info("removed %d KV segments left by stopped workers", len(removed))
    return removed
