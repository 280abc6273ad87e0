"""The operator's Kubernetes client: credentials, and create-or-patch (server-side apply),
list, patch and delete of the kinds `render` produces, as plain dicts.

Writes are server-side apply (`PATCH` with `application/apply-patch+yaml`, field manager
`tandem-operator`, `force`): one idempotent request per child whether it exists or not; the
API server keeps unchanged objects as they are and drops fields a new render no longer sets.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tandem.protocol.labels import SERVICE_LABEL

logger = logging.getLogger(__name__)

FIELD_MANAGER = "tandem-operator"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
PLURAL = "inferenceservices"  # crds/inferenceservice.yaml
KubeError = (ApiException, HTTPError, OSError)  # what a handler turns into a TemporaryError


@dataclass(frozen=True)
class Kind:
    api: type  # a typed API of the client, or CustomObjectsApi when `group` is set
    snake: str  # e.g. "deployment": patch_namespaced_deployment ...
    group: str = ""  # custom resources only
    version: str = ""
    plural: str = ""


KINDS = {
    "ServiceAccount": Kind(client.CoreV1Api, "service_account"),
    "Role": Kind(client.RbacAuthorizationV1Api, "role"),
    "RoleBinding": Kind(client.RbacAuthorizationV1Api, "role_binding"),
    "ConfigMap": Kind(client.CoreV1Api, "config_map"),
    "Deployment": Kind(client.AppsV1Api, "deployment"),
    "Service": Kind(client.CoreV1Api, "service"),
    "PodDisruptionBudget": Kind(client.PolicyV1Api, "pod_disruption_budget"),
    "HorizontalPodAutoscaler": Kind(client.AutoscalingV2Api, "horizontal_pod_autoscaler"),
    "ServiceMonitor": Kind(client.CustomObjectsApi, "custom_object", "monitoring.coreos.com",
                           "v1", "servicemonitors"),
    "NetworkPolicy": Kind(client.NetworkingV1Api, "network_policy"),
    "Certificate": Kind(client.CustomObjectsApi, "custom_object", "cert-manager.io", "v1",
                        "certificates"),
    "Issuer": Kind(client.CustomObjectsApi, "custom_object", "cert-manager.io", "v1",
                   "issuers"),
    # multi-node tensor-parallel pools (render.multinode); needs the LWS controller's CRD
    "LeaderWorkerSet": Kind(client.CustomObjectsApi, "custom_object", "leaderworkerset.x-k8s.io",
                            "v1", "leaderworkersets"),
    # router.mode gateway (render.gateway); need the Gateway API Inference Extension's and
    # the Gateway API's CRDs
    "InferencePool": Kind(client.CustomObjectsApi, "custom_object",
                          "inference.networking.k8s.io", "v1", "inferencepools"),
    "HTTPRoute": Kind(client.CustomObjectsApi, "custom_object", "gateway.networking.k8s.io",
                      "v1", "httproutes"),
    # autoscaling.mode: keda (render.keda); needs KEDA's CRDs and operator
    "ScaledObject": Kind(client.CustomObjectsApi, "custom_object", "keda.sh", "v1alpha1",
                         "scaledobjects"),
}
WORKLOADS = ("Deployment", "LeaderWorkerSet")  # what runs a pool (status, scaling)
# created once, never applied, listed or read (the worker-auth key: RBAC `create` only)
CREATE_ONLY = {"Secret": Kind(client.CoreV1Api, "secret")}


def load_config() -> client.Configuration:
    """In-cluster (the operator's ServiceAccount), else the kubeconfig named by $KUBECONFIG
    at call time, else ~/.kube/config."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                client_configuration=cfg)
    return cfg


def connection(cfg: client.Configuration) -> dict[str, Any]:
    """kopf's `ConnectionInfo` fields for the same credentials (kopf has its own client)."""
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization") or ""
    scheme, _, token = header.rpartition(" ")
    return {"server": cfg.host, "ca_path": cfg.ssl_ca_cert, "insecure": not cfg.verify_ssl,
            "username": cfg.username or None, "password": cfg.password or None,
            "scheme": scheme or None, "token": token or None,
            "certificate_path": cfg.cert_file, "private_key_path": cfg.key_file}


def applies_field(obj: Mapping[str, Any], manager: str, *path: str) -> bool:
    """`manager`'s server-side apply owns the field at `path` (e.g. "spec", "replicas") of
    `obj`, per its `metadata.managedFields`."""
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        node = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, dict) else None
        if node is not None:
            return True
    return False


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


