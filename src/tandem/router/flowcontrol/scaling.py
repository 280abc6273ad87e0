"""`GET /scaling?model=NAME&role=decode|prefill`: the demand an autoscaler (KEDA's
`metrics-api` trigger) scales one pool of a model on.

    {"model": ..., "role": ..., "demand": float, "queued": int, "running": int,
     "waiting": int, "kv_utilization": float, "ready_workers": int,
     "queued_by_band": {"<band>": int}}

`queued`: the model's requests waiting in flow control (each needs a prefill, so it counts
for both roles); `queued_by_band`: the same per priority band (flow control's numbers as
string keys): every band router.yaml `flow_control.bands` names, 0 when empty (a KEDA
`metrics-api` trigger errors on a missing key), and any other band holding a request; empty
with flow control off. Both are this replica's queue (with `shared: true` as well).
`running` / `waiting`: the sums over the role's workers (`decode`: decode and aggregated
workers; `prefill`: prefill workers) of their reported load, `running` at
least this router's own open requests on a worker beyond its reported waiting ones (the
report lags); `demand` = queued + running + waiting; `kv_utilization`: the mean KV use of
its ready workers (0 without any); `ready_workers`: its routable workers. 400 for a missing
model, a role other than these two or another query parameter; 404 for a model the router
does not know (no worker has served it and it is not in `served_models`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tandem.protocol.web import APIError

if TYPE_CHECKING:
    from tandem.router.routes import RouterApp

ROLES = ("decode", "prefill")
PARAMS = frozenset({"model", "role"})


def scaling_signal(ra: RouterApp, model: str | None, role: str | None,
                   params: set[str] | None = None) -> dict:
    """The JSON body of `/scaling` (module doc); `params`: the query's parameter names."""
    extra = sorted((params or set()) - PARAMS)
    if extra:
        raise APIError(400, f"unknown query parameter {extra[0]!r} (known: model, role)",
                       extra[0])
    if not model:
        raise APIError(400, "model: required (the model whose pool scales)", "model")
    if role not in ROLES:
        raise APIError(400, f"role: one of {', '.join(ROLES)}, not {role!r}", "role")
    router = ra.router
    workers = list(router.workers.values())
    if not (model in router.settings.served_models or model in ra.startup.seen
            or any(w.serves(model) for w in workers)):
        raise APIError(404, f"model {model!r} is not known here", "model")
    flow = ra.settings.flow_control
    queued = flow.queued(model) if flow is not None else 0
    bands = flow.queued_by_band(model) if flow is not None else {}
    pool = [w for w in workers if w.serves(model)
            and (w.role == "prefill") == (role == "prefill")]
    now = time.monotonic()
    running = sum(max(w.load.num_running, w.local_in_flight - w.load.num_waiting)
                  for w in pool)
    waiting = sum(w.load.num_waiting for w in pool)
    ready = [w for w in pool if w.routable(now)]
    kv = sum(w.load.kv_cache_usage for w in ready) / len(ready) if ready else 0.0
    return {"model": model, "role": role, "demand": float(queued + running + waiting),
            "queued": queued, "running": running, "waiting": waiting,
            "kv_utilization": kv, "ready_workers": len(ready),
            "queued_by_band": {str(b): n for b, n in sorted(bands.items())}}
