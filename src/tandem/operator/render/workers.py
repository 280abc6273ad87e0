"""Worker pools: the pool's workload (`render.workload.Workload`: a Deployment, or for a
multi-node tensor-parallel pool a LeaderWorkerSet, see `render.multinode`), a headless
Service (whose EndpointSlices the routers watch) and a PodDisruptionBudget per pool.

Disaggregated (`prefill.replicas > 0`): pools `prefill` (role prefill) and `decode` (role
decode). Aggregated: one pool `worker` (role both) built from `spec.decode`. Pods drain on
SIGTERM (`tandem worker --drain-timeout`): the preStop sleep lets the routers drop the
endpoint first, and the grace period covers sleep + drain + shutdown.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.operator.render.common import (
    CONFIG_HASH,
    GRPC_PORT,
    GRPC_PORT_NAME,
    HTTP_PORT,
    HTTP_PORT_NAME,
    PRE_STOP_SECONDS,
    TLS_DIR,
    Owner,
    base_env,
    config_hash,
    container_security_context,
    http_probe,
    log_level_args,
    metadata,
    pdb,
    pod_security_context,
    pre_stop,
    scrape_annotations,
    scratch_volumes,
)
from tandem.operator.render.kvcache import worker_kv_cache
from tandem.operator.render.lora import lora_args, worker_lora
from tandem.operator.render.model import draft_model, worker_model
from tandem.operator.render.multinode import leader_worker_set
from tandem.operator.render.security import worker_auth_mount, worker_security_args
from tandem.operator.render.workload import (
    Pool,
    Workload,
    pool_name,
    pool_workloads,
    pools,
)
from tandem.operator.spec import InferenceServiceSpec, PoolSpec
from tandem.protocol import engine_flags as flags
from tandem.protocol.labels import WORKER_COMPONENT

SHUTDOWN_SLACK_SECONDS = 15  # after the drain: uvicorn's graceful stop, engine shutdown
EPHEMERAL = "ephemeral-storage"
EPHEMERAL_HEADROOM_MIB = 4096  # logs, /tmp and the caches, beyond the model's download
_MIB = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
STARTUP_SECONDS = 1800  # digest check + (download) before /health answers; then liveness


__all__ = ["Pool", "Workload", "pool_name", "pool_selector", "pools", "render_workers",
           "worker_args", "worker_template"]


def pool_selector(owner: Owner, pool: Pool) -> str:
    """The pool's label selector as a string (the scale subresource's `status.selector`)."""
    return Workload.of(owner, pool).selector_string


def _threads(pool: PoolSpec) -> int | None:
    """numThreads, else the CPU limit rounded up (torch would take every host core)."""
    if pool.engine.num_threads is not None:
        return pool.engine.num_threads
    cpu = str((pool.resources.get("limits") or {}).get("cpu", ""))
    if not cpu:
        return None
    cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    return max(1, math.ceil(cores))


def worker_args(spec: InferenceServiceSpec, pool: Pool, model_path: str | None) -> list[str]:
    """`tandem worker` arguments for one pool (after the `tandem` command)."""
    e, kv, m = pool.spec.engine, spec.kv_transfer, spec.model
    args = [*log_level_args(pool.spec.pod.log_level or spec.log_level),
            "worker", flags.HOST, "0.0.0.0", flags.PORT, str(HTTP_PORT),
            flags.GRPC_PORT, str(GRPC_PORT), flags.ROLE, pool.role,
            flags.SERVED_MODEL_NAME, *m.served_names]
    optional: list[tuple[str, Any]] = [
        (flags.MODEL, model_path), (flags.MODEL_SHA256, m.sha256), (flags.DTYPE, m.dtype),
        (flags.BLOCK_SIZE, e.block_size), (flags.MAX_NUM_SEQS, e.max_num_seqs),
        (flags.MAX_NUM_BATCHED_TOKENS, e.max_num_batched_tokens),
        (flags.LONG_PREFILL_TOKEN_THRESHOLD, e.long_prefill_token_threshold),
        (flags.MAX_MODEL_LEN, e.max_model_len), (flags.KV_CACHE_MEMORY, e.kv_cache_memory),
        (flags.NUM_KV_BLOCKS, e.num_kv_blocks), (flags.MAX_WAITING, e.max_waiting),
        (flags.NUM_THREADS, _threads(pool.spec)), (flags.DRAIN_TIMEOUT, e.drain_timeout_seconds),
        (flags.DEVICE, pool.spec.device),
        (flags.ATTENTION_BACKEND, None if e.attention_backend == "auto" else e.attention_backend),
        (flags.GPU_MEMORY_UTILIZATION, e.gpu_memory_utilization),
        (flags.QUANTIZATION, e.quantization),
        (flags.QUANTIZATION_GROUP_SIZE, e.quantization_group_size),
        (flags.KV_CACHE_DTYPE, None if e.kv_cache_dtype == "auto" else e.kv_cache_dtype),
        # (refused on prefill pools: they serve no client requests)
        (flags.TOOL_CALL_PARSER, e.tool_call_parser), (flags.REASONING_PARSER, e.reasoning_parser),
        (flags.STRUCTURED_OUTPUTS_BACKEND, e.structured_outputs_backend),
        (flags.RESPONSES_STORE_MAX, e.responses_store_max),
        (flags.RESPONSES_STORE_TTL, e.responses_store_ttl_seconds)]
    layout = pool.spec.layout
    if layout.tensor > 1:  # (1: the worker's default; unset keeps older renders as they were)
        optional += [(flags.TENSOR_PARALLEL_SIZE, layout.tensor),
                     (flags.DISTRIBUTED_EXECUTOR_BACKEND, layout.backend)]
    if e.speculative is not None:  # (refused on prefill pools: they do not decode)
        optional.append((flags.SPECULATIVE_CONFIG, e.speculative.worker_json(
            draft_model(m, e.speculative).path)))
    if pool.role == "decode":  # the side that pulls pages from prefill workers
        optional += [(flags.KV_TRANSFER_BACKEND, kv.backend), (flags.KV_TRANSFER_POLICY, kv.policy),
                     (flags.KV_TRANSFER_TIMEOUT, f"{kv.timeout_seconds:g}")]
        if kv.backend == "torch":
            optional.append((flags.KV_TRANSFER_HOST, "$(POD_IP)"))
    if kv.tls_secret:
        optional.append((flags.GRPC_TLS_DIR, TLS_DIR))
    for name, value in optional:
        if value is not None:
            args += [name, str(value)]
    if not e.enable_prefix_caching:
        args.append(flags.NO_PREFIX_CACHING)
    if e.enforce_eager:
        args.append(flags.ENFORCE_EAGER)
    if e.async_scheduling:
        args.append(flags.ASYNC_SCHEDULING)
    if e.enable_auto_tool_choice:
        args.append(flags.ENABLE_AUTO_TOOL_CHOICE)
    if kv.stream_layers and pool.role in ("prefill", "both"):  # the sides that serve Prefill
        args.append(flags.KV_STREAM_LAYERS)
    # every role: prefill computes with the adapter too; every role keeps KV tiers
    return args + lora_args(spec.lora) + worker_kv_cache(spec.kv_cache).args


def pool_config_hash(spec: InferenceServiceSpec, pool: Pool) -> str:
    """Model + engine args (+ the KV transfer settings a decode pool runs with): what rolls
    the pool when it changes; replicas are not in it."""
    kv = spec.kv_transfer if pool.role == "decode" else None
    lora = [spec.lora] if spec.lora is not None else []  # (unset: the hash it always had)
    tp = [pool.spec.parallelism] if pool.spec.parallelism.tensor > 1 else []  # (likewise)
    tiers = [spec.kv_cache.offload] if spec.kv_cache.offload is not None else []  # (likewise)
    return config_hash(spec.model, pool.spec.engine, pool.role, kv, spec.kv_transfer.tls_secret,
                       *lora, *tp, *tiers)


def shm_size(pool: PoolSpec) -> str:
    """The memory-backed /dev/shm of a pool's pods: NCCL / gloo buffers, 1Gi per local rank."""
    return f"{max(1, pool.layout.ranks_per_pod)}Gi"


