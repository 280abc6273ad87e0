"""Seeded simulations over worker processes (CI has two cores; a trace is pure Python, one
core). `start_pool` spawns the processes once (a module fixture keeps them: each one loads
the tokenizer once), `split` cuts the seeds into one contiguous share per process."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.pool import Pool


def num_procs() -> int:
    return min(2, os.cpu_count() or 1)


def split(num: int, parts: int) -> list[range]:
    """Seeds [0, num) in `parts` contiguous shares (the last one may be shorter)."""
    share = -(-num // parts)
    return [range(i * share, min(num, (i + 1) * share)) for i in range(parts)]


@contextmanager
def start_pool(procs: int | None = None) -> Iterator[Pool]:
    """A pool of `procs` (default `num_procs()`) spawned processes, ended on exit."""
    ctx = multiprocessing.get_context("spawn")  # no fork under torch's and tokenizers' threads
    with ctx.Pool(procs or num_procs()) as pool:
        yield pool
