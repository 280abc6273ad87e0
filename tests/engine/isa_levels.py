"""The CPU levels (`engine/cpu_isa.py`) this machine can run, for tests that run a kernel
at each one in turn: `load_native(level)` builds the library for that level, and
`forced_level` caps the whole engine at it (as `TANDEM_CPU_ISA` does) for the duration."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.engine import cpu_isa as isa

# every level up to this CPU's own, lowest first (on x86-64 at least scalar and, on any
# machine CI runs on, avx2)
LEVELS_HERE = isa.LEVELS[: isa.LEVELS.index(isa.cpu_isa().detected) + 1]


@contextmanager
def forced_level(level: str) -> Iterator[None]:
    """`TANDEM_CPU_ISA=level` for the block: `cpu_isa()` and so `load_native()` answer for
    that level inside it, and as before after it."""
    before = os.environ.get(isa.ENV)
    os.environ[isa.ENV] = level
    isa.cpu_isa.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ[isa.ENV]
        else:
            os.environ[isa.ENV] = before
        isa.cpu_isa.cache_clear()
