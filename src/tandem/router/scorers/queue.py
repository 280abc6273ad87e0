"""Queue-depth scorer: fewer running + waiting requests is better, on an absolute scale.

`1 - depth / scale`, clamped to [0, 1], where `scale` is the depth at which a worker counts
as saturated. Absolute, not min-max over the candidates: min-max turns a one-request
difference into the whole [0, 1] range, which let load outvote a large prefix hit on a
replica that was only marginally busier.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer
from tandem.router.workers import Worker


@register_scorer
class QueueScorer(Scorer):
    name = "queue"

    def __init__(self, scale: float = 8.0) -> None:
        self.scale = max(scale, 1.0)

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        return [max(0.0, 1.0 - w.queue_depth / self.scale) for w in workers]
