"""Queue-depth scorer: fewer running + waiting requests is better, on an absolute scale.

`1 - depth / limits.saturation_queue`, clamped to [0, 1]: 0 at the depth where a worker
counts as saturated. Absolute, not min-max over the candidates: min-max turns a one-request
difference into the whole [0, 1] range, which let load outvote a large prefix hit on a
replica that was only marginally busier.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer
from tandem.router.scorers.columns import Columns, pmax
from tandem.router.workers import Worker


@register_scorer
class QueueScorer(Scorer):
    name = "queue"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        scale = max(self.limits.saturation_queue, 1)
        return [max(0.0, 1.0 - w.queue_depth / scale) for w in workers]

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray:
        return pmax(0.0, 1.0 - cols.queue_depth / max(self.limits.saturation_queue, 1))
