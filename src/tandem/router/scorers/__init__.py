"""Routing scorers and filters; importing this package registers every built-in one."""

from tandem.router.scorers import churn, filters, inflight, kv_usage, prefix, queue  # noqa: F401
from tandem.router.scorers.base import (
    FILTERS,
    SCORERS,
    Filter,
    LoadLimits,
    RoutingContext,
    Scorer,
    register_filter,
    register_scorer,
)

__all__ = ["FILTERS", "SCORERS", "Filter", "LoadLimits", "RoutingContext", "Scorer",
           "register_filter", "register_scorer"]
