"""Cache-churn scorer: less new text routed to a worker lately is better.

`1 - min(1, churn / capacity)`, where churn is `ctx.churn_tokens[worker]` (the decayed sum of
uncached prompt tokens the router sent it, from `tandem.router.churn.ChurnTracker`) and
capacity its KV cache in tokens (`num_total_blocks x block size`). A worker that has not
reported its capacity yet scores 1, as in `inflight_tokens`.

What it buys: a cold request (no prefix hit anywhere) at low load, where the load scorers
all tie, goes to the worker that has absorbed the least new text, so distinct prefix groups
spread evenly over the workers instead of by coin flip (vllm-router's "smallest radix tree").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer, share_free
from tandem.router.scorers.columns import Columns
from tandem.router.workers import Worker


@register_scorer
class CacheChurnScorer(Scorer):
    name = "cache_churn"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        return [share_free(ctx.churn_tokens.get(w.id, 0.0), w) for w in workers]

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray:
        return cols.share_free(cols.churn_tokens)
