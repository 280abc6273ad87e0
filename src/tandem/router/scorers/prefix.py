"""Prefix-hit scorer: the share of the prompt a worker already holds in its KV cache
(leading full blocks only), host/disk tier blocks and a peer pull counting for the prefill
time they save (`RoutingContext.credit_tokens`, `kvcredit`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer
from tandem.router.scorers.columns import Columns, pmin
from tandem.router.workers import Worker


@register_scorer
class PrefixScorer(Scorer):
    name = "prefix"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        if ctx.prompt_tokens <= 0:
            return [0.0] * len(workers)
        if ctx.credit_tokens:
            credit = ctx.credit_tokens.get
            return [min((ctx.matched_tokens.get(w.id, 0) + credit(w.id, 0.0))
                        / ctx.prompt_tokens, 1.0) for w in workers]
        return [min(ctx.matched_tokens.get(w.id, 0) / ctx.prompt_tokens, 1.0) for w in workers]

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray:
        if ctx.prompt_tokens <= 0:
            return np.zeros(cols.n)
        matched = cols.matched_tokens
        if ctx.credit_tokens:
            credit = ctx.credit_tokens.get
            matched = matched + np.array([credit(w.id, 0.0) for w in cols.workers], np.float64)
        return pmin(matched / ctx.prompt_tokens, 1.0)
