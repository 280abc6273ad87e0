"""An InferenceService's spec as typed, frozen dataclasses (`parse_spec`).

Defaults are those of `crds/inferenceservice.yaml` (a test holds the two together), so a spec
that skipped the API server's defaulting parses the same. Checks the schema cannot express
raise `SpecError`; the CEL rules of the CRD are repeated here, for clusters or callers that
never ran them. Field names follow the CRD (camelCase) in messages.
"""

from __future__ import annotations

import copy
import dataclasses
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
from tandem.operator.pod_settings import (
    PodSettings,
    label_map,
    parse_log_level,
    parse_pod_settings,
)
from tandem.operator.spec_autoscaling import (
    SIGNALS,
    AutoscalingSpec,
    Signal,
    parse_autoscaling,
    signal_for,
)
from tandem.operator.spec_engine import (
    EngineArgs,
    check_pool_device,
    gpu_count,
    parse_engine,
    pool_device,
)
from tandem.operator.spec_kvcache import KVCacheSpec, parse_kv_cache
from tandem.operator.spec_lora import LoRASpec, check_served_name, parse_lora
from tandem.operator.spec_parallel import (
    Layout,
    ParallelismSpec,
    check_group_strategy,
    check_parallelism,
    parse_parallelism,
)
from tandem.operator.spec_router import RateLimit, RouterSpec, parse_router
from tandem.operator.spec_security import (
    IssuerRef,
    SecretKeyRef,
    SecuritySpec,
    issuer_ref,
    parse_security,
    peer,
    prometheus_peer,
    secret_key_ref,
)
from tandem.protocol.engine_flags import KV_TRANSFER_BACKENDS, KV_TRANSFER_POLICIES

__all__ = ["SpecError", "ModelSource", "InferenceServiceSpec", "parse_spec", "check_name",
           "SIGNALS", "MAX_NAME", "RateLimit", "RouterSpec", "AutoscalingSpec", "Signal",
           "signal_for"]

DEFAULT_HF_STORAGE = "50Gi"  # hf:// without model.storage (CRD: the field's description)
_STORAGE = re.compile(r"^[1-9][0-9]*(Ki|Mi|Gi|Ti)$")
MAX_NAME = 52  # the longest child Service name, NAME-prefill, stays a 63-character label
# a StatefulSet name is at most 52 (its pods' controller-revision-hash label is NAME-HASH);
# LeaderWorkerSet NAME-POOL names its worker StatefulSets NAME-POOL-GROUP (groups < 1000)
MAX_MULTINODE_NAME = 52 - len("-999")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# the labels the operator puts on every child besides its tandem.dev/ keys
# (`render.common.all_labels`; a test holds the two together)
OPERATOR_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/component", "app.kubernetes.io/managed-by")


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
    def served_names(self) -> tuple[str, ...]:
        """Every name the workers answer to (`--served-model-name`, the first in answers):
        `served_name`, and for `hf://ORG/NAME` the Hub id ORG/NAME too, as vLLM serves it."""
        names = [self.served_name]
        if self.source.kind == "hf" and self.source.repo:
            names.append(self.source.repo)
        return tuple(dict.fromkeys(names))

    @property
    def download_storage(self) -> str:
        """The emptyDir size of an hf:// download without a cache."""
        return self.storage or DEFAULT_HF_STORAGE


@dataclass(frozen=True)
class PoolSpec:
    replicas: int
    resources: dict[str, dict[str, int | str]] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    engine: EngineArgs = EngineArgs()
    autoscaling: AutoscalingSpec | None = None
    pod: PodSettings = PodSettings()
    parallelism: ParallelismSpec = ParallelismSpec()

    @property
    def gpus(self) -> int:
        """GPUs per pod (a multi-node pool's worker holds `layout.nodes` times as many)."""
        return int((self.resources.get("limits") or {}).get(GPU, 0))

    @property
    def layout(self) -> Layout:
        """Where one worker's tensor-parallel ranks run (checked when parsed)."""
        return check_parallelism(self.parallelism, self.gpus, "pool")

    @property
    def device(self) -> str:
        """cuda or cpu: the workers' `--device`."""
        return pool_device(self.engine, self.gpus)


