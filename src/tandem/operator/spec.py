"""An InferenceService's spec as typed, frozen dataclasses (`parse_spec`).

Defaults are those of `crds/inferenceservice.yaml` (a test holds the two together), so a spec
that skipped the API server's defaulting parses the same. Checks the schema cannot express
raise `SpecError`; the CEL rules of the CRD are repeated here, for clusters or callers that
never ran them. Field names follow the CRD (camelCase) in messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tandem.operator.fields import (
    GPU,
    get,
    get_enum,
    get_int,
    get_num,
    get_obj,
    resources,
)
from tandem.operator.model_uri import ModelSource, SpecError, parse_model_uri
from tandem.operator.pod_settings import PodSettings, parse_pod_settings
from tandem.operator.spec_engine import (
    EngineArgs,
    check_pool_device,
    gpu_count,
    parse_engine,
    pool_device,
)
from tandem.operator.spec_lora import LoRASpec, check_served_name, parse_lora
from tandem.operator.spec_security import (
    IssuerRef,
    SecretKeyRef,
    SecuritySpec,
    issuer_ref,
    parse_security,
    peers,
    prometheus_peer,
    secret_key_ref,
)

__all__ = ["SpecError", "ModelSource", "InferenceServiceSpec", "parse_spec", "check_name",
           "SIGNALS", "MAX_NAME"]

DEFAULT_HF_STORAGE = "50Gi"  # hf:// without model.storage (CRD: the field's description)
_STORAGE = re.compile(r"^[1-9][0-9]*(Ki|Mi|Gi|Ti)$")
MAX_NAME = 52  # the longest child Service name, NAME-prefill, stays a 63-character label
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


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
class ModelSpec:
    uri: str
    source: ModelSource
    sha256: str | None = None
    name: str | None = None  # served name; default `source.default_name`
    dtype: str | None = None  # None: the worker's default
    hf_token: SecretKeyRef | None = None  # HF_TOKEN of the fetch init containers
    storage: str | None = None  # hf:// download size (emptyDir + ephemeral-storage)
    cache_pvc: str | None = None  # hf:// shared ReadWriteMany cache, filled once

    @property
    def served_name(self) -> str:
        return self.name or self.source.default_name

    @property
    def download_storage(self) -> str:
        """The emptyDir size of an hf:// download without a cache."""
        return self.storage or DEFAULT_HF_STORAGE


@dataclass(frozen=True)
class AutoscalingSpec:
    max_replicas: int
    target: float
    mode: str = "operator"  # "operator" (the operator's timer) | "hpa"
    min_replicas: int = 1
    signal: str = "waitingRequests"
    scale_down_stabilization_seconds: int = 300


@dataclass(frozen=True)
class PoolSpec:
    replicas: int
    resources: dict[str, dict[str, int | str]] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    engine: EngineArgs = EngineArgs()
    autoscaling: AutoscalingSpec | None = None
    pod: PodSettings = PodSettings()

    @property
    def gpus(self) -> int:
        return int((self.resources.get("limits") or {}).get(GPU, 0))

    @property
    def device(self) -> str:
        """cuda or cpu: the workers' `--device`."""
        return pool_device(self.engine, self.gpus)


@dataclass(frozen=True)
class RateLimit:
    requests_per_second: float = 0.0  # 0 = unlimited
    burst_requests: float = 0.0
    tokens_per_minute: float = 0.0


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    policy: str = "cache-aware"
    weights: dict[str, float] | None = None  # cache-aware scorer weights (CRD names)
    pd_threshold: int = 16
    pd_max_prefill_queue: int = 0  # conditional disaggregation bound; 0 = none
    pd_max_local_prefill: int = 1024  # longer uncached prompts never fall back; 0 = no cap
    api_keys_secret: str | None = None
    api_keys_key: str = "api-keys"
    # keys that may load / unload LoRA adapters through the router (needs api_keys_secret)
    admin_api_keys_secret: str | None = None
    admin_api_keys_key: str = "admin-api-keys"
    rate_limit: RateLimit | None = None
    tenant_rate_limits: dict[str, RateLimit] = field(default_factory=dict)
    redis_url_secret: SecretKeyRef | None = None  # env TANDEM_REDIS_URL from this Secret key
    shared_index: bool = False
    allowed_clients: tuple[dict[str, Any], ...] = ()  # NetworkPolicy peers; () = anyone
    service_type: str = "ClusterIP"
    resources: dict[str, dict[str, int | str]] = field(default_factory=dict)
    pod: PodSettings = PodSettings()


