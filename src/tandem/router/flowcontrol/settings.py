"""Flow control's settings, from router.yaml `flow_control` and `served_models`
(`config.py` checks every key first) or `--flow-control` (all defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_REQUESTS = 1024  # queued per band
DEFAULT_MAX_BYTES = 64 << 20  # request bodies queued per band
DEFAULT_TTL_S = 30.0
DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_SATURATION_WAITING = 4
DEFAULT_SATURATION_KV = 0.9


@dataclass(frozen=True)
class BandLimits:
    """What one priority band may hold queued (on this replica, or fleet-wide when shared)."""

    max_requests: int = DEFAULT_MAX_REQUESTS
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class FlowSettings:
    """`fairness`: a `policies.FAIRNESS` name; `ordering`: a `policies.ORDERINGS` name;
    `ttl_s`: the longest a request waits queued (429 "ttl"); `saturation_*`: a worker is
    saturated at >= this many waiting requests or this KV use; `bands`: bounds per band
    number (`default` for the others); `tenant_weights`: fairness weights (default 1);
    `shared`: one fleet-wide queue state through the router's Redis; `served_models`: model
    -> seconds its requests are held for a first worker (scale from zero)."""

    enabled: bool = False
    fairness: str = "least-attained"
    ordering: str = "fcfs"
    ttl_s: float = DEFAULT_TTL_S
    saturation_waiting: int = DEFAULT_SATURATION_WAITING
    saturation_kv: float = DEFAULT_SATURATION_KV
    default_band: BandLimits = field(default_factory=BandLimits)
    bands: Mapping[int, BandLimits] = field(default_factory=dict)
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    shared: bool = False
    served_models: Mapping[str, float] = field(default_factory=dict)

    def limits(self, band: int) -> BandLimits:
        return self.bands.get(band, self.default_band)

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    @classmethod
    def from_config(cls, flow: Mapping[str, Any] | None, served: list[Mapping[str, Any]] | None,
                    flag: bool = False) -> FlowSettings:
        """From router.yaml's checked `flow_control` and `served_models` values; `flag`:
        `--flow-control` was given. `served_models` turns flow control on (its queue holds
        their requests); ValueError when `enabled: false` says otherwise."""
        flow = dict(flow or {})
        served_models = {m["name"]: float(m.get("start_timeout_s", DEFAULT_START_TIMEOUT_S))
                         for m in served or []}
        if len(served_models) != len(served or []):
            raise ValueError("served_models: a model is listed twice")
        if served_models and flow.get("enabled") is False and not flag:
            raise ValueError("served_models needs flow control (its queue holds their "
                             "requests while workers start): drop flow_control.enabled: false")
        enabled = flag or bool(flow.get("enabled")) or bool(served_models)
        sat = flow.get("saturation") or {}
        bands = dict(flow.get("bands") or {})
        default = _band(bands.pop("default", None))
        return cls(enabled=enabled, fairness=flow.get("fairness", "least-attained"),
                   ordering=flow.get("ordering", "fcfs"),
                   ttl_s=float(flow.get("ttl_s", DEFAULT_TTL_S)),
                   saturation_waiting=int(sat.get("waiting", DEFAULT_SATURATION_WAITING)),
                   saturation_kv=float(sat.get("kv", DEFAULT_SATURATION_KV)),
                   default_band=default,
                   bands={int(b): _band(v, default) for b, v in bands.items()},
                   tenant_weights={t: float(w) for t, w in
                                   (flow.get("tenant_weights") or {}).items()},
                   shared=bool(flow.get("shared", False)), served_models=served_models)


def _band(value: Mapping[str, Any] | None, base: BandLimits | None = None) -> BandLimits:
    base = base or BandLimits()
    value = value or {}
    return BandLimits(int(value.get("max_requests", base.max_requests)),
                      int(value.get("max_bytes", base.max_bytes)))