@dataclass(frozen=True)
class KVTransferSpec:
    backend: str = "grpc"
    policy: str = "recompute"
    timeout_seconds: float = 30.0
    tls_secret: str | None = None
    stream_layers: bool = False  # prefill side: send each layer as soon as it is computed
    tls_issuer: IssuerRef | None = None  # cert-manager issues tls_secret
    tls_own_ca: bool = False  # ... from a CA of the InferenceService's own (render.security)


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    router: RouterSpec
    prefill: PoolSpec
    decode: PoolSpec  # the aggregated pool (role both) when prefill.replicas is 0
    kv_transfer: KVTransferSpec = KVTransferSpec()
    service_monitor: bool = False
    scrape_interval: str = "30s"
    # added to the ServiceMonitor's own labels (a Prometheus's serviceMonitorSelector)
    monitoring_labels: dict[str, str] = field(default_factory=dict)
    image: str | None = None  # None: the operator's default image
    security: SecuritySpec = SecuritySpec()
    prometheus: dict[str, Any] | None = None  # a NetworkPolicy peer admitted to /metrics
    lora: LoRASpec | None = None  # adapters every pool serves; None: no LoRA
    log_level: str | None = None  # routers' and workers' (`tandem --log-level`); None: INFO
    # a NetworkPolicy peer admitted to the routers' metrics port (/scaling): KEDA's operator
    keda: dict[str, Any] | None = None
    kv_cache: KVCacheSpec = KVCacheSpec()  # KV tiers and peer pulls (spec_kvcache)

    @property
    def disaggregated(self) -> bool:
        """P/D: `prefill.replicas >= 1` (with prefill.autoscaling the live count may still
        reach minReplicas, 0 included; the service stays P/D)."""
        return self.prefill.replicas > 0

    @property
    def scales_to_zero(self) -> bool:
        """Some pool may run no worker (`autoscaling.mode: operator` or `keda`, minReplicas or
        keda.idleReplicas 0): the router must list and hold the model meanwhile."""
        return any(p.autoscaling is not None and p.autoscaling.scales_to_zero
                   for _, _, p in self.worker_pools())

    @property
    def band_targets(self) -> list[str]:
        """The bands whose queue some pool's KEDA trigger reads (`keda.bandTargets`)."""
        return sorted({b for _, _, p in self.worker_pools() if p.autoscaling is not None
                       for b, _ in p.autoscaling.keda.band_targets})

    @property
    def flow_control_enabled(self) -> bool:
        """router.flowControl.enabled, or unset: on exactly when a pool scales to zero or
        scales on a band's queue."""
        enabled = self.router.flow_control.enabled
        return (self.scales_to_zero or bool(self.band_targets)) if enabled is None else enabled

    def worker_pools(self) -> list[tuple[str, str, PoolSpec]]:
        """(name, role, spec) per worker pool: prefill + decode, or one aggregated `worker`
        (role both) built from `decode`."""
        if self.disaggregated:
            return [("prefill", "prefill", self.prefill), ("decode", "decode", self.decode)]
        return [("worker", "both", self.decode)]


def check_name(name: str, spec: InferenceServiceSpec | None = None) -> None:
    """An InferenceService name whose children's names all stay valid (with `spec`: a
    multi-node pool's LeaderWorkerSet too, whose StatefulSets are NAME-POOL-GROUP)."""
    if not _DNS_LABEL.match(name) or len(name) > MAX_NAME:
        raise SpecError(f"name {name!r}: a DNS label of at most {MAX_NAME} characters "
                        "(children are named NAME-prefill, NAME-decode, NAME-router)")
    if spec is not None and spec.router.attach_to == name:
        raise SpecError(f"router.attachTo {name!r} names this InferenceService itself")
    for pool, _, p in spec.worker_pools() if spec is not None else ():
        if p.layout.multinode and len(f"{name}-{pool}") > MAX_MULTINODE_NAME:
            where = "decode" if pool == "worker" else pool
            raise SpecError(f"name {name!r}: {where} is a multi-node pool, whose "
                            f"LeaderWorkerSet {name}-{pool} must be at most "
                            f"{MAX_MULTINODE_NAME} characters (its StatefulSets are named "
                            f"{name}-{pool}-GROUP, and Kubernetes labels a StatefulSet's pods "
                            "with its name and a revision hash)")


def _pool(d: dict, where: str, replicas: int) -> PoolSpec:
    tolerations = get(d, "tolerations", list, [], where)
    res = resources(get_obj(d, "resources", where), f"{where}.resources")
    engine = parse_engine(get_obj(d, "engine", where), where)
    gpus = gpu_count(res, where)
    check_pool_device(engine, gpus, where)
    parallelism = parse_parallelism(d.get("parallelism"), where)
    layout = check_parallelism(parallelism, gpus, where)
    pool = PoolSpec(
        replicas=get_int(d, "replicas", replicas, where, 0, 1000),
        resources=res,
        node_selector=dict(get_obj(d, "nodeSelector", where)),
        tolerations=tuple(dict(t) for t in tolerations),
        engine=engine,
        autoscaling=parse_autoscaling(get(d, "autoscaling", dict, None, where), where),
        pod=parse_pod_settings(d, where, scheduling=False, gpu=gpus > 0),
        parallelism=parallelism)
    if layout.multinode:  # the LeaderWorkerSet's rollout, at the fewest replicas it runs
        a = pool.autoscaling  # (an HPA's LWS is created without a count: the webhook's 1)
        fewest = (pool.replicas if a is None else 1 if a.mode in ("hpa", "keda")
                  else a.min_replicas)
        check_group_strategy(pool.pod.strategy, fewest, where)
    return pool


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