@dataclass(frozen=True)
class KVTransferSpec:
    backend: str = "grpc"
    policy: str = "recompute"
    timeout_seconds: float = 30.0
    tls_secret: str | None = None
    stream_layers: bool = False  # prefill side: send each layer as soon as it is computed
    tls_issuer: IssuerRef | None = None  # cert-manager issues tls_secret


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    router: RouterSpec
    prefill: PoolSpec
    decode: PoolSpec  # the aggregated pool (role both) when prefill.replicas is 0
    kv_transfer: KVTransferSpec = KVTransferSpec()
    service_monitor: bool = False
    scrape_interval: str = "30s"
    image: str | None = None  # None: the operator's default image
    security: SecuritySpec = SecuritySpec()
    prometheus: dict[str, Any] | None = None  # a NetworkPolicy peer admitted to /metrics
    lora: LoRASpec | None = None  # adapters every pool serves; None: no LoRA

    @property
    def disaggregated(self) -> bool:
        return self.prefill.replicas > 0


def check_name(name: str) -> None:
    """An InferenceService name whose children's names all stay valid."""
    if not _DNS_LABEL.match(name) or len(name) > MAX_NAME:
        raise SpecError(f"name {name!r}: a DNS label of at most {MAX_NAME} characters "
                        "(children are named NAME-prefill, NAME-decode, NAME-router)")


def _autoscaling(d: dict[str, Any] | None, where: str) -> AutoscalingSpec | None:
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


def _pool(d: dict, where: str, replicas: int) -> PoolSpec:
    tolerations = get(d, "tolerations", list, [], where)
    res = resources(get_obj(d, "resources", where), f"{where}.resources")
    engine = parse_engine(get_obj(d, "engine", where), where)
    check_pool_device(engine, gpu_count(res, where), where)
    return PoolSpec(
        replicas=get_int(d, "replicas", replicas, where, 0, 1000),
        resources=res,
        node_selector=dict(get_obj(d, "nodeSelector", where)),
        tolerations=tuple(dict(t) for t in tolerations),
        engine=engine,
        autoscaling=_autoscaling(get(d, "autoscaling", dict, None, where), where),
        pod=parse_pod_settings(d, where, scheduling=False))


def _rate(d: dict, where: str) -> RateLimit:
    return RateLimit(get_num(d, "requestsPerSecond", 0.0, where) or 0.0,
                     get_num(d, "burstRequests", 0.0, where) or 0.0,
                     get_num(d, "tokensPerMinute", 0.0, where) or 0.0)


_WEIGHTS = {"prefix": 2.0, "queue": 1.0, "kvUsage": 0.5, "inflightTokens": 0.5,
            "cacheChurn": 1.0, "loraAffinity": 1.0}


def _router(d: dict) -> RouterSpec:
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
        policy=get_enum(d, "policy", "cache-aware", w,
                     ("cache-aware", "least-loaded", "round-robin", "random")),
        weights=None if weights is None else {
            k: get_num(weights, k, v, "router.weights") for k, v in _WEIGHTS.items()},
        pd_threshold=get_int(d, "pdThreshold", 16, w, 0),
        pd_max_prefill_queue=get_int(d, "pdMaxPrefillQueue", 0, w, 0),
        pd_max_local_prefill=get_int(d, "pdMaxLocalPrefill", 1024, w, 0),
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
        service_type=get_enum(d, "serviceType", "ClusterIP", w,
                           ("ClusterIP", "NodePort", "LoadBalancer")),
        allowed_clients=peers(d.get("allowedClients"), "router.allowedClients"),
        resources=resources(get_obj(d, "resources", w), "router.resources"),
        pod=parse_pod_settings(d, w, scheduling=True))
    if weights is not None and set(weights) - set(_WEIGHTS):
        raise SpecError(f"router.weights: unknown scorers {sorted(set(weights) - set(_WEIGHTS))}")
    if r.shared_index and not r.redis_url_secret:
        raise SpecError("router.sharedIndex needs router.redisUrlSecretRef")
    if keys and not r.api_keys_secret:
        raise SpecError("router.apiKeysSecret.name is required")
    if admin and not r.admin_api_keys_secret:
        raise SpecError("router.adminApiKeysSecret.name is required")
    if r.admin_api_keys_secret and not r.api_keys_secret:
        raise SpecError("router.adminApiKeysSecret needs router.apiKeysSecret (without API "
                        "keys the admin endpoints are open)")
    return r


