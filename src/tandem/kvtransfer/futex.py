"""Cross-process wait and wake on a 32-bit word of a shared mapping (Linux futex).

The `shm` sender sleeps on the low word of the control page's `consumed` counter until the
receiver, which bumps it, wakes it (`wake`): no polling delay between layers. Shared (not
PRIVATE) futexes, so a waiter and a waker in different processes meet on the same page.
`address` is None where there is no futex (another OS or an architecture not listed): the
caller polls instead. A wait may return early (a wake, a signal, the word already changed,
the timeout): callers re-check their condition, and pass a bounded timeout.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
FUTEX_WAIT, FUTEX_WAKE = 0, 1
_MAX_WAKE = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # foreign calls release the GIL
    except OSError:
        return None
    libc.syscall.restype = ctypes.c_long
    return libc


_LIBC = _libc()


def address(m: mmap.mmap, offset: int) -> int | None:
    """The address of the 32-bit word at `offset` of `m` (4-aligned, in the mapping), or
    None without futexes. Valid while `m` stays mapped; no buffer export is kept."""
    if _LIBC is None or offset % 4 or not 0 <= offset <= len(m) - 4:
        return None
    word = ctypes.c_uint32.from_buffer(m, offset)
    try:
        return ctypes.addressof(word)
    finally:
        del word  # releases the export: `m` can still be closed


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the word at `addr` holds `expected` (its low 32 bits), for at most
    `timeout_s`, or until a `wake`; returns at once when the word differs."""
    assert _LIBC is not None
    timeout_s = max(0.0, timeout_s)
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAIT),
                  ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None,
                  ctypes.c_int(0))


def wake(addr: int) -> None:
    """Wake every process waiting on the word at `addr`."""
    assert _LIBC is not None
    _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAKE),
                  ctypes.c_int(_MAX_WAKE), None, None, ctypes.c_int(0))
