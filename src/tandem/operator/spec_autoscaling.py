"""A pool's `autoscaling` (`AutoscalingSpec`, `parse_autoscaling`) and the signals it scales
on (`SIGNALS`: the worker's Prometheus metric and the HPA adapter's per-pod name).

Modes: `operator` (the operator's own timer: the workers' metrics, or the router's
`GET /scaling` answer for the pool's role with `signal: demand`), `hpa` (a
HorizontalPodAutoscaler on a per-pod custom metric) and `keda` (a KEDA ScaledObject on the
router's `/scaling`, `KedaSpec`). `operator` and `keda` may scale a pool to zero
(`minReplicas: 0`, or `keda.idleReplicas: 0`), on `signal: demand` (with no worker there is
no per-pod metric, while the router still counts the requests it holds); `hpa` may not (an
HPA cannot scale from zero without an alpha feature gate). `signal` defaults to `demand`
(the router's queued + running + waiting requests) in keda mode and with minReplicas 0,
and to `waitingRequests` otherwise."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tandem.operator.fields import get, get_enum, get_int, get_num
from tandem.operator.model_uri import SpecError


@dataclass(frozen=True)
class Signal:
    """An autoscaling signal: the worker's Prometheus metric and the HPA adapter's name."""

    worker_metric: str  # as on the worker's /metrics; a `_total` counter when `rate`
    hpa_metric: str  # the per-pod metric a metrics adapter must expose for `mode: hpa`
    rate: bool = False  # per second, from a counter


# tokens/s counts prompt tokens on a prefill pool (see `signal_for`)
SIGNALS = {
    "waitingRequests": Signal("vllm:num_requests_waiting", "vllm_num_requests_waiting"),
    "kvUtilization": Signal("vllm:kv_cache_usage_perc", "vllm_kv_cache_usage_perc"),
    "tokensPerSecond": Signal("vllm:generation_tokens_total",
                              "vllm_generation_tokens_per_second", rate=True),
}
_PROMPT_TOKENS = Signal("vllm:prompt_tokens_total", "vllm_prompt_tokens_per_second", rate=True)
DEMAND = "demand"  # the router's `/scaling` demand for the pool's role (operator, keda)
MODES = ("operator", "hpa", "keda")
BAND = re.compile(r"^-?[0-9]{1,9}$")  # a flow-control priority band number, as a key
MAX_BAND_TARGETS = 8
# keda mode: the `/scaling` field each signal reads (tokensPerSecond: not served there)
KEDA_VALUES = {DEMAND: "demand", "waitingRequests": "waiting",
               "kvUtilization": "kv_utilization"}


def signal_for(signal: str, role: str) -> Signal:
    return _PROMPT_TOKENS if signal == "tokensPerSecond" and role == "prefill" else SIGNALS[signal]


@dataclass(frozen=True)
class KedaSpec:
    """`autoscaling.keda`: the ScaledObject's timing and extra trigger."""

    polling_interval_seconds: int = 15  # how often KEDA reads the router's /scaling
    cooldown_period_seconds: int = 300  # idle this long (no active trigger) before 0 replicas
    idle_replicas: int | None = None  # KEDA's idleReplicaCount (0 only): idle -> 0, else >= min
    kv_utilization_target: float | None = None  # an extra trigger: the role's mean KV use
    # an extra trigger per band: (band number, queued requests of that band per replica)
    band_targets: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class AutoscalingSpec:
    max_replicas: int
    target: float
    mode: str = "operator"  # "operator" (the operator's timer) | "hpa" | "keda"
    min_replicas: int = 1
    signal: str = "waitingRequests"
    scale_down_stabilization_seconds: int = 300
    keda: KedaSpec = KedaSpec()

    @property
    def scales_to_zero(self) -> bool:
        """The pool may run no worker (operator, keda): the router must hold its requests."""
        return self.min_replicas == 0 or self.keda.idle_replicas == 0



