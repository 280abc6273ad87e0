"""The router: Deployment, Service (the InferenceService's endpoint), ConfigMap (router.yaml),
PodDisruptionBudget, and a ServiceAccount with a namespaced Role that may only list and
watch EndpointSlices (what `--discovery kubernetes` reads)."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from tandem.operator.render.common import (
    CONFIG_HASH,
    HTTP_PORT,
    HTTP_PORT_NAME,
    PRE_STOP_SECONDS,
    TLS_DIR,
    Owner,
    base_env,
    config_hash,
    container_security_context,
    http_probe,
    labels,
    metadata,
    pdb,
    pod_security_context,
    pre_stop,
    scrape_annotations,
    scratch_volumes,
)
from tandem.operator.render.model import router_model
from tandem.operator.spec import InferenceServiceSpec, RateLimit
from tandem.protocol.labels import ROUTER_COMPONENT

CONFIG_DIR = "/etc/tandem/router"
AUTH_DIR = "/etc/tandem/auth"
# CRD weight names -> the router's scorer names
SCORERS = {"prefix": "prefix", "queue": "queue", "kvUsage": "kv_usage",
           "inflightTokens": "inflight_tokens", "cacheChurn": "cache_churn"}


def router_name(owner: Owner) -> str:
    return f"{owner.name}-router"


def router_endpoint(owner: Owner) -> str:
    """The URL clients inside the cluster use (`status.endpoint`)."""
    return f"http://{router_name(owner)}.{owner.namespace}.svc:{HTTP_PORT}"


def _limits(r: RateLimit) -> dict[str, float]:
    return {"requests_per_s": r.requests_per_second, "burst_requests": r.burst_requests,
            "tokens_per_min": r.tokens_per_minute}


def router_config(spec: InferenceServiceSpec) -> dict[str, Any]:
    """router.yaml as a dict (keys of `tandem.router.main`)."""
    r = spec.router
    cfg: dict[str, Any] = {"policy": r.policy, "pd_threshold": r.pd_threshold,
                           "pd_max_prefill_queue": r.pd_max_prefill_queue,
                           "pd_max_local_prefill": r.pd_max_local_prefill,
                           "worker_port_name": HTTP_PORT_NAME}
    if r.weights is not None:
        cfg["weights"] = {SCORERS[k]: v for k, v in r.weights.items()}
    tokenizer = router_model(spec.model).path
    if tokenizer is not None:
        cfg["tokenizers"] = {spec.model.served_name: tokenizer}
    if r.rate_limit is not None or r.tenant_rate_limits:
        cfg["rate_limits"] = {"default": _limits(r.rate_limit or RateLimit()),
                              "tenants": {t: _limits(v)
                                          for t, v in r.tenant_rate_limits.items()}}
    if r.redis_url:
        cfg["redis"] = r.redis_url
        if r.shared_index:
            cfg["index"] = r.redis_url
    return cfg


def router_args(spec: InferenceServiceSpec, owner: Owner) -> list[str]:
    args = ["router", "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--discovery", "kubernetes", "--namespace", "$(POD_NAMESPACE)",
            "--inference-service", owner.name, "--worker-port-name", HTTP_PORT_NAME,
            "--config", f"{CONFIG_DIR}/router.yaml"]
    if spec.router.api_keys_secret:
        args += ["--api-keys", f"{AUTH_DIR}/api-keys"]
    if spec.kv_transfer.tls_secret:  # the workers' gRPC requires client certificates
        args += ["--grpc-tls-dir", TLS_DIR]
    return args


def render_router(spec: InferenceServiceSpec, owner: Owner, image: str) -> list[dict[str, Any]]:
    name = router_name(owner)
    text = yaml.safe_dump(router_config(spec), sort_keys=True)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": metadata(owner, f"{name}-config", ROUTER_COMPONENT),
                  "data": {"router.yaml": text}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": metadata(owner, name, ROUTER_COMPONENT)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata(owner, name, ROUTER_COMPONENT),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": metadata(owner, name, ROUTER_COMPONENT),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                           "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name,
                             "namespace": owner.namespace}]}
    volumes, mounts = scratch_volumes()
    volumes.append({"name": "config", "configMap": {"name": f"{name}-config"}})
    mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    model = router_model(spec.model)
    volumes += model.volumes
    mounts += model.mounts
    if spec.router.api_keys_secret:
        volumes.append({"name": "api-keys", "secret": {
            "secretName": spec.router.api_keys_secret, "defaultMode": 0o440,
            "items": [{"key": spec.router.api_keys_key, "path": "api-keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": AUTH_DIR, "readOnly": True})
    if spec.kv_transfer.tls_secret:
        volumes.append({"name": "grpc-tls", "secret": {
            "secretName": spec.kv_transfer.tls_secret, "defaultMode": 0o440}})
        mounts.append({"name": "grpc-tls", "mountPath": TLS_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": "router", "image": image, "command": ["tandem"],
        "args": router_args(spec, owner),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": base_env(),
        "readinessProbe": http_probe("/ready", period=5, failures=2),
        "livenessProbe": http_probe("/health", period=10, failures=3, timeout=5),
        "lifecycle": pre_stop(), "securityContext": container_security_context(),
        "volumeMounts": mounts, "terminationMessagePolicy": "FallbackToLogsOnError"}
    if spec.router.resources:
        container["resources"] = copy.deepcopy(spec.router.resources)
    meta = metadata(owner, name, ROUTER_COMPONENT)
    # a new router.yaml or key Secret rolls the routers (both are read at start)
    digest = config_hash(text, spec.router.api_keys_secret, spec.router.api_keys_key,
                         spec.kv_transfer.tls_secret)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels(owner, ROUTER_COMPONENT)},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": dict(meta["labels"]),
                             "annotations": {CONFIG_HASH: digest, **scrape_annotations()}},
                "spec": {"serviceAccountName": name, "enableServiceLinks": False,
                         "securityContext": pod_security_context(),
                         "terminationGracePeriodSeconds": PRE_STOP_SECONDS + 25,
                         "containers": [container], "volumes": volumes}}}}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": metadata(owner, name, ROUTER_COMPONENT),
               "spec": {"type": spec.router.service_type,
                        "selector": labels(owner, ROUTER_COMPONENT),
                        "ports": [{"name": HTTP_PORT_NAME, "port": HTTP_PORT,
                                   "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]}}
    return [account, role, binding, config_map, deployment, service,
            pdb(owner, name, ROUTER_COMPONENT)]
