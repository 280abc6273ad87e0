"""In-flight-token scorer: fewer prompt + generated tokens of running requests is better,
as a share of the worker's KV capacity (`1 - tokens / (blocks x block size)`, clamped).
A worker that has not reported its capacity yet scores 1 (absolute scale: see queue.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer, share_free
from tandem.router.scorers.columns import Columns
from tandem.router.workers import Worker


@register_scorer
class InFlightTokensScorer(Scorer):
    name = "inflight_tokens"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        return [share_free(w.load.in_flight_tokens, w) for w in workers]

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray:
        return cols.share_free(cols.in_flight_tokens)
