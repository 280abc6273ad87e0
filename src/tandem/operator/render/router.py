"""The router: Deployment, Service (the InferenceService's endpoint), ConfigMap (router.yaml),
PodDisruptionBudget, and a ServiceAccount with a namespaced Role that may only list and
watch EndpointSlices (what `--discovery kubernetes` reads). Its /metrics is on a port of its
own (`METRICS_PORT`, named `metrics`, `--metrics-port`: no key, admitted only to
`monitoring.prometheus` by the NetworkPolicy), never on the Service's http port, where it
would need an API key; the pod's `prometheus.io/port` names it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import yaml

from tandem.operator.render.common import (
    CONFIG_HASH,
    HTTP_PORT,
    HTTP_PORT_NAME,
    METRICS_PORT,
    METRICS_PORT_NAME,
    PRE_STOP_SECONDS,
    TLS_DIR,
    Owner,
    base_env,
    config_hash,
    container_security_context,
    http_probe,
    labels,
    log_level_args,
    metadata,
    pdb,
    pod_security_context,
    pre_stop,
    scrape_annotations,
    scratch_volumes,
)
from tandem.operator.render.gateway import (
    Member,
    discovery_selector,
    epp_args,
    epp_name,
    epp_pod,
    epp_rules,
    epp_service,
    gateway_mode,
)
from tandem.operator.render.kvcache import router_peer_pull_args
from tandem.operator.render.model import TOKENIZER_DIR, router_model
from tandem.operator.render.security import (
    OperatorPeer,
    redis_config,
    redis_env,
    router_pod_labels,
    security_args,
    worker_auth_mount,
)
from tandem.operator.spec import InferenceServiceSpec, RateLimit
from tandem.operator.spec_router import FlowControlSpec
from tandem.protocol.labels import ROUTER_COMPONENT

CONFIG_DIR = "/etc/tandem/router"
# SIGTERM (after the preStop sleep) -> in-flight streams get DRAIN_SECONDS (`--drain-seconds`)
# -> EXIT_SLACK_SECONDS for the shutdown; the grace period covers all three, as for workers
DRAIN_SECONDS = 25
EXIT_SLACK_SECONDS = 5
TERMINATION_GRACE_SECONDS = PRE_STOP_SECONDS + DRAIN_SECONDS + EXIT_SLACK_SECONDS
AUTH_DIR = "/etc/tandem/auth"
ADMIN_AUTH_DIR = "/etc/tandem/admin-auth"
# CRD weight names -> the router's scorer names
SCORERS = {"prefix": "prefix", "queue": "queue", "kvUsage": "kv_usage",
           "inflightTokens": "inflight_tokens", "cacheChurn": "cache_churn",
           "loraAffinity": "lora_affinity", "cost": "cost", "sessionAffinity": "session_affinity"}


def router_name(owner: Owner) -> str:
    return f"{owner.name}-router"


def front_door_name(spec: InferenceServiceSpec, owner: Owner) -> str | None:
    """The Deployment that runs this InferenceService's routers: NAME-router, or NAME-epp in
    gateway mode; None when attached to another's (`router.attachTo`)."""
    if spec.router.attach_to is not None:
        return None
    return epp_name(owner) if gateway_mode(spec) else router_name(owner)


def router_endpoint(owner: Owner) -> str:
    """The URL clients inside the cluster use (`status.endpoint`)."""
    return f"http://{router_name(owner)}.{owner.namespace}.svc:{HTTP_PORT}"


def _limits(r: RateLimit) -> dict[str, float]:
    return {"requests_per_s": r.requests_per_second, "burst_requests": r.burst_requests,
            "tokens_per_min": r.tokens_per_minute}


