"""Builds and loads Tandem's native CPU kernels (`csrc/*.c`) with the system C compiler.

The kernels are plain C99 + OpenMP, compiled once per machine with `-O3 -march=native` into
one shared library under `kernels/` of Tandem's cache (`protocol.bundled.cache_dir`:
`$TANDEM_CACHE_DIR` or the user cache), named by a hash of the sources, flags, compiler
version and CPU flags, and loaded with ctypes (which releases the GIL during each call).
OpenMP resolves to the `libgomp.so.1` torch already loaded, so the kernels and torch share
one thread pool. Any failure (no compiler, not Linux, a build or load error,
`TANDEM_DISABLE_NATIVE_KERNELS=1`) yields None and callers keep the pure-torch path.
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

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("paged_attention_cpu.c", "prefill_attention_cpu.c", "elementwise_cpu.c",
           "linear_cpu.c", "w8a8_cpu.c", "quant_linear_cpu.c", "lora_cpu.c", "kv_copy_cpu.c")
HEADERS = ("tile_avx2.h",)  # included by the sources: part of the cache key
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c99")
ABI_VERSION = 6
DISABLE_ENV = "TANDEM_DISABLE_NATIVE_KERNELS"

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# name -> (restype, argtypes); the C files document each layout
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "tandem_paged_attention_decode_f32": (ctypes.c_int, [_P] * 6 + [_I64] * 9 + [_F32, _I64]),
    "tandem_paged_attention_prefill_f32": (ctypes.c_int,
                                           [_P] * 8 + [_I64] * 9 + [_F32, _I64]),
    "tandem_paged_attention_decode_q8": (ctypes.c_int, [_P] * 6 + [_I64] * 10 + [_F32, _I64]),
    "tandem_kv_quantize_write": (ctypes.c_int, [_P] * 3 + [_I64] * 7),
    "tandem_add_rms_norm_f32": (None, [_P] * 4 + [_I64, _I64, _F32, _I64]),
    "tandem_silu_mul_f32": (None, [_P, _P, _I64, _I64, _I64]),
    "tandem_rope_f32": (None, [_P] * 4 + [_I64] * 5),
    "tandem_linear_packed_f32": (None, [_P] * 4 + [_I64] * 4),
    "tandem_linear_simd": (_I64, []),
    "tandem_quant_linear_i8": (None, [_P] * 6 + [_I64] * 6),
    "tandem_quant_linear_i4": (None, [_P] * 6 + [_I64] * 6),
    "tandem_quant_linear_simd": (_I64, []),
    "tandem_w8a8_simd": (_I64, []),
    "tandem_w8a8_quantize_f32": (None, [_P] * 3 + [_I64] * 4),
    "tandem_w8a8_gemm_i32": (ctypes.c_int, [_P] * 3 + [_I64] * 4),
    "tandem_w8a8_linear_f32": (ctypes.c_int, [_P] * 5 + [_I64] * 4),
    "tandem_lora_f32": (None, [_P] * 8 + [_I64] * 7),
    "tandem_kv_copy_hash": (ctypes.c_int, [_P] * 4 + [_I64] * 2 + [_P] * 2 + [_I64]),
}


def _cache_dir() -> Path:
    from tandem.protocol.bundled import cache_dir

    return cache_dir() / "kernels"


def _cpu_fingerprint() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, *(str(CSRC / s) for s in SOURCES), "-o", tmp, "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)  # atomic: concurrent builders never see a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def load_native() -> ctypes.CDLL | None:
    """The loaded kernel library with typed functions, or None if it cannot be built here."""
    if os.environ.get(DISABLE_ENV):
        logger.info("native CPU kernels disabled by %s", DISABLE_ENV)
        return None
    if platform.system() != "Linux":
        return None
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        logger.warning("no C compiler found; using the pure-torch CPU path")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        parts = [(CSRC / s).read_text() for s in (*SOURCES, *HEADERS)]
        key = hashlib.sha256("\0".join(
            [*parts, " ".join(CFLAGS), version, _cpu_fingerprint()]).encode()).hexdigest()[:24]
        path = _cache_dir() / f"tandem_cpu-{key}.so"
        if not path.exists():
            logger.info("compiling native CPU kernels with %s", cc)
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
        if lib.tandem_paged_attention_abi() != ABI_VERSION:
            raise RuntimeError("kernel ABI mismatch")
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)  # AttributeError: a library without this kernel
            fn.restype = restype
            fn.argtypes = argtypes
    # ImportError: a module the cache location needs is missing (the fallback is pure torch,
    # never a failed start)
    except (OSError, RuntimeError, subprocess.SubprocessError, ImportError,
            AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        logger.warning("native CPU kernels unavailable (%s %s); using pure torch",
                       exc, detail.strip()[:500])
        return None
    return lib