def _monitoring_labels(mon: dict) -> dict[str, str]:
    """monitoring.labels: Kubernetes label keys and values, none the operator sets."""
    out = label_map(mon, "labels", "monitoring", values=True)
    for k in out:
        if k in OPERATOR_LABELS:
            raise SpecError(f"monitoring.labels: {k!r} is a label the operator sets")
    return out


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
        model=model, router=parse_router(get_obj(spec, "router", "spec")),
        prefill=_pool(get_obj(spec, "prefill", "spec"), "prefill", 0),
        decode=_pool(get_obj(spec, "decode", "spec"), "decode", 1),
        kv_transfer=KVTransferSpec(
            backend=get_enum(kv, "backend", "grpc", "kvTransfer", KV_TRANSFER_BACKENDS),
            policy=get_enum(kv, "policy", "recompute", "kvTransfer", KV_TRANSFER_POLICIES),
            timeout_seconds=get_num(kv, "timeoutSeconds", 30.0, "kvTransfer") or 30.0,
            tls_secret=get(kv, "tlsSecret", str, None, "kvTransfer"),
            stream_layers=get(kv, "streamLayers", bool, False, "kvTransfer"),
            tls_issuer=issuer_ref(get(kv, "tlsIssuerRef", dict, None, "kvTransfer"),
                                  "kvTransfer.tlsIssuerRef"),
            tls_own_ca=get(kv, "tlsOwnCA", bool, False, "kvTransfer")),
        service_monitor=get(mon, "serviceMonitor", bool, False, "monitoring"),
        scrape_interval=get(mon, "interval", str, "30s", "monitoring"),
        monitoring_labels=_monitoring_labels(mon),
        image=get(spec, "image", str, None, "spec"),
        security=parse_security(get_obj(spec, "security", "spec")),
        prometheus=prometheus_peer(get(mon, "prometheus", dict, None, "monitoring"),
                                   get(mon, "serviceMonitor", bool, False, "monitoring")),
        lora=parse_lora(get(spec, "lora", dict, None, "spec")),
        log_level=parse_log_level(spec, "spec"),
        kv_cache=parse_kv_cache(get(spec, "kvCache", dict, None, "spec")))
    for name in model.served_names:
        check_served_name(out.lora, name)
    if out.kv_transfer.tls_issuer is not None and not out.kv_transfer.tls_secret:
        raise SpecError("kvTransfer.tlsIssuerRef needs kvTransfer.tlsSecret (the Secret "
                        "cert-manager writes)")
    kv_ = out.kv_transfer
    if kv_.tls_own_ca and (not kv_.tls_secret or kv_.tls_issuer is not None):
        raise SpecError("kvTransfer.tlsOwnCA needs kvTransfer.tlsSecret and excludes "
                        "kvTransfer.tlsIssuerRef")
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
                        "float32 or bfloat16 on the CPU) so the KV pages they exchange match")
    if out.disaggregated and out.prefill.engine.speculative is not None:
        raise SpecError("prefill.engine.speculative: prefill workers do not decode; set "
                        "decode.engine.speculative")
    if out.disaggregated and out.prefill.engine.client_output_fields:
        raise SpecError(f"prefill.engine.{', '.join(out.prefill.engine.client_output_fields)}: "
                        "prefill workers serve no client requests; set them on decode.engine")
    if out.prefill.autoscaling is not None and not out.disaggregated:
        raise SpecError("prefill.autoscaling needs prefill.replicas >= 1 (0 = aggregated)")
    if out.scales_to_zero and out.router.flow_control.enabled is False:
        raise SpecError("router.flowControl.enabled false: a pool scales to zero "
                        "(autoscaling.minReplicas or keda.idleReplicas 0), and the router "
                        "holds its requests in the flow-control queue while it starts")
    if out.band_targets and out.router.flow_control.enabled is False:
        raise SpecError("router.flowControl.enabled false: autoscaling.keda.bandTargets "
                        "scales on the flow-control queue's bands")
    if any(p.autoscaling is not None and p.autoscaling.mode == "keda"
           for _, _, p in out.worker_pools()):
        out = dataclasses.replace(out, keda=_keda_peer(mon))
    elif mon.get("keda") is not None:
        raise SpecError("monitoring.keda: no pool has autoscaling.mode keda")
    return out


# KEDA's operator pods as its chart and manifests install them (namespace keda): what reads
# the routers' /scaling (the metrics-api scaler runs in keda-operator)
KEDA_NAMESPACE = "keda"
DEFAULT_KEDA = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": KEDA_NAMESPACE}},
    "podSelector": {"matchLabels": {"app": "keda-operator"}}}


def _keda_peer(mon: dict[str, Any]) -> dict[str, Any] | None:
    """`monitoring.keda` (a NetworkPolicy peer; `DEFAULT_KEDA` unset). Used only when a pool
    has autoscaling.mode keda (`render.security`)."""
    d = get(mon, "keda", dict, None, "monitoring")
    return copy.deepcopy(DEFAULT_KEDA) if d is None else peer(d, "monitoring.keda",
                                                               ip_block=False)
