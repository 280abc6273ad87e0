"""In-flight-token scorer: fewer prompt + generated tokens of running requests is better
(min-max over candidates)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.scorers.base import RoutingContext, Scorer, inverse_minmax, register_scorer
from tandem.router.workers import Worker


@register_scorer
class InFlightTokensScorer(Scorer):
    name = "inflight_tokens"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        return inverse_minmax([w.load.in_flight_tokens for w in workers])
