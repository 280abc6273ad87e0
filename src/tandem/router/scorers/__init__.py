"""Routing scorers and filters; importing this package registers every built-in one."""

from tandem.router.scorers import (  # noqa: F401
    churn,
    cost,
    filters,
    inflight,
    kv_usage,
    lora,
    prefix,
    queue,
    session,
)
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
