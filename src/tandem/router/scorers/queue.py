"""Queue-depth scorer: fewer running + waiting requests is better (min-max over candidates)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.scorers.base import RoutingContext, Scorer, inverse_minmax, register_scorer
from tandem.router.workers import Worker


@register_scorer
class QueueScorer(Scorer):
    name = "queue"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        return inverse_minmax([w.queue_depth for w in workers])