def worker_template(spec: InferenceServiceSpec, owner: Owner, pool: Pool,
                    image: str) -> dict[str, Any]:
    """The pod template of one worker (a multi-node pool's leader pod); the pool's own
    `image` wins over `image`."""
    image = pool.spec.pod.image or image
    volumes, mounts = scratch_volumes()
    model = worker_model(spec.model, image, mounts)
    draft = draft_model(spec.model, pool.spec.engine.speculative)
    volumes += model.volumes + draft.volumes
    lora = worker_lora(spec.lora, image, mounts, volumes)
    volumes += lora.volumes
    tiers = worker_kv_cache(spec.kv_cache)
    volumes += tiers.volumes
    mounts = mounts + model.mounts + draft.mounts + lora.mounts + tiers.mounts
    if spec.kv_transfer.tls_secret:
        volumes.append({"name": "grpc-tls", "secret": {
            "secretName": spec.kv_transfer.tls_secret, "defaultMode": 0o440}})
        mounts.append({"name": "grpc-tls", "mountPath": TLS_DIR, "readOnly": True})
    auth_volume, auth_mount = worker_auth_mount(spec, owner)  # a rotated key: no restart
    volumes.append(auth_volume)
    mounts.append(auth_mount)
    if (pool.spec.gpus or spec.kv_transfer.backend == "torch"
            or pool.spec.layout.tensor > 1):  # NCCL / gloo shared memory
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": shm_size(pool.spec)}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container = {
        "name": "worker", "image": image, "command": ["tandem"],
        "args": worker_args(spec, pool, model.path) + worker_security_args(spec, owner),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": GRPC_PORT_NAME, "containerPort": GRPC_PORT, "protocol": "TCP"}],
        "env": base_env(),
        "readinessProbe": http_probe("/ready", period=5, failures=2),
        "livenessProbe": http_probe("/health", period=10, failures=3, timeout=5),
        "startupProbe": http_probe("/health", period=10, failures=STARTUP_SECONDS // 10),
        "lifecycle": pre_stop(), "securityContext": container_security_context(),
        "volumeMounts": mounts, "terminationMessagePolicy": "FallbackToLogsOnError"}
    download = total_size(model.ephemeral_storage, lora.ephemeral_storage)
    if pool.spec.resources or download:
        container["resources"] = with_ephemeral_storage(pool.spec.resources, download)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": (PRE_STOP_SECONDS + pool.spec.engine.drain_timeout_seconds
                                          + SHUTDOWN_SLACK_SECONDS),
        "containers": [container], "volumes": volumes}
    if model.init_containers or lora.init_containers:
        pod["initContainers"] = model.init_containers + lora.init_containers
    if pool.spec.node_selector:
        pod["nodeSelector"] = dict(pool.spec.node_selector)
    if pool.spec.tolerations:
        pod["tolerations"] = copy.deepcopy(list(pool.spec.tolerations))
    meta = metadata(owner, pool_name(owner, pool), WORKER_COMPONENT, pool.role)
    return {"metadata": {
        "labels": dict(meta["labels"]),
        "annotations": {CONFIG_HASH: pool_config_hash(spec, pool), **scrape_annotations(),
                        "kubectl.kubernetes.io/default-container": "worker"}},
        "spec": pod}