def _delivery(m: dict) -> tuple[SecretKeyRef | None, str | None, str | None]:
    """model.hfTokenSecretRef, model.storage and model.cache.pvc (hf:// only)."""
    token = secret_key_ref(get(m, "hfTokenSecretRef", dict, None, "model"),
                           "model.hfTokenSecretRef", "token")
    storage = get(m, "storage", str, None, "model")
    if storage is not None and not _STORAGE.match(storage):
        raise SpecError(f"model.storage {storage!r}: a size like 20Gi (Ki, Mi, Gi or Ti)")
    cache = get_obj(m, "cache", "model")
    pvc = get(cache, "pvc", str, None, "model.cache")
    if cache and not pvc:
        raise SpecError("model.cache.pvc is required")
    if pvc is not None and (len(pvc) > 253 or not re.fullmatch(
            r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?", pvc)):
        raise SpecError(f"model.cache.pvc {pvc!r}: not a PersistentVolumeClaim name")
    if (token or storage or pvc) and not m.get("uri", "").startswith("hf://"):
        raise SpecError("model.hfTokenSecretRef, model.storage and model.cache are for "
                        "hf:// models only")
    if storage and pvc:
        raise SpecError("model.storage sizes the per-pod download; with model.cache the "
                        "model lives on the cache PVC (size that instead)")
    return token, storage, pvc


def parse_spec(spec: dict[str, Any]) -> InferenceServiceSpec:
    """The typed spec, defaults applied; `SpecError` names the first problem found."""
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise SpecError("spec.model is required")
    m = spec["model"]
    uri = get(m, "uri", str, None, "model")
    if not uri:
        raise SpecError("model.uri is required")
    sha = get(m, "sha256", str, None, "model")
    if sha is not None and not re.fullmatch(r"[a-f0-9]{64}", sha):
        raise SpecError(f"model.sha256 {sha!r}: 64 lowercase hex digits")
    model = ModelSpec(uri, parse_model_uri(uri), sha, get(m, "name", str, None, "model"),
                      get(m, "dtype", str, None, "model"), *_delivery(m))
    if model.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
        raise SpecError(f"model.dtype {model.dtype!r}: auto, float32, bfloat16 or float16")
    kv, mon = get_obj(spec, "kvTransfer", "spec"), get_obj(spec, "monitoring", "spec")
    out = InferenceServiceSpec(
        model=model, router=_router(get_obj(spec, "router", "spec")),
        prefill=_pool(get_obj(spec, "prefill", "spec"), "prefill", 0),
        decode=_pool(get_obj(spec, "decode", "spec"), "decode", 1),
        kv_transfer=KVTransferSpec(
            backend=get_enum(kv, "backend", "grpc", "kvTransfer", ("grpc", "torch")),
            policy=get_enum(kv, "policy", "recompute", "kvTransfer", ("recompute", "fail")),
            timeout_seconds=get_num(kv, "timeoutSeconds", 30.0, "kvTransfer") or 30.0,
            tls_secret=get(kv, "tlsSecret", str, None, "kvTransfer"),
            stream_layers=get(kv, "streamLayers", bool, False, "kvTransfer"),
            tls_issuer=issuer_ref(get(kv, "tlsIssuerRef", dict, None, "kvTransfer"),
                                  "kvTransfer.tlsIssuerRef")),
        service_monitor=get(mon, "serviceMonitor", bool, False, "monitoring"),
        scrape_interval=get(mon, "interval", str, "30s", "monitoring"),
        image=get(spec, "image", str, None, "spec"),
        security=parse_security(get_obj(spec, "security", "spec")),
        prometheus=prometheus_peer(get(mon, "prometheus", dict, None, "monitoring")),
        lora=parse_lora(get(spec, "lora", dict, None, "spec")))
    check_served_name(out.lora, model.served_name)
    if out.kv_transfer.tls_issuer is not None and not out.kv_transfer.tls_secret:
        raise SpecError("kvTransfer.tlsIssuerRef needs kvTransfer.tlsSecret (the Secret "
                        "cert-manager writes)")
    if out.disaggregated and out.prefill.engine.block_size != out.decode.engine.block_size:
        raise SpecError("prefill.engine.blockSize and decode.engine.blockSize differ; KV pages "
                        "move between the pools, so they must match")
    if out.disaggregated and out.prefill.engine.kv_dtype != out.decode.engine.kv_dtype:
        raise SpecError(f"prefill.engine.kvCacheDtype {out.prefill.engine.kv_cache_dtype} and "
                        f"decode.engine.kvCacheDtype {out.decode.engine.kv_cache_dtype} differ; "
                        "KV pages move between the pools, so they must match")
    if (out.disaggregated and out.prefill.device != out.decode.device
            and model.dtype in (None, "auto")):
        raise SpecError(f"prefill runs on {out.prefill.device} and decode on "
                        f"{out.decode.device}: set model.dtype (auto is bfloat16 on CUDA, "
                        "float32 on the CPU) so the KV pages they exchange match")
    if out.disaggregated and out.prefill.engine.speculative is not None:
        raise SpecError("prefill.engine.speculative: prefill workers do not decode; set "
                        "decode.engine.speculative")
    if out.prefill.autoscaling is not None and not out.disaggregated:
        raise SpecError("prefill.autoscaling needs prefill.replicas >= 1 (0 = aggregated)")
    return out
