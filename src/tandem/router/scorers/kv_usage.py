"""KV-utilization scorer: 1 - the worker's KV cache usage."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer
from tandem.router.scorers.columns import Columns, pmax, pmin
from tandem.router.workers import Worker


@register_scorer
class KVUsageScorer(Scorer):
    name = "kv_usage"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        return [min(max(1.0 - w.load.kv_cache_usage, 0.0), 1.0) for w in workers]

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray:
        return pmin(pmax(1.0 - cols.kv_usage, 0.0), 1.0)
