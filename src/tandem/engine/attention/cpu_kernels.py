"""Builds and loads the native CPU attention kernels (`csrc/*.c`) with the system C compiler.

The kernel is plain C99 + OpenMP, compiled once per machine with `-O3 -march=native` into
`$TANDEM_CACHE_DIR/kernels/` (or the user cache), named by a hash of the source, flags,
compiler version and CPU flags, and loaded with ctypes (which releases the GIL during the
call). OpenMP resolves to the `libgomp.so.1` torch already loaded, so the kernel and torch
share one thread pool. Any failure (no compiler, unsupported platform) returns None and the
caller keeps the pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c99")
ABI_VERSION = 2
DISABLE_ENV = "TANDEM_DISABLE_NATIVE_KERNELS"


def _cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("TANDEM_CACHE_DIR") or user_cache_dir("tandem")) / "kernels"


def _cpu_fingerprint() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)  # atomic: concurrent builders never see a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def load_paged_attention() -> ctypes.CDLL | None:
    """The loaded kernel library, or None if it cannot be built here."""
    if os.environ.get(DISABLE_ENV):
        logger.info("native CPU kernels disabled by %s", DISABLE_ENV)
        return None
    if platform.system() != "Linux":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found; using the pure-torch attention path")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        key = hashlib.sha256("\0".join(
            [SOURCE.read_text(), " ".join(CFLAGS), version, _cpu_fingerprint()]).encode()
        ).hexdigest()[:24]
        path = _cache_dir() / f"paged_attention_cpu-{key}.so"
        if not path.exists():
            logger.info("compiling %s with %s", SOURCE.name, cc)
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
        if lib.tandem_paged_attention_abi() != ABI_VERSION:
            raise RuntimeError("kernel ABI mismatch")
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        logger.warning("native CPU attention unavailable (%s %s); using pure torch",
                       exc, detail.strip()[:500])
        return None
    fn = lib.tandem_paged_attention_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int64]
    return lib
