"""Routing scorers and filters: the plugin interface and its registry.

A scorer rates each candidate worker for one request with a value in [0, 1] (1 = best);
the cache-aware policy combines them with configured weights. A filter removes candidates
outright. Both see the same `RoutingContext`, computed once per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tandem.protocol.block_hash import BlockHash
from tandem.router.workers import HashGroup, Worker

if TYPE_CHECKING:
    from tandem.router.index import Hit
    from tandem.router.peer import PeerPull
    from tandem.router.scorers.columns import Columns


@dataclass
class RoutingContext:
    """One request's routing inputs (plain values)."""

    model: str  # what the request names: a base model or a LoRA adapter
    prompt_tokens: int
    # (block size, adapter digest) -> the prompt's full-block hash chain for the workers
    # that hash alike (`Worker.hash_group`)
    hashes: dict[HashGroup, list[BlockHash]] = field(default_factory=dict)
    role: str = "decode"  # the role that must serve it: "decode" (aggregated or P/D decode)
    matched_tokens: dict[str, int] = field(default_factory=dict)  # worker id -> cached prefix
    # worker id -> decayed uncached prompt tokens the router sent it lately (ChurnTracker)
    churn_tokens: Mapping[str, float] = field(default_factory=dict)
    now: float = 0.0
    lora: str | None = None  # the adapter `model` names (None: a base model)
    session_worker: str | None = None  # the worker the request's session token names
    # KV held outside a worker's device pool (`kvcredit`): worker id -> its leading run by
    # medium (only while some worker reports host or disk tier blocks); worker id -> the
    # prompt tokens that run's tier blocks and a peer pull save beyond `matched_tokens`
    # (measured load time taken off; what the prefix and cost scorers add to the match);
    # worker id -> the peer it would pull the rest of the prefix from (`peer`)
    tier_hits: dict[str, Hit] = field(default_factory=dict)
    credit_tokens: dict[str, float] = field(default_factory=dict)
    peers: dict[str, PeerPull] = field(default_factory=dict)

    def chain(self, w: Worker) -> list[BlockHash]:
        """The prompt's hash chain as worker `w` hashes it ([] when not computed)."""
        return self.hashes.get(w.hash_group(self.lora), [])


@dataclass(frozen=True)
class LoadLimits:
    """Where a worker counts as saturated; also the scale of the absolute load scorers."""

    saturation_queue: int = 8  # running + waiting requests
    saturation_kv: float = 0.9  # KV-cache use in [0, 1]


class Scorer(ABC):
    """Every scorer is built with the policy's `LoadLimits` (most ignore them)."""

    name: str

    def __init__(self, limits: LoadLimits = LoadLimits()) -> None:  # noqa: B008 - frozen
        self.limits = limits

    @abstractmethod
    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        """One value in [0, 1] per worker, in order."""

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray | None:
        """`score` as a float64 array over `cols.workers`, exactly equal to it; None (the
        default) when the scorer has no vectorized form (the policy then calls `score`)."""
        return None


class Filter(ABC):
    name: str

    @abstractmethod
    def keep(self, ctx: RoutingContext, worker: Worker) -> bool: ...


SCORERS: dict[str, Callable[[], Scorer]] = {}
FILTERS: dict[str, Callable[[], Filter]] = {}


def register_scorer(cls: type[Scorer]) -> type[Scorer]:
    SCORERS[cls.name] = cls
    return cls


def register_filter(cls: type[Filter]) -> type[Filter]:
    FILTERS[cls.name] = cls
    return cls


def share_free(used_tokens: float, w: Worker) -> float:
    """`1 - used / capacity` in [0, 1], the capacity being the worker's KV cache in tokens;
    1.0 while the worker has not reported its capacity."""
    capacity = w.load.num_total_blocks * w.kv_block_size
    return 1.0 - min(1.0, max(used_tokens, 0.0) / capacity) if capacity > 0 else 1.0


def inverse_minmax(values: Sequence[float]) -> list[float]:
    """Lower is better -> [0, 1]: the lowest gets 1, the highest 0; all equal -> all 1."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]
