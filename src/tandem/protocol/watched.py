"""A small file (a mounted Kubernetes Secret) whose parsed value follows the file's content.

`WatchedFile.value()` re-reads the file when `interval_s` has passed since the last check
(lazily, on the caller's path: a request that arrives after the interval sees the file as
it is now) and re-parses it when its bytes changed. Content is compared, not mtime or
inode, so kubelet's symlink swap of a Secret volume (`..data` -> a new directory) and an
in-place rewrite are both seen. A file that becomes unreadable, too large or unparseable
keeps the last good value; the error is logged (once per distinct error) and counted.
The first read happens in the constructor and raises `WatchedFileError` naming the file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_INTERVAL_S = 2.0  # how stale a value may be (the API keys file's reload bound)


class WatchedFileError(ValueError):
    """The file cannot be read, is too large, or does not parse."""


class WatchedFile(Generic[T]):
    def __init__(self, path: str | Path, parse: Callable[[bytes], T], *, what: str,
                 max_bytes: int, interval_s: float = DEFAULT_INTERVAL_S,
                 on_change: Callable[[T, T], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`parse(raw)` -> value, raising ValueError on bad content; `on_change(old, new)`
        runs after each successful reload with different content."""
        self.path = Path(path)
        self.what = what
        self._parse = parse
        self._max = max_bytes
        self.interval_s = interval_s
        self._on_change = on_change
        self._clock = clock
        self.errors = 0  # failed reloads (the last good value stayed)
        self.reloads = 0  # successful reloads with new content
        self._last_error: str | None = None
        self._raw = self._read()
        self._value = self._parse_checked(self._raw)
        self._checked = clock()

    def _read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(self._max + 1)
        except OSError as exc:
            raise WatchedFileError(f"{self.what} {self.path}: cannot read: "
                                   f"{exc.strerror or exc}") from exc
        if len(raw) > self._max:
            raise WatchedFileError(f"{self.what} {self.path}: larger than {self._max} bytes")
        return raw

    def _parse_checked(self, raw: bytes) -> T:
        try:
            return self._parse(raw)
        except ValueError as exc:
            raise WatchedFileError(f"{self.what} {self.path}: {exc}") from exc

    def value(self) -> T:
        """The current value (re-checking the file when `interval_s` has passed)."""
        now = self._clock()
        if now - self._checked >= self.interval_s:
            self._checked = now
            self.check()
        return self._value

    def check(self) -> bool:
        """Re-read now; True when the content changed and the new value took effect."""
        try:
            raw = self._read()
            if raw == self._raw:
                self._last_error = None
                return False
            new = self._parse_checked(raw)
        except WatchedFileError as exc:
            self.errors += 1
            if str(exc) != self._last_error:
                logger.error("%s; keeping the last good %s", exc, self.what)
                self._last_error = str(exc)
            return False
        old, self._raw, self._value = self._value, raw, new
        self._last_error = None
        self.reloads += 1
        logger.info("%s %s changed: reloaded", self.what, self.path)
        if self._on_change is not None:
            self._on_change(old, new)
        return True
