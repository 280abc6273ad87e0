"""Flow control: a fair queue in front of saturated workers (`base` holds the contract).

`make_flow_control` builds it from `settings.FlowSettings`: `local.QueueFlowControl`, its
fairness state shared by every router replica through Redis (`shared.RedisLedger`) when
`shared` is set and the router has a Redis URL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.router.flowcontrol.base import Capacity, FlowControl
from tandem.router.flowcontrol.settings import FlowSettings

if TYPE_CHECKING:
    from tandem.router.metrics import RouterMetrics


def make_flow_control(settings: FlowSettings, capacity: Capacity,
                      metrics: RouterMetrics | None = None, redis_url: str | None = None,
                      prefix: str = "tandem:") -> FlowControl | None:
    """None when flow control is off; ValueError when `shared` has no Redis URL."""
    from tandem.router.flowcontrol.local import QueueFlowControl

    if not settings.enabled:
        return None
    shared = None
    if settings.shared:
        if not redis_url:
            raise ValueError("flow_control.shared needs the router's Redis (--redis or "
                             "router.yaml redis)")
        from tandem.router.flowcontrol.shared import RedisLedger

        shared = RedisLedger(redis_url, prefix=prefix, metrics=metrics)
    return QueueFlowControl(settings, capacity, metrics, shared)