class Kube:
    """Typed-API calls by kind name, answering plain dicts (no model classes)."""

    def __init__(self, api_client: client.ApiClient, timeout_s: float = 30.0,
                 fence: Callable[[], None] | None = None) -> None:
        """`fence`: called before every write, raises to refuse it (`leader.Elector.fence`:
        a replica whose leader lease has run out writes nothing)."""
        self.api_client, self.timeout_s, self.fence = api_client, timeout_s, fence

    def _call(self, verb: str, kind: str, namespace: str, *args: Any, **kw: Any) -> Any:
        k = KINDS.get(kind) or CREATE_ONLY[kind]
        if self.fence is not None and verb not in ("list", "read"):
            self.fence()
        api = k.api(self.api_client)
        head = (k.group, k.version, namespace, k.plural) if k.group else ()
        fn = getattr(api, f"{verb}_namespaced_{k.snake}")
        if not k.group:  # typed APIs: (name, namespace, body) / (namespace, body)
            args = ((namespace, *args) if verb == "create" else (namespace,) if verb == "list"
                    else (*args[:1], namespace, *args[1:]))
        resp = fn(*head, *args, _preload_content=False, _request_timeout=self.timeout_s, **kw)
        return json.loads(resp.data or b"{}")

    def apply(self, doc: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply; a custom kind the cluster does not serve (its CRD missing)
        answers 404 with a reason that says so."""
        meta = doc["metadata"]
        try:
            return self._call("patch", doc["kind"], meta["namespace"], meta["name"], doc,
                              field_manager=manager, force=True, _content_type=APPLY)
        except ApiException as exc:
            k = KINDS.get(doc["kind"])
            if exc.status != 404 or k is None or not k.group:
                raise
            raise ApiException(status=404, reason=(
                f"{doc['kind']} {meta['name']}: this cluster does not serve {k.group}/"
                f"{k.version} {k.plural} (install its CRD and controller)")) from exc

    def create(self, doc: dict[str, Any]) -> bool:
        """Create `doc` unless an object of that name exists (409: left as it is, unread).
        True when this call created it."""
        try:
            self._call("create", doc["kind"], doc["metadata"]["namespace"], doc,
                       field_manager=FIELD_MANAGER)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def patch(self, kind: str, namespace: str, name: str, body: dict[str, Any],
              manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """A JSON merge patch: only the fields in `body` (e.g. a Deployment's replicas)."""
        return self._call("patch", kind, namespace, name, body, field_manager=manager,
                          _content_type=MERGE)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("delete", kind, namespace, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def list_owned(self, kind: str, namespace: str, owner: str, uid: str) -> list[dict[str, Any]]:
        """The children of one InferenceService: its label, and its controller reference (a
        label alone could be copied onto anything). A kind the server lacks has none."""
        try:
            items = self._call("list", kind, namespace,
                               label_selector=f"{SERVICE_LABEL}={owner}").get("items", [])
        except ApiException as exc:
            if exc.status == 404:  # e.g. no Prometheus Operator: no ServiceMonitor kind
                return []
            raise
        return [i for i in items if owned_by(i, uid)]


def describe(exc: BaseException) -> str:
    """A one-line reason for a failed API call (conditions, events, logs)."""
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message")
        except ValueError:
            message = None
        return f"{exc.status} {exc.reason}: {message or exc.body or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
