"""The CPU's instruction-set level, as the engine's CPU paths choose their kernels by it.

Levels, lowest first (each includes the ones before it):

* `scalar` — nothing below; plain torch operations and the portable C paths.
* `avx2` — AVX2 + FMA: the native float32 panels and attention tiles.
* `avx512` — AVX-512 F/BW/VL: oneDNN's float32 kernels beat the AVX2 panels here.
* `avx512_bf16` — AVX512-BF16 and VNNI: bfloat16 dot products in hardware (Zen 4, Cooper
  Lake, Sapphire Rapids); bfloat16 linear layers go through oneDNN's packed weights.
* `amx` — AMX tiles for bfloat16 and int8 (Sapphire Rapids and later).

`cpu_isa()` reads the CPU's flags (`/proc/cpuinfo` on Linux), then caps the level at
`TANDEM_CPU_ISA` when set, so one machine can run and test every lower path; asking for a
level the CPU lacks is an error naming the one it has. The choice depends on the machine
and the variable alone, so every worker on one machine computes alike.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
ENV = "TANDEM_CPU_ISA"

# the flags (as /proc/cpuinfo names them) each level needs, on top of the level below
_NEEDS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl"},
    "avx512_bf16": {"avx512_bf16", "avx512_vnni"},
    "amx": {"amx_bf16", "amx_int8", "amx_tile"},
}


@dataclass(frozen=True)
class CpuIsa:
    """The level the engine uses (`level`), the CPU's own (`detected`) and its flags."""

    level: str
    detected: str
    flags: frozenset[str]

    def at_least(self, level: str) -> bool:
        """The engine may use `level`'s instructions."""
        return LEVELS.index(self.level) >= LEVELS.index(_known(level))


def _known(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"unknown CPU ISA level {level!r}; choose from {', '.join(LEVELS)}")
    return level


def detect_level(flags: frozenset[str]) -> str:
    """The highest level all of whose flags (and the lower levels') are in `flags`."""
    level = "scalar"
    for name in LEVELS[1:]:
        if not _NEEDS[name] <= flags:
            break
        level = name
    return level


def resolve(flags: frozenset[str], requested: str | None) -> CpuIsa:
    """The level for a CPU with `flags`, capped at `requested` (`TANDEM_CPU_ISA`'s value;
    None or "" for none). Raises ValueError for an unknown level or one above the CPU's."""
    detected = detect_level(flags)
    level = detected
    if requested:
        want = _known(requested.strip().lower())
        if LEVELS.index(want) > LEVELS.index(detected):
            raise ValueError(f"{ENV}={want} but this CPU's level is {detected} (flags for "
                             f"{want}: {' '.join(sorted(_NEEDS[want]))})")
        level = want
    return CpuIsa(level, detected, flags)


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()  # not Linux, or no /proc: the scalar paths


@functools.lru_cache(maxsize=1)
def cpu_isa() -> CpuIsa:
    """This machine's level under `TANDEM_CPU_ISA` (read once per process)."""
    return resolve(_cpu_flags(), os.environ.get(ENV))
