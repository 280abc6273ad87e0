"""Builds and loads Tandem's native CPU kernels (`csrc/*.c`) with the system C compiler.

The kernels are plain C99 + OpenMP whose vector paths are chosen at compile time
(`#if defined(__AVX2__)`, `__AVX512F__`, ...), so the library is compiled once per machine
and CPU level (`engine.cpu_isa`): `-march=native` at the CPU's own level, or the generic
architecture of a lower level that `TANDEM_CPU_ISA` forces (`MARCH`), so one machine builds
and tests every path. Each build is one shared library under `kernels/` of Tandem's cache
(`protocol.bundled.cache_dir`: `$TANDEM_CACHE_DIR` or the user cache), named by a hash of
the sources, flags, compiler version and CPU flags, and loaded with ctypes (which releases
the GIL during each call).
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

from tandem.engine.cpu_isa import cpu_isa, resolve

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("paged_attention_cpu.c", "prefill_attention_cpu.c", "elementwise_cpu.c",
           "linear_cpu.c", "linear_bf16_cpu.c", "w8a8_cpu.c", "quant_linear_cpu.c",
           "lora_cpu.c", "kv_copy_cpu.c")
HEADERS = ("tile_avx2.h", "bf16.h")  # included by the sources: part of the cache key
CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c99")
ABI_VERSION = 7
DISABLE_ENV = "TANDEM_DISABLE_NATIVE_KERNELS"
# x86-64 code generation for a level below the CPU's own (cpu_isa.LEVELS); the CPU's own
# level always builds with -march=native
MARCH = {
    "scalar": ("-march=x86-64-v2", "-mtune=generic"),
    "avx2": ("-march=haswell", "-mtune=generic"),
    "avx512": ("-march=skylake-avx512", "-mtune=generic"),
    "avx512_bf16": ("-march=cooperlake", "-mtune=generic"),
    "amx": ("-march=sapphirerapids", "-mtune=generic"),
}

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# name -> (restype, argtypes); the C files document each layout
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "tandem_paged_attention_decode": (ctypes.c_int, [_P] * 6 + [_I64] * 11 + [_F32, _I64]),
    "tandem_paged_attention_prefill": (ctypes.c_int, [_P] * 8 + [_I64] * 11 + [_F32, _I64]),
    "tandem_kv_quantize_write": (ctypes.c_int, [_P] * 3 + [_I64] * 7),
    "tandem_add_rms_norm_f32": (None, [_P] * 4 + [_I64, _I64, _F32, _I64]),
    "tandem_silu_mul_f32": (None, [_P, _P, _I64, _I64, _I64]),
    "tandem_rope_f32": (None, [_P] * 4 + [_I64] * 5),
    "tandem_add_rms_norm_bf16": (None, [_P] * 4 + [_I64, _I64, _F32, _I64]),
    "tandem_silu_mul_bf16": (None, [_P, _P, _I64, _I64, _I64]),
    "tandem_rope_bf16": (None, [_P] * 4 + [_I64] * 5),
    "tandem_linear_packed_f32": (None, [_P] * 4 + [_I64] * 4),
    "tandem_linear_simd": (_I64, []),
    "tandem_linear_bf16": (None, [_P] * 4 + [_I64] * 5),
    "tandem_linear_bf16_simd": (_I64, []),
    "tandem_quant_linear_i8_bf16": (ctypes.c_int, [_P] * 6 + [_I64] * 5),
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


def march_flags(level: str) -> tuple[str, ...]:
    """The code-generation flags of the library for CPU level `level` on this machine."""
    isa = cpu_isa()
    if level == isa.detected or platform.machine() not in ("x86_64", "AMD64"):
        return ("-march=native",)
    return MARCH[level]


def _build(cc: str, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *(str(CSRC / s) for s in SOURCES), "-o", tmp, "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)  # atomic: concurrent builders never see a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_native(level: str | None = None) -> ctypes.CDLL | None:
    """The kernel library for CPU level `level` (default: `cpu_isa().level`, the CPU's own
    capped by `TANDEM_CPU_ISA`) with typed functions, or None if it cannot be built here.
    Raises ValueError for a level above the CPU's."""
    isa = cpu_isa()
    if level is None:
        level = isa.level
    else:
        resolve(isa.flags, level)  # ValueError: an unknown level, or one above this CPU's
    return _load(level)


@functools.cache
def _load(level: str) -> ctypes.CDLL | None:
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
        flags = (*CFLAGS, *march_flags(level))
        key = hashlib.sha256("\0".join(
            [*parts, " ".join(flags), version, _cpu_fingerprint()]).encode()).hexdigest()[:24]
        path = _cache_dir() / f"tandem_cpu-{level}-{key}.so"
        if not path.exists():
            logger.info("compiling native CPU kernels (%s: %s) with %s", level,
                        " ".join(march_flags(level)), cc)
            _build(cc, flags, path)
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
