"""Candidate filters: model, role, health (readiness + circuit breaker)."""

from __future__ import annotations

from tandem.router.scorers.base import Filter, RoutingContext, register_filter
from tandem.router.workers import Worker

# which worker roles can serve a request that needs `role`
SERVES = {"decode": ("both", "decode"), "prefill": ("prefill",), "both": ("both",)}


@register_filter
class ModelFilter(Filter):
    name = "model"

    def keep(self, ctx: RoutingContext, worker: Worker) -> bool:
        return worker.serves(ctx.model)  # the base model, or one of its loaded adapters


@register_filter
class RoleFilter(Filter):
    name = "role"

    def keep(self, ctx: RoutingContext, worker: Worker) -> bool:
        return worker.role in SERVES.get(ctx.role, (ctx.role,))


@register_filter
class HealthFilter(Filter):
    name = "health"

    def keep(self, ctx: RoutingContext, worker: Worker) -> bool:
        return worker.routable(ctx.now)
