"""One request's candidate fields as float64 arrays, for scorers' vectorized form.

`Columns(ctx, workers)` gathers each field the first time a scorer asks for it (one pass
over the candidates), so a policy reads every worker field once however many scorers use
it. `pmax` / `pmin` are numpy's elementwise forms of Python's `max(a, b)` / `min(a, b)`,
NaN included (Python keeps `a` unless `b` compares greater / smaller), so a vectorized
scorer gives exactly the floats its scalar `score` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from tandem.router.scorers.base import RoutingContext
from tandem.router.workers import DEFAULT_BLOCK_SIZE, Worker


def pmax(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """Python's `max(a, b)` per element."""
    return np.where(b > a, b, a)


def pmin(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """Python's `min(a, b)` per element."""
    return np.where(b < a, b, a)


class Columns:
    """Candidate fields (in `workers` order), each a float64 array read on first use."""

    def __init__(self, ctx: RoutingContext, workers: Sequence[Worker]) -> None:
        self.ctx, self.workers, self.n = ctx, workers, len(workers)

    def _array(self, values: list) -> np.ndarray:
        return np.array(values, np.float64) if values else np.zeros(0)

    @cached_property
    def _load(self) -> np.ndarray:
        """(n, 4): queue depth, KV use, in-flight tokens, KV capacity in tokens, read in
        one pass over the candidates."""
        if not self.n:
            return np.zeros((0, 4))
        return np.array([(max(ld.num_running + ld.num_waiting, w.local_in_flight),
                          ld.kv_cache_usage, ld.in_flight_tokens,
                          ld.num_total_blocks * (w.block_size or DEFAULT_BLOCK_SIZE))
                         for w in self.workers for ld in (w.load,)], np.float64)

    @property
    def queue_depth(self) -> np.ndarray:
        """`Worker.queue_depth` (requests)."""
        return self._load[:, 0]

    @property
    def kv_usage(self) -> np.ndarray:
        """Reported KV-cache use in [0, 1]."""
        return self._load[:, 1]

    @property
    def in_flight_tokens(self) -> np.ndarray:
        return self._load[:, 2]

    @property
    def capacity_tokens(self) -> np.ndarray:
        """KV capacity in tokens (`num_total_blocks x` `Worker.kv_block_size`; 0: not
        reported)."""
        return self._load[:, 3]

    @cached_property
    def matched_tokens(self) -> np.ndarray:
        got = self.ctx.matched_tokens.get
        return self._array([got(w.id, 0) for w in self.workers])

    @cached_property
    def churn_tokens(self) -> np.ndarray:
        got = self.ctx.churn_tokens.get
        return self._array([got(w.id, 0.0) for w in self.workers])

    def share_free(self, used: np.ndarray) -> np.ndarray:
        """`base.share_free` per candidate: `1 - min(1, max(used, 0) / capacity)`, 1.0 where
        the capacity is not reported."""
        cap = self.capacity_tokens
        known = cap > 0
        ratio = np.divide(pmax(used, 0.0), cap, out=np.zeros(self.n), where=known)
        return np.where(known, 1.0 - pmin(1.0, ratio), 1.0)