def parse_autoscaling(d: dict[str, Any] | None, where: str) -> AutoscalingSpec | None:
    """`where.autoscaling` (None: a fixed replica count); `SpecError` names the field."""
    if d is None:
        return None
    w = f"{where}.autoscaling"
    for key in ("maxReplicas", "target"):
        if key not in d:
            raise SpecError(f"{w}.{key} is required")
    mode = get_enum(d, "mode", "operator", w, MODES)
    keda = get(d, "keda", dict, None, w)
    if keda is not None and mode != "keda":
        raise SpecError(f"{w}.keda needs {w}.mode keda")
    a = AutoscalingSpec(
        max_replicas=get_int(d, "maxReplicas", None, w, 1, 1000),
        target=get_num(d, "target", None, w) or 0.0,
        mode=mode,
        min_replicas=get_int(d, "minReplicas", 1, w, 0, 1000),
        signal=get_enum(d, "signal", DEMAND if mode == "keda" or (
            mode == "operator" and d.get("minReplicas") == 0) else "waitingRequests", w,
            (*SIGNALS, DEMAND)),
        scale_down_stabilization_seconds=get_int(d, "scaleDownStabilizationSeconds", 300, w,
                                                 0, 3600),
        keda=_keda(keda or {}, f"{w}.keda"))
    if a.min_replicas == 0 and mode == "hpa":
        raise SpecError(f"{w}.minReplicas 0 (scale to zero) needs {w}.mode operator or keda: "
                        "an HPA cannot scale from zero")
    if a.signal == DEMAND and mode == "hpa":
        raise SpecError(f"{w}.signal demand (the router's queued, running and waiting "
                        f"requests) needs {w}.mode operator or keda")
    if mode == "keda" and a.signal not in KEDA_VALUES:
        raise SpecError(f"{w}.signal {a.signal}: with mode keda one of "
                        f"{', '.join(KEDA_VALUES)} (what the router's /scaling serves)")
    if a.scales_to_zero and a.signal != DEMAND:
        raise SpecError(f"{w}: scaling to zero (minReplicas or keda.idleReplicas 0) needs "
                        "signal demand: with no worker up only the router's queue shows load")
    if a.keda.idle_replicas is not None and a.min_replicas < 1:
        raise SpecError(f"{w}.keda.idleReplicas needs {w}.minReplicas >= 1 (minReplicas 0 "
                        "already scales to zero)")
    if a.min_replicas > a.max_replicas:
        raise SpecError(f"{w}: minReplicas {a.min_replicas} exceeds maxReplicas "
                        f"{a.max_replicas}")
    if a.target <= 0 or (a.signal == "kvUtilization" and a.target > 1):
        raise SpecError(f"{w}.target {a.target}: must be > 0 (a fraction in (0, 1] for "
                        "kvUtilization)")
    return a


def _keda(d: dict[str, Any], w: str) -> KedaSpec:
    kv = get_num(d, "kvUtilizationTarget", None, w)
    if kv is not None and not 0 < kv <= 1:
        raise SpecError(f"{w}.kvUtilizationTarget {kv}: a fraction in (0, 1]")
    bands = get(d, "bandTargets", dict, {}, w)
    if len(bands) > MAX_BAND_TARGETS:
        raise SpecError(f"{w}.bandTargets: at most {MAX_BAND_TARGETS} bands")
    for band in bands:
        if not BAND.match(band):
            raise SpecError(f"{w}.bandTargets.{band}: a band number (flow control's priority "
                            "band, higher is served first)")
        if (get_num(bands, band, None, f"{w}.bandTargets") or 0) <= 0:
            raise SpecError(f"{w}.bandTargets.{band}: a target > 0 (queued requests of the "
                            "band per replica)")
    return KedaSpec(
        band_targets=tuple(sorted((b, float(v)) for b, v in bands.items())),
        polling_interval_seconds=get_int(d, "pollingIntervalSeconds", 15, w, 1, 3600),
        cooldown_period_seconds=get_int(d, "cooldownPeriodSeconds", 300, w, 0, 86400),
        idle_replicas=get_int(d, "idleReplicas", None, w, 0, 0),
        kv_utilization_target=kv)
