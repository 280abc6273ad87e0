"""Native copies of whole KV blocks, fused with the XXH3-64 digest of the bytes copied.

`copy_blocks` runs the native kernel `tandem_kv_copy_hash` (`csrc/kv_copy_cpu.c`): block i
of `src_idx` goes to block i of `dst_idx` (each `block_bytes`, relative to two base
addresses), in order, one thread, the GIL released; with a `Digest` each piece is hashed
right before it is copied (the copy then reads it from the core's cache), so the bytes
cross memory once.
The hash is the `xxhash` module's own XXH3-64 (its library's `XXH3_64bits_update`, called
from C through its address), so a digest equals `xxhash.xxh3_64(bytes).intdigest()`.

numpy's `take` copies whole-block elements at about 6 GB/s on the measured machine and
`torch.index_select` runs an OpenMP team; this kernel copies the same blocks at memory
speed on one core. `available()` is False without the native library (no compiler,
`TANDEM_DISABLE_NATIVE_KERNELS`) or without those `xxhash` symbols: callers then keep
their numpy path.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np

logger = logging.getLogger(__name__)

# writes of at least this many bytes into a KV cache use non-temporal stores: no read of
# lines about to be overwritten whole, and the source stays cached (measured on one core:
# +24 % from a buffer in the last-level cache, +30 % from memory)
STREAM_CACHE_WRITES = 1 << 20


@functools.lru_cache(maxsize=1)
def _hash_lib() -> tuple[ctypes.CDLL, int] | None:
    """The `xxhash` module's library with its XXH3 state functions typed, and the address of
    its fastest `XXH3_64bits_update` (the SIMD-dispatching one where exported)."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
        update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.restype = ctypes.c_int
        lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
        return lib, ctypes.cast(update, ctypes.c_void_p).value or 0
    except (ImportError, OSError, AttributeError) as exc:
        logger.info("native page digests unavailable (%s)", exc)
        return None


@functools.lru_cache(maxsize=1)
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    from tandem.engine.native import load_native

    lib = load_native()
    return None if lib is None else lib.tandem_kv_copy_hash


def available() -> bool:
    """True where `copy_blocks` (and `Digest`) run natively."""
    return _kernel() is not None and _hash_lib() is not None


class Digest:
    """An XXH3-64 state (seed 0) of the `xxhash` library, fed by `copy_blocks`. One user at
    a time; `reset` before each digest."""

    __slots__ = ("_lib", "_state", "update_fn")

    def __init__(self) -> None:
        got = _hash_lib()
        if got is None:
            raise RuntimeError("native page digests are unavailable")
        self._lib, self.update_fn = got
        self._state = self._lib.XXH3_createState()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        self.reset()

    @property
    def state(self) -> int:
        return self._state

    def reset(self) -> None:
        self._lib.XXH3_64bits_reset(self._state)

    def intdigest(self) -> int:
        return int(self._lib.XXH3_64bits_digest(self._state))

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            self._lib.XXH3_freeState(state)


def block_indices(ids: list[int] | np.ndarray) -> np.ndarray:
    """Block ids as the kernel's contiguous int64 array."""
    return np.ascontiguousarray(ids, dtype=np.int64)


def copy_blocks(src: int, src_idx: np.ndarray, dst: int | None, dst_idx: np.ndarray | None,
                block_bytes: int, digest: Digest | None = None, stream: bool = False) -> None:
    """Copy block `src_idx[i]` of the memory at address `src` to block `dst_idx[i]` at `dst`
    (`block_bytes` each, in order; `dst` None or a negative `dst_idx[i]`: copy nothing, hash
    the source block), hashing every source block into `digest` when given. `stream`:
    non-temporal stores, for a destination nothing reads while it is still cached (a KV
    cache being filled; a buffer larger than the last-level cache). The caller owns
    the bounds: every index must lie inside its buffer (ids are checked where they are
    built). Raises RuntimeError without the native kernel."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("native page copies are unavailable")
    n = len(src_idx)
    if dst is not None and (dst_idx is None or len(dst_idx) != n):
        raise ValueError("src_idx and dst_idx differ in length")
    if src_idx.dtype != np.int64 or not src_idx.flags.c_contiguous or (
            dst_idx is not None and (dst_idx.dtype != np.int64
                                     or not dst_idx.flags.c_contiguous)):
        raise ValueError("block indices must be contiguous int64 (block_indices)")
    rc = kernel(src, src_idx.ctypes.data, dst, None if dst_idx is None else dst_idx.ctypes.data,
                n, block_bytes, None if digest is None else digest.state,
                None if digest is None else digest.update_fn, int(stream))
    if rc != 0:
        raise RuntimeError(f"tandem_kv_copy_hash failed ({rc})")
