"""The router's spec (`RouterSpec`, `parse_router`): replicas, policy and scorer weights, P/D
thresholds, API keys, rate limits, the shared index's Redis, clients, pod settings and
guardrails (`spec_guardrails`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tandem.operator.fields import get, get_enum, get_int, get_num, get_obj, resources
from tandem.operator.model_uri import SpecError
from tandem.operator.pod_settings import PodSettings, parse_pod_settings
from tandem.operator.spec_gateway import (
    MODES,
    GatewaySpec,
    check_attached,
    check_gateway,
    parse_attach_to,
    parse_gateway,
)
from tandem.operator.spec_guardrails import GuardrailsSpec, parse_guardrails
from tandem.operator.spec_security import SecretKeyRef, peers, secret_key_ref


@dataclass(frozen=True)
class RateLimit:
    requests_per_second: float = 0.0  # 0 = unlimited
    burst_requests: float = 0.0
    tokens_per_minute: float = 0.0


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    policy: str = "cost"
    weights: dict[str, float] | None = None  # cache-aware scorer weights (CRD names)
    pd_threshold: int = 16
    pd_max_prefill_queue: int = 0  # conditional disaggregation bound; 0 = none
    pd_max_local_prefill: int = 1024  # longer uncached prompts never fall back; 0 = no cap
    pd_decision: str = "cost"  # cost | threshold (the router's --pd-decision)
    pd_itl_weight: float = 1.0  # the cost decision's weight of the decode streams' stall
    pd_stall_budget: float = 0.005  # ... and the share of decode steps local prefills may stall
    api_keys_secret: str | None = None
    api_keys_key: str = "api-keys"
    # keys that may load / unload LoRA adapters through the router (needs api_keys_secret)
    admin_api_keys_secret: str | None = None
    admin_api_keys_key: str = "admin-api-keys"
    rate_limit: RateLimit | None = None
    tenant_rate_limits: dict[str, RateLimit] = field(default_factory=dict)
    redis_url_secret: SecretKeyRef | None = None  # env TANDEM_REDIS_URL from this Secret key
    shared_index: bool = False
    # the chart's Redis through a per-InferenceService ACL user (`operator.redis_acl`)
    managed_redis: bool = False
    allowed_clients: tuple[dict[str, Any], ...] = ()  # NetworkPolicy peers; () = anyone
    service_type: str = "ClusterIP"
    resources: dict[str, dict[str, int | str]] = field(default_factory=dict)
    pod: PodSettings = PodSettings()
    mode: str = "router"  # or "gateway": the EPP of a Gateway API gateway (`spec_gateway`)
    gateway: GatewaySpec | None = None  # mode gateway only
    attach_to: str | None = None  # served by this other InferenceService's router / EPP
    flow_control: FlowControlSpec = field(default_factory=lambda: FlowControlSpec())
    guardrails: GuardrailsSpec | None = None  # router.yaml `guardrails`, checked by the router



# ---- flowControl: the router's queue in front of saturated (or not yet started) workers ----
BAND_KEY = re.compile(r"^(default|-?[0-9]{1,9})$")
MAX_BANDS = MAX_TENANT_WEIGHTS = 1000
DEFAULT_START_TIMEOUT_S = 300


@dataclass(frozen=True)
class BandLimit:
    max_requests: int | None = None  # None: the router's default
    max_bytes: int | None = None


@dataclass(frozen=True)
class FlowControlSpec:
    """`router.flowControl` -> router.yaml `flow_control` (`render.router`); None: unset (the
    router's default). `enabled` None: on exactly when a pool may scale to zero
    (`InferenceServiceSpec.flow_control_enabled`). `start_timeout_seconds`: how long the
    router holds a model's requests for its first worker (router.yaml `served_models`)."""

    enabled: bool | None = None
    fairness: str | None = None  # least-attained | round-robin
    ordering: str | None = None  # fcfs | edf
    ttl_seconds: float | None = None
    saturation_waiting: int | None = None
    saturation_kv: float | None = None
    bands: tuple[tuple[str, BandLimit], ...] = ()  # ("default" or a band number, bounds)
    tenant_weights: tuple[tuple[str, float], ...] = ()
    shared: bool | None = None
    start_timeout_seconds: int = DEFAULT_START_TIMEOUT_S


def parse_flow_control(d: dict[str, Any], w: str = "router.flowControl") -> FlowControlSpec:
    sat, bands = get_obj(d, "saturation", w), get_obj(d, "bands", w)
    weights = get_obj(d, "tenantWeights", w)
    if len(bands) > MAX_BANDS or len(weights) > MAX_TENANT_WEIGHTS:
        raise SpecError(f"{w}: at most {MAX_BANDS} bands and {MAX_TENANT_WEIGHTS} "
                        "tenantWeights")
    for k, v in bands.items():
        if not BAND_KEY.match(k):
            raise SpecError(f"{w}.bands.{k}: a band number (higher is served first) or "
                            "'default'")
        if not isinstance(v, dict) or not v or set(v) - {"maxRequests", "maxBytes"}:
            raise SpecError(f"{w}.bands.{k}: an object of maxRequests and/or maxBytes")
    for t in weights:
        if not 0 < (get_num(weights, t, None, f"{w}.tenantWeights") or 0) <= 1e6:
            raise SpecError(f"{w}.tenantWeights.{t}: a weight in (0, 1e6]")
    ttl = get_num(d, "ttlSeconds", None, w)
    kv = get_num(sat, "kv", None, f"{w}.saturation")
    if ttl is not None and not 0 < ttl <= 3600:
        raise SpecError(f"{w}.ttlSeconds {ttl:g}: in (0, 3600]")
    if kv is not None and not 0 < kv <= 1:
        raise SpecError(f"{w}.saturation.kv {kv:g}: a fraction in (0, 1]")
    return FlowControlSpec(
        enabled=get(d, "enabled", bool, None, w),
        fairness=None if "fairness" not in d else get_enum(
            d, "fairness", "", w, ("least-attained", "round-robin")),
        ordering=None if "ordering" not in d else get_enum(d, "ordering", "", w,
                                                           ("fcfs", "edf")),
        ttl_seconds=ttl,
        saturation_waiting=get_int(sat, "waiting", None, f"{w}.saturation", 1, 1 << 20),
        saturation_kv=kv,
        bands=tuple((k, BandLimit(
            get_int(v, "maxRequests", None, f"{w}.bands.{k}", 1, 1 << 24),
            get_int(v, "maxBytes", None, f"{w}.bands.{k}", 1, 1 << 40)))
            for k, v in sorted(bands.items())),
        tenant_weights=tuple(sorted((t, float(v)) for t, v in weights.items())),
        shared=get(d, "shared", bool, None, w),
        start_timeout_seconds=get_int(d, "startTimeoutSeconds", DEFAULT_START_TIMEOUT_S, w,
                                      1, 3600))


def _rate(d: dict, where: str) -> RateLimit:
    return RateLimit(get_num(d, "requestsPerSecond", 0.0, where) or 0.0,
                     get_num(d, "burstRequests", 0.0, where) or 0.0,
                     get_num(d, "tokensPerMinute", 0.0, where) or 0.0)


_WEIGHTS = {"prefix": 2.0, "queue": 1.0, "kvUsage": 0.5, "inflightTokens": 0.5,
            "cacheChurn": 1.0, "loraAffinity": 1.0, "cost": 0.0, "sessionAffinity": 1.0}


def _itl_weight(value: float | None) -> float:
    if value is None or not value <= 1000:  # NaN fails too
        raise SpecError(f"router.pdItlWeight: {value} is not in [0, 1000]")
    return value


def _stall_budget(value: float | None) -> float:
    if value is None or not value < 1:  # NaN fails too
        raise SpecError(f"router.pdStallBudget: {value} is not in [0, 1)")
    return value


def parse_router(d: dict) -> RouterSpec:
    """`spec.router` with the CRD's defaults; `SpecError` names the field."""
    w = "router"
    if "redisUrl" in d:  # removed: a URL with a password does not belong in the spec
        raise SpecError("router.redisUrl is no longer supported: put the URL in a Secret and "
                        "name it in router.redisUrlSecretRef {name, key}")
    weights = get(d, "weights", dict, None, w)
    rl = get_obj(d, "rateLimits", w)
    keys = get_obj(d, "apiKeysSecret", w)
    admin = get_obj(d, "adminApiKeysSecret", w)
    r = RouterSpec(
        replicas=get_int(d, "replicas", 1, w, 1, 100),
        policy=get_enum(d, "policy", "cost", w,
                     ("cost", "cache-aware", "least-loaded", "round-robin", "random")),
        weights=None if weights is None else {
            k: get_num(weights, k, v, "router.weights") for k, v in _WEIGHTS.items()},
        pd_threshold=get_int(d, "pdThreshold", 16, w, 0),
        pd_max_prefill_queue=get_int(d, "pdMaxPrefillQueue", 0, w, 0),
        pd_max_local_prefill=get_int(d, "pdMaxLocalPrefill", 1024, w, 0),
        pd_decision=get_enum(d, "pdDecision", "cost", w, ("threshold", "cost")),
        pd_itl_weight=_itl_weight(get_num(d, "pdItlWeight", 1.0, w)),
        pd_stall_budget=_stall_budget(get_num(d, "pdStallBudget", 0.005, w)),
        api_keys_secret=get(keys, "name", str, None, "router.apiKeysSecret"),
        api_keys_key=get(keys, "key", str, "api-keys", "router.apiKeysSecret"),
        admin_api_keys_secret=get(admin, "name", str, None, "router.adminApiKeysSecret"),
        admin_api_keys_key=get(admin, "key", str, "admin-api-keys",
                               "router.adminApiKeysSecret"),
        rate_limit=_rate(rl["default"], "router.rateLimits.default") if "default" in rl
        else None,
        tenant_rate_limits={t: _rate(v, f"router.rateLimits.tenants.{t}")
                            for t, v in get_obj(rl, "tenants", "router.rateLimits").items()},
        redis_url_secret=secret_key_ref(get(d, "redisUrlSecretRef", dict, None, w),
                                        "router.redisUrlSecretRef", "url"),
        shared_index=get(d, "sharedIndex", bool, False, w),
        managed_redis=get(d, "managedRedis", bool, False, w),
        service_type=get_enum(d, "serviceType", "ClusterIP", w,
                           ("ClusterIP", "NodePort", "LoadBalancer")),
        allowed_clients=peers(d.get("allowedClients"), "router.allowedClients"),
        resources=resources(get_obj(d, "resources", w), "router.resources"),
        pod=parse_pod_settings(d, w, scheduling=True),
        mode=(mode := get_enum(d, "mode", "router", w, MODES)),
        gateway=parse_gateway(d, mode),
        attach_to=parse_attach_to(d),
        flow_control=parse_flow_control(get_obj(d, "flowControl", w)),
        guardrails=parse_guardrails(d.get("guardrails"), "router.guardrails"))
    if r.flow_control.shared and not (r.redis_url_secret or r.managed_redis):
        raise SpecError("router.flowControl.shared needs router.redisUrlSecretRef or "
                        "router.managedRedis (the fleet's queue lives in Redis)")
    if weights is not None and set(weights) - set(_WEIGHTS):
        raise SpecError(f"router.weights: unknown scorers {sorted(set(weights) - set(_WEIGHTS))}")
    if r.shared_index and not (r.redis_url_secret or r.managed_redis):
        raise SpecError("router.sharedIndex needs router.redisUrlSecretRef or "
                        "router.managedRedis")
    if r.managed_redis and r.redis_url_secret:
        raise SpecError("router.managedRedis and router.redisUrlSecretRef are exclusive")
    if keys and not r.api_keys_secret:
        raise SpecError("router.apiKeysSecret.name is required")
    if admin and not r.admin_api_keys_secret:
        raise SpecError("router.adminApiKeysSecret.name is required")
    if r.admin_api_keys_secret and not r.api_keys_secret:
        raise SpecError("router.adminApiKeysSecret needs router.apiKeysSecret (without API "
                        "keys the admin endpoints are open)")
    check_attached(r, RouterSpec(), d)
    check_gateway(r)
    return r