def worker_deployment(owner: Owner, workload: Workload, template: dict[str, Any],
                      replicas: int | None) -> dict[str, Any]:
    """The pool's Deployment from its worker pod `template`; `replicas` None leaves the count
    to an HPA."""
    assert not workload.multinode
    meta = metadata(owner, workload.name, WORKER_COMPONENT, workload.role)
    deploy_spec: dict[str, Any] = {
        "selector": {"matchLabels": dict(workload.selector)},
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "revisionHistoryLimit": 3,
        "template": template}
    if replicas is not None:
        deploy_spec = {"replicas": replicas, **deploy_spec}
    return {"apiVersion": workload.api_version, "kind": workload.kind, "metadata": meta,
            "spec": deploy_spec}


def _mib(size: str) -> int:
    return math.ceil(int(size[:-2]) * _MIB[size[-2:]])


def total_size(*sizes: str | None) -> str | None:
    """Downloads' sizes (like 20Gi) added up: the one given as is, several in Mi."""
    given = [s for s in sizes if s]
    if len(given) < 2:
        return given[0] if given else None
    return f"{sum(map(_mib, given))}Mi"


def with_ephemeral_storage(resources: Mapping[str, Any], download: str | None) -> dict[str, Any]:
    """The pool's resources plus, for a download into an emptyDir, an ephemeral-storage
    request of its size and a limit with room for logs and scratch (unless the pool sets
    either itself)."""
    out = copy.deepcopy(dict(resources))
    if download is None or any(EPHEMERAL in out.get(k, {}) for k in ("requests", "limits")):
        return out
    mib = _mib(download) + EPHEMERAL_HEADROOM_MIB
    out.setdefault("requests", {}).setdefault(EPHEMERAL, download)
    out.setdefault("limits", {}).setdefault(EPHEMERAL, f"{mib}Mi")
    return out


