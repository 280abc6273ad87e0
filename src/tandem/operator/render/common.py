"""What every rendered child shares: the owner reference, labels, names, the hardened pod and
container security contexts, writable scratch volumes, probes and the config hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.fields import HASH_IF_SET_KEY
from tandem.protocol.labels import (
    COMPONENT_LABEL,
    GROUP,
    MANAGED_BY_LABEL,
    ROLE_LABEL,
    SERVICE_LABEL,
)

API_VERSION = f"{GROUP}/v1alpha1"
KIND = "InferenceService"
DEFAULT_IMAGE = "ghcr.io/tandem-llm/tandem:0.1.0"  # the operator passes its own default
IMAGE_ENV = "TANDEM_IMAGE"  # set by the chart on the operator: the children's default image
ROUTER_IMAGE_ENV = "TANDEM_ROUTER_IMAGE"  # the routers' (the torch-free `control` target)
WORKER_IMAGE_ENV = "TANDEM_WORKER_IMAGE"  # CPU pools' (the Dockerfile's default target)
WORKER_CUDA_IMAGE_ENV = "TANDEM_WORKER_CUDA_IMAGE"  # GPU pools' (the `worker-cuda` target)
PULL_POLICY_ENV = "TANDEM_IMAGE_PULL_POLICY"
HTTP_PORT = 8000  # worker and router HTTP (named "http": the router's --worker-port-name)
GRPC_PORT = 50051  # worker gRPC: KV events, load, KV transfer
HTTP_PORT_NAME = "http"
GRPC_PORT_NAME = "grpc"
# the routers' /metrics, on a port of its own (`--metrics-port`, no key): /metrics on http
# needs an API key once keys are configured, which Prometheus does not send
METRICS_PORT = 9090
METRICS_PORT_NAME = "metrics"
RUN_AS = 10001  # the image's unprivileged user and group
TLS_DIR = "/etc/tandem/tls"  # the kvTransfer TLS Secret, in workers and routers
CACHE_DIR = "/cache"  # emptyDir: tokenizer and kernel caches (TANDEM_CACHE_DIR), HF_HOME
CONFIG_HASH = f"{GROUP}/config-hash"  # pod-template annotation: changes roll the pods
PRE_STOP_SECONDS = 5  # endpoints leave the routers' view before the pod stops admitting


@dataclass(frozen=True)
class Owner:
    """The InferenceService that owns every child (deleting it deletes them)."""

    name: str
    namespace: str
    uid: str
    api_version: str = API_VERSION
    kind: str = KIND


def router_image_from_env(environ: Mapping[str, str]) -> str | None:
    """The routers' default image (`TANDEM_ROUTER_IMAGE`); None: the workers' image."""
    return environ.get(ROUTER_IMAGE_ENV) or None


def worker_images_from_env(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(CPU pools' image, GPU pools' image): `TANDEM_WORKER_IMAGE` and
    `TANDEM_WORKER_CUDA_IMAGE`; None: the children's default image (`TANDEM_IMAGE`)."""
    return environ.get(WORKER_IMAGE_ENV) or None, environ.get(WORKER_CUDA_IMAGE_ENV) or None


def image_from_env(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """(image, imagePullPolicy or None) from the operator's environment (`os.environ`)."""
    return environ.get(IMAGE_ENV) or DEFAULT_IMAGE, environ.get(PULL_POLICY_ENV) or None


def labels(owner: Owner, component: str, role: str | None = None) -> dict[str, str]:
    """Selector labels: the ones `tandem.router.discovery.k8s` selects on."""
    out = {SERVICE_LABEL: owner.name, COMPONENT_LABEL: component}
    if role is not None:
        out[ROLE_LABEL] = role
    return out


def all_labels(owner: Owner, component: str, role: str | None = None) -> dict[str, str]:
    return {**labels(owner, component, role), "app.kubernetes.io/name": "tandem",
            "app.kubernetes.io/instance": owner.name, MANAGED_BY_LABEL: "tandem-operator"}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": owner.api_version, "kind": owner.kind, "name": owner.name,
            "uid": owner.uid, "controller": True, "blockOwnerDeletion": True}


def metadata(owner: Owner, name: str, component: str, role: str | None = None,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace,
                            "labels": all_labels(owner, component, role),
                            "ownerReferences": [owner_reference(owner)]}
    if annotations:
        meta["annotations"] = annotations
    return meta


def log_level_args(level: str | None) -> list[str]:
    """`tandem`'s own flag, ahead of the subcommand: nothing for an unset level (the CLI's
    INFO; pods rendered before the field existed stay as they were)."""
    return ["--log-level", level] if level else []


def _hashed(part: Any) -> Any:
    """A dataclass as a dict, less its `HASH_IF_SET` fields at their defaults."""
    if not dataclasses.is_dataclass(part) or isinstance(part, type):
        return part
    out = dataclasses.asdict(part)
    for f in dataclasses.fields(part):
        if f.metadata.get(HASH_IF_SET_KEY) and getattr(part, f.name) == f.default:
            del out[f.name]
    return out


def config_hash(*parts: Any) -> str:
    """A short, stable digest of dataclasses / JSON-able values (a part's `HASH_IF_SET`
    fields count only when set)."""
    data = [_hashed(p) for p in parts]
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def scratch_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for the writable dirs a read-only root filesystem still needs."""
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    return volumes, mounts


def base_env() -> list[dict[str, Any]]:
    return [{"name": "TANDEM_CACHE_DIR", "value": CACHE_DIR},
            {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAMESPACE",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]


def http_probe(path: str, period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": HTTP_PORT_NAME}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


def pre_stop() -> dict[str, Any]:
    """Keep serving while the endpoint removal reaches every router, then get SIGTERM."""
    return {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}}


def scrape_annotations(port: int = HTTP_PORT) -> dict[str, str]:
    """Annotation-based discovery (Prometheus' pod role): /metrics on `port`."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def pdb(owner: Owner, name: str, component: str, role: str | None = None, *,
        selector: Mapping[str, str] | None = None) -> dict[str, Any]:
    """At most one pod of `selector` (default: the component's and role's selector labels)
    voluntarily down at a time (drains, node upgrades); for a LeaderWorkerSet's groups,
    one group, since a lost pod restarts its group."""
    match = dict(selector) if selector is not None else labels(owner, component, role)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(owner, name, component, role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": match}}}