def router_config(spec: InferenceServiceSpec, owner: Owner,
                  members: Sequence[Member] = ()) -> dict[str, Any]:
    """router.yaml as a dict (keys of `tandem.router.main`); `members`: the InferenceServices
    attached to this router, whose models' tokenizers are at /tokenizer-N (N from 1)."""
    r = spec.router
    cfg: dict[str, Any] = {"policy": r.policy, "pd_threshold": r.pd_threshold,
                           "pd_max_prefill_queue": r.pd_max_prefill_queue,
                           "pd_max_local_prefill": r.pd_max_local_prefill,
                           "pd_decision": r.pd_decision, "pd_itl_weight": r.pd_itl_weight,
                           "pd_stall_budget": r.pd_stall_budget,
                           "worker_port_name": HTTP_PORT_NAME}
    if r.weights is not None:
        cfg["weights"] = {SCORERS[k]: v for k, v in r.weights.items()}
    # the tokenizer init container's output (`render.model.router_model`), for every source
    cfg["tokenizers"] = {name: TOKENIZER_DIR for name in spec.model.served_names}
    for i, m in enumerate(members, 1):  # (a name this service serves keeps its own)
        for name in m.spec.model.served_names:
            cfg["tokenizers"].setdefault(name, f"{TOKENIZER_DIR}-{i}")
    if r.rate_limit is not None or r.tenant_rate_limits:
        cfg["rate_limits"] = {"default": _limits(r.rate_limit or RateLimit()),
                              "tenants": {t: _limits(v)
                                          for t, v in r.tenant_rate_limits.items()}}
    cfg.update(redis_config(spec, owner))  # `env:TANDEM_REDIS_URL`: the URL stays in its Secret
    if r.gateway is not None and r.gateway.objectives:  # InferenceObjective -> priority
        cfg["objectives"] = dict(r.gateway.objectives)
    cfg.update(flow_control_config(spec))
    if r.guardrails is not None and r.guardrails.config:  # checked by the router's checker
        cfg["guardrails"] = copy.deepcopy(r.guardrails.config)
    held = [m for m in members if m.spec.scales_to_zero]  # members' pools that may be at 0
    if held:  # ... whose requests this router holds while they start (attached: defaults)
        cfg.setdefault("flow_control", {"enabled": True})
        cfg.setdefault("served_models", []).extend(
            {"name": name, "start_timeout_s": m.spec.router.flow_control.start_timeout_seconds}
            for m in held for name in m.spec.model.served_names)
    for m in members:  # members' KEDA triggers on a band read this router's /scaling
        if m.spec.band_targets:
            fc = cfg.setdefault("flow_control", {"enabled": True})
            fc["bands"] = {int(b): {} for b in m.spec.band_targets} | fc.get("bands", {})
    return cfg


def flow_control_config(spec: InferenceServiceSpec) -> dict[str, Any]:
    """router.yaml `flow_control` (the fields `router.flowControl` sets; the router's defaults
    for the rest) and, when a pool may scale to zero, `served_models`: every served name,
    listed and held with no worker up for `startTimeoutSeconds`. Nothing when flow control
    is off and unset (router.yaml as before)."""
    f, out = spec.router.flow_control, {}
    if spec.flow_control_enabled or f != FlowControlSpec():
        fc: dict[str, Any] = {"enabled": spec.flow_control_enabled}
        optional = {"fairness": f.fairness, "ordering": f.ordering, "ttl_s": f.ttl_seconds,
                    "shared": f.shared}
        fc.update({k: v for k, v in optional.items() if v is not None})
        saturation = {"waiting": f.saturation_waiting, "kv": f.saturation_kv}
        if any(v is not None for v in saturation.values()):
            fc["saturation"] = {k: v for k, v in saturation.items() if v is not None}
        if f.bands:
            fc["bands"] = {k if k == "default" else int(k): {
                key: v for key, v in (("max_requests", b.max_requests),
                                      ("max_bytes", b.max_bytes)) if v is not None}
                for k, b in f.bands}
        if f.tenant_weights:
            fc["tenant_weights"] = dict(f.tenant_weights)
        # a band a KEDA trigger reads: listed (no bounds of its own: the default's), so the
        # router's /scaling always reports it, 0 when empty
        unlisted = [b for b in spec.band_targets if b not in dict(f.bands)]
        if unlisted:
            fc["bands"] = {int(b): {} for b in unlisted} | fc.get("bands", {})
        out["flow_control"] = fc
    if spec.scales_to_zero:
        out["served_models"] = [{"name": name, "start_timeout_s": f.start_timeout_seconds}
                                for name in spec.model.served_names]
    return out


def router_args(spec: InferenceServiceSpec, owner: Owner) -> list[str]:
    args = [*log_level_args(spec.router.pod.log_level or spec.log_level),
            "router", "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--discovery", "kubernetes", "--namespace", "$(POD_NAMESPACE)",
            "--label-selector", discovery_selector(owner), "--worker-port-name", HTTP_PORT_NAME,
            "--config", f"{CONFIG_DIR}/router.yaml", "--metrics-port", str(METRICS_PORT),
            "--drain-seconds", str(TERMINATION_GRACE_SECONDS - PRE_STOP_SECONDS
                                   - EXIT_SLACK_SECONDS)]
    if spec.router.api_keys_secret:
        args += ["--api-keys", f"{AUTH_DIR}/api-keys"]
    if spec.router.admin_api_keys_secret:
        args += ["--admin-api-keys", f"{ADMIN_AUTH_DIR}/admin-api-keys"]
    if spec.kv_transfer.tls_secret:  # the workers' gRPC requires client certificates
        args += ["--grpc-tls-dir", TLS_DIR]
    args += router_peer_pull_args(spec.kv_cache)
    return args + epp_args(spec, owner) + security_args(spec, owner)