def worker_service(owner: Owner, workload: Workload) -> dict[str, Any]:
    """Headless: routers reach pods by IP; its labels reach the EndpointSlices they watch."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, workload.name, WORKER_COMPONENT, workload.role),
            "spec": {"clusterIP": "None",
                     "selector": dict(workload.selector),
                     "ports": [{"name": HTTP_PORT_NAME, "port": HTTP_PORT,
                                "targetPort": HTTP_PORT_NAME, "protocol": "TCP"},
                               {"name": GRPC_PORT_NAME, "port": GRPC_PORT,
                                "targetPort": GRPC_PORT_NAME, "protocol": "TCP"}]}}


def desired_replicas(pool: Pool, override: Mapping[str, int] | None) -> int | None:
    """The count to render: None under an HPA (KEDA's too); an autoscaler's choice
    (`override`, by pool name) or the spec's, kept within the autoscaling bounds."""
    auto = pool.spec.autoscaling
    if auto is not None and auto.mode in ("hpa", "keda"):
        return None
    n = (override or {}).get(pool.name, pool.spec.replicas)
    return n if auto is None else min(max(n, auto.min_replicas), auto.max_replicas)


def pool_image(pool: Pool, image: str, cuda_image: str | None = None) -> str:
    """The pool's image: its own `image`, else `cuda_image` (default `image`) for a pool on
    CUDA, else `image`."""
    if pool.spec.pod.image:
        return pool.spec.pod.image
    return (cuda_image or image) if pool.spec.device == "cuda" else image


def render_workers(spec: InferenceServiceSpec, owner: Owner, image: str,
                   replicas: Mapping[str, int] | None = None,
                   cuda_image: str | None = None,
                   workloads: Sequence[Workload] | None = None) -> list[dict[str, Any]]:
    """Each pool's workload, Service and PodDisruptionBudget; `image` runs the CPU pools,
    `cuda_image` (default `image`) the GPU pools; `workloads` default `pool_workloads`."""
    out: list[dict[str, Any]] = []
    for w in pool_workloads(spec, owner) if workloads is None else workloads:
        pool = w.pool
        img, n = pool_image(pool, image, cuda_image), desired_replicas(pool, replicas)
        template = worker_template(spec, owner, pool, img)
        out.append(leader_worker_set(owner, w, template, n) if w.multinode
                   else worker_deployment(owner, w, template, n))
        out.append(worker_service(owner, w))
        out.append(pdb(owner, w.name, WORKER_COMPONENT, w.role, selector=w.pod_selector))
    return out
