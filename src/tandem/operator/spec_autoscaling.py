"""A pool's `autoscaling` (`AutoscalingSpec`, `parse_autoscaling`) and the signals it scales
on (`SIGNALS`: the worker's Prometheus metric and the HPA adapter's per-pod name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator.fields import get_enum, get_int, get_num
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


def signal_for(signal: str, role: str) -> Signal:
    return _PROMPT_TOKENS if signal == "tokensPerSecond" and role == "prefill" else SIGNALS[signal]


@dataclass(frozen=True)
class AutoscalingSpec:
    max_replicas: int
    target: float
    mode: str = "operator"  # "operator" (the operator's timer) | "hpa"
    min_replicas: int = 1
    signal: str = "waitingRequests"
    scale_down_stabilization_seconds: int = 300



def parse_autoscaling(d: dict[str, Any] | None, where: str) -> AutoscalingSpec | None:
    """`where.autoscaling` (None: a fixed replica count); `SpecError` names the field."""
    if d is None:
        return None
    w = f"{where}.autoscaling"
    for key in ("maxReplicas", "target"):
        if key not in d:
            raise SpecError(f"{w}.{key} is required")
    a = AutoscalingSpec(
        max_replicas=get_int(d, "maxReplicas", None, w, 1, 1000),
        target=get_num(d, "target", None, w) or 0.0,
        mode=get_enum(d, "mode", "operator", w, ("operator", "hpa")),
        min_replicas=get_int(d, "minReplicas", 1, w, 1, 1000),
        signal=get_enum(d, "signal", "waitingRequests", w, tuple(SIGNALS)),
        scale_down_stabilization_seconds=get_int(d, "scaleDownStabilizationSeconds", 300, w,
                                              0, 3600))
    if a.min_replicas > a.max_replicas:
        raise SpecError(f"{w}: minReplicas {a.min_replicas} exceeds maxReplicas "
                        f"{a.max_replicas}")
    if a.target <= 0 or (a.signal == "kvUtilization" and a.target > 1):
        raise SpecError(f"{w}.target {a.target}: must be > 0 (a fraction in (0, 1] for "
                        "kvUtilization)")
    return a