def render_router(spec: InferenceServiceSpec, owner: Owner, image: str,
                  operator: OperatorPeer | None = None,
                  worker_image: str | None = None,
                  members: Sequence[Member] = ()) -> list[dict[str, Any]]:
    """`image`: the router's (`router.image` wins); `worker_image`: the decode pool's, which
    holds a `file://` or the bundled model for the tokenizer init container; `members`: the
    InferenceServices attached to it, a tokenizer init container each. In gateway mode
    the same objects are the endpoint picker's, named NAME-epp (`render.gateway`)."""
    name = epp_name(owner) if gateway_mode(spec) else router_name(owner)
    worker_image = worker_image or image
    image = spec.router.pod.image or image
    text = yaml.safe_dump(router_config(spec, owner, members), sort_keys=True)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": metadata(owner, f"{name}-config", ROUTER_COMPONENT),
                  "data": {"router.yaml": text}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": metadata(owner, name, ROUTER_COMPONENT)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata(owner, name, ROUTER_COMPONENT),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["list", "watch"]}, *epp_rules(spec)]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": metadata(owner, name, ROUTER_COMPONENT),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                           "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name,
                             "namespace": owner.namespace}]}
    volumes, mounts = scratch_volumes()
    scratch = list(mounts)
    model = router_model(spec.model, image, worker_image, mounts)
    for i, m in enumerate(members, 1):
        more = router_model(m.spec.model, image, m.worker_image or worker_image, scratch,
                            f"-{i}")
        model.volumes += more.volumes
        model.mounts += more.mounts
        model.init_containers += more.init_containers
    volumes.append({"name": "config", "configMap": {"name": f"{name}-config"}})
    mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    volumes += model.volumes
    mounts += model.mounts
    if spec.router.api_keys_secret:
        volumes.append({"name": "api-keys", "secret": {
            "secretName": spec.router.api_keys_secret, "defaultMode": 0o440,
            "items": [{"key": spec.router.api_keys_key, "path": "api-keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": AUTH_DIR, "readOnly": True})
    if spec.router.admin_api_keys_secret:
        volumes.append({"name": "admin-api-keys", "secret": {
            "secretName": spec.router.admin_api_keys_secret, "defaultMode": 0o440,
            "items": [{"key": spec.router.admin_api_keys_key, "path": "admin-api-keys"}]}})
        mounts.append({"name": "admin-api-keys", "mountPath": ADMIN_AUTH_DIR,
                       "readOnly": True})
    if spec.kv_transfer.tls_secret:
        volumes.append({"name": "grpc-tls", "secret": {
            "secretName": spec.kv_transfer.tls_secret, "defaultMode": 0o440}})
        mounts.append({"name": "grpc-tls", "mountPath": TLS_DIR, "readOnly": True})
    keys = spec.router.guardrails.key_volume() if spec.router.guardrails else None
    if keys is not None:  # classifiers' API keys: router.yaml's api_key_file paths
        volumes.append(keys[0])
        mounts.append(keys[1])
    auth_volume, auth_mount = worker_auth_mount(spec, owner)
    volumes.append(auth_volume)
    mounts.append(auth_mount)
    container: dict[str, Any] = {
        "name": "router", "image": image, "command": ["tandem"],
        "args": router_args(spec, owner),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT,
                   "protocol": "TCP"}],
        "env": base_env() + redis_env(spec, owner),
        "readinessProbe": http_probe("/ready", period=5, failures=2),
        "livenessProbe": http_probe("/health", period=10, failures=3, timeout=5),
        "lifecycle": pre_stop(), "securityContext": container_security_context(),
        "volumeMounts": mounts, "terminationMessagePolicy": "FallbackToLogsOnError"}
    if spec.router.resources:
        container["resources"] = copy.deepcopy(spec.router.resources)
    if gateway_mode(spec):
        epp_pod(spec, container, volumes)
    meta = metadata(owner, name, ROUTER_COMPONENT)
    # a new router.yaml or key Secret rolls the routers (both are read at start)
    admin = ((spec.router.admin_api_keys_secret, spec.router.admin_api_keys_key)
             if spec.router.admin_api_keys_secret else ())  # absent: the hash as before
    digest = config_hash(text, spec.router.api_keys_secret, spec.router.api_keys_key,
                         spec.kv_transfer.tls_secret, *admin)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels(owner, ROUTER_COMPONENT)},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": {**meta["labels"], **router_pod_labels(operator)},
                             "annotations": {CONFIG_HASH: digest,
                                             **scrape_annotations(METRICS_PORT)}},
                "spec": {"serviceAccountName": name, "enableServiceLinks": False,
                         "securityContext": pod_security_context(),
                         "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                         "initContainers": model.init_containers,
                         "containers": [container], "volumes": volumes}}}}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": metadata(owner, name, ROUTER_COMPONENT),
               "spec": {"type": spec.router.service_type,
                        "selector": labels(owner, ROUTER_COMPONENT),
                        "ports": [{"name": HTTP_PORT_NAME, "port": HTTP_PORT,
                                   "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]}}
    if gateway_mode(spec):
        service = epp_service(spec, owner)
    return [account, role, binding, config_map, deployment, service,
            pdb(owner, name, ROUTER_COMPONENT)]
