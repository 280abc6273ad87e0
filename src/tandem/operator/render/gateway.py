"""`router.mode: gateway` and router groups (`router.attachTo`).

Gateway mode: an existing Gateway API gateway is the front door and Tandem's router runs as
its endpoint picker (EPP): `tandem router --ext-proc-port PORT`, the router Deployment of
`render.router` under the name NAME-epp (same config, keys, security, discovery), its pods
probed through the gRPC health services (`liveness`, `readiness`; HTTP `/health`, `/ready`
when ext_proc is TLS: kubelet gRPC probes have none; with `tls.clientAuth` mutual TLS: the
`caSecretName` Secret's `ca.crt` mounted for `--ext-proc-tls-client-ca`, each of
`allowedNames` an `--ext-proc-allowed-client`), its Service NAME-epp exposing only the
gRPC port (`grpc-ext-proc`, appProtocol `http2` unless ext_proc is TLS) and the metrics
port. The `InferencePool` NAME (`inference.networking.k8s.io/v1`) selects
`INFERENCE_POOL_LABEL=NAME`: the decode or aggregated pods (a multi-node pool's leaders) of
NAME and of every InferenceService attached to it. Prefill pods are never in the pool: the
EPP names them itself, and a gateway falling open must not send a client request to one.
`endpointPickerRef` names NAME-epp's gRPC port with `failureMode`. The picker runs with
`--inference-pool NAME` and its Role may also list and watch `inferenceobjectives`
(`inference.networking.x-k8s.io`): it follows the InferenceObjectives whose poolRef is NAME
(their priorities win over `router.gateway.objectives`). With
`router.gateway.parentRefs`, an example `HTTPRoute` NAME (`gateway.networking.k8s.io/v1`)
routes `/` of those Gateways to the pool.

Router groups: every worker Service carries `ROUTER_GROUP_LABEL` = the InferenceService whose
router serves it (its own name, or `router.attachTo`), and that router's discovery selects
`app.kubernetes.io/component=worker,tandem.dev/router-group=NAME`. An attached
InferenceService's worker pods carry the label too (its router's NetworkPolicy egress selects
it), and its decode or aggregated pods `INFERENCE_POOL_LABEL` (inert unless its router is in
gateway mode). The router fetches each attached model's tokenizer (`Member`, from the
operator's index of `router.attachTo`). An attachTo chain (attached to a service that is
itself attached) is not followed: nothing serves the end of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator.render.common import (
    HTTP_PORT,
    METRICS_PORT,
    METRICS_PORT_NAME,
    Owner,
    http_probe,
    labels,
    metadata,
)
from tandem.operator.render.multinode import LWS_KIND, pod_templates
from tandem.operator.render.workload import Workload
from tandem.operator.spec import InferenceServiceSpec
from tandem.protocol.labels import (
    COMPONENT_LABEL,
    INFERENCE_POOL_LABEL,
    ROUTER_COMPONENT,
    ROUTER_GROUP_LABEL,
    WORKER_COMPONENT,
)

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"
HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"
HTTP_ROUTE_KIND = "HTTPRoute"
EXT_PROC_PORT_NAME = "ext-proc"  # the EPP container's port
EXT_PROC_SERVICE_PORT_NAME = "grpc-ext-proc"  # its Service port (Istio: protocol by prefix)
EXT_PROC_APP_PROTOCOL = "http2"
EXT_PROC_TLS_DIR = "/etc/tandem/ext-proc-tls"
EXT_PROC_CLIENT_CA_DIR = "/etc/tandem/ext-proc-client-ca"  # tls.clientAuth.caSecretName
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # also a health service
# what the picker's Role adds: following its pool's InferenceObjectives (the chart's
# operator ClusterRole holds the same, as RBAC lets an operator grant only what it holds)
EPP_RULES = [{"apiGroups": ["inference.networking.x-k8s.io"],
              "resources": ["inferenceobjectives"], "verbs": ["list", "watch"]}]


@dataclass(frozen=True)
class Member:
    """An InferenceService attached to this one's router (`router.attachTo`): the router
    fetches its model's tokenizer too."""

    name: str
    spec: InferenceServiceSpec
    worker_image: str | None = None  # its decode pool's (a file:// or bundled tokenizer)


def gateway_mode(spec: InferenceServiceSpec) -> bool:
    """This InferenceService runs an endpoint picker (never when attached: refused)."""
    return spec.router.gateway is not None


def attached(spec: InferenceServiceSpec) -> bool:
    return spec.router.attach_to is not None


def router_group(spec: InferenceServiceSpec, owner: Owner) -> str:
    """The InferenceService whose router (or EPP) serves this one's workers."""
    return spec.router.attach_to or owner.name


def router_owner(spec: InferenceServiceSpec, owner: Owner) -> Owner:
    """That InferenceService as an `Owner` for label selectors (its uid is not known here)."""
    return owner if spec.router.attach_to is None else Owner(
        spec.router.attach_to, owner.namespace, "")


def epp_name(owner: Owner) -> str:
    return f"{owner.name}-epp"


def discovery_selector(owner: Owner) -> str:
    """The router's `--label-selector`: every worker Service of its group."""
    return f"{COMPONENT_LABEL}={WORKER_COMPONENT},{ROUTER_GROUP_LABEL}={owner.name}"


def epp_args(spec: InferenceServiceSpec, owner: Owner) -> list[str]:
    """`tandem router` flags of the endpoint picker (none in mode router): its port, the
    InferencePool it serves (named as the InferenceService), TLS."""
    g = spec.router.gateway
    if g is None:
        return []
    args = ["--ext-proc-port", str(g.ext_proc_port), "--inference-pool", owner.name]
    if g.tls_secret:
        args += ["--ext-proc-tls-cert", f"{EXT_PROC_TLS_DIR}/tls.crt",
                 "--ext-proc-tls-key", f"{EXT_PROC_TLS_DIR}/tls.key"]
    if g.client_ca_secret:
        args += ["--ext-proc-tls-client-ca", f"{EXT_PROC_CLIENT_CA_DIR}/ca.crt"]
        for name in g.client_names:
            args += ["--ext-proc-allowed-client", name]
    return args


def epp_rules(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The rules the picker's Role adds to the router's (none in mode router)."""
    return [dict(r) for r in EPP_RULES] if gateway_mode(spec) else []


def grpc_probe(port: int, service: str, period: int, failures: int,
               timeout: int = 3) -> dict[str, Any]:
    return {"grpc": {"port": port, "service": service}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


def epp_pod(spec: InferenceServiceSpec, container: dict[str, Any],
            volumes: list[dict[str, Any]]) -> None:
    """The router container and volumes (`render.router`) made the EPP's, in place: the
    gRPC port, gRPC probes (HTTP with TLS), the TLS Secret mounted."""
    g = spec.router.gateway
    assert g is not None
    container["ports"].append({"name": EXT_PROC_PORT_NAME, "containerPort": g.ext_proc_port,
                               "protocol": "TCP"})
    if g.tls_secret:
        volumes.append({"name": "ext-proc-tls", "secret": {
            "secretName": g.tls_secret, "defaultMode": 0o440,
            "items": [{"key": "tls.crt", "path": "tls.crt"},
                      {"key": "tls.key", "path": "tls.key"}]}})
        container["volumeMounts"].append({"name": "ext-proc-tls",
                                          "mountPath": EXT_PROC_TLS_DIR, "readOnly": True})
        if g.client_ca_secret:  # mutual TLS: the gateway's client CA
            volumes.append({"name": "ext-proc-client-ca", "secret": {
                "secretName": g.client_ca_secret, "defaultMode": 0o440,
                "items": [{"key": "ca.crt", "path": "ca.crt"}]}})
            container["volumeMounts"].append({"name": "ext-proc-client-ca", "readOnly": True,
                                              "mountPath": EXT_PROC_CLIENT_CA_DIR})
        container["readinessProbe"] = http_probe("/ready", period=5, failures=2)
        container["livenessProbe"] = http_probe("/health", period=10, failures=3, timeout=5)
        return
    container["readinessProbe"] = grpc_probe(g.ext_proc_port, "readiness", 5, 2)
    container["livenessProbe"] = grpc_probe(g.ext_proc_port, "liveness", 10, 3, 5)


def epp_service(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any]:
    """ClusterIP: the gRPC port the InferencePool names, and /metrics (/scaling)."""
    g = spec.router.gateway
    assert g is not None
    grpc: dict[str, Any] = {"name": EXT_PROC_SERVICE_PORT_NAME, "port": g.ext_proc_port,
                            "targetPort": EXT_PROC_PORT_NAME, "protocol": "TCP"}
    if not g.tls_secret:  # cleartext HTTP/2; with TLS the gateway's own settings say so
        grpc["appProtocol"] = EXT_PROC_APP_PROTOCOL
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, epp_name(owner), ROUTER_COMPONENT),
            "spec": {"type": "ClusterIP", "selector": labels(owner, ROUTER_COMPONENT),
                     "ports": [grpc, {"name": METRICS_PORT_NAME, "port": METRICS_PORT,
                                      "targetPort": METRICS_PORT_NAME, "protocol": "TCP"}]}}


def inference_pool(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any]:
    g = spec.router.gateway
    assert g is not None
    return {"apiVersion": INFERENCE_POOL_API, "kind": INFERENCE_POOL_KIND,
            "metadata": metadata(owner, owner.name, "inference-pool"),
            "spec": {"selector": {"matchLabels": {INFERENCE_POOL_LABEL: owner.name}},
                     "targetPorts": [{"number": HTTP_PORT}],
                     "endpointPickerRef": {"kind": "Service", "name": epp_name(owner),
                                           "port": {"number": g.ext_proc_port},
                                           "failureMode": g.failure_mode}}}


def http_route(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any] | None:
    """The example route (None without parentRefs): `/` of the parents to the pool."""
    g = spec.router.gateway
    if g is None or not g.parent_refs:
        return None
    return {"apiVersion": HTTP_ROUTE_API, "kind": HTTP_ROUTE_KIND,
            "metadata": metadata(owner, owner.name, "http-route"),
            "spec": {"parentRefs": [dict(r) for r in g.parent_refs],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                                "backendRefs": [{"group": "inference.networking.k8s.io",
                                                 "kind": INFERENCE_POOL_KIND,
                                                 "name": owner.name}],
                                "timeouts": {"request": f"{g.request_timeout_seconds}s"}}]}}


def gateway_children(spec: InferenceServiceSpec, owner: Owner) -> list[dict[str, Any]]:
    """The InferencePool and the HTTPRoute (mode gateway; after the EPP's Service)."""
    if not gateway_mode(spec):
        return []
    route = http_route(spec, owner)
    return [inference_pool(spec, owner), *([route] if route else [])]


def label_group(docs: list[dict[str, Any]], spec: InferenceServiceSpec, owner: Owner,
                workloads: list[Workload]) -> None:
    """In place: the group label on the pools' Services, and on an attached service's pod
    templates; the pool label on the client-facing pods (decode / aggregated; an LWS's
    leaders) of an attached service or of one in gateway mode."""
    group = router_group(spec, owner)
    by_name = {w.name: w for w in workloads}
    for doc in docs:
        w = by_name.get(doc["metadata"]["name"])
        if w is None:
            continue
        if doc["kind"] == "Service":
            doc["metadata"]["labels"][ROUTER_GROUP_LABEL] = group
        elif doc["kind"] == w.kind:
            templates = pod_templates(doc)
            for i, template in enumerate(templates):
                lab = template["metadata"]["labels"]
                if attached(spec):
                    lab[ROUTER_GROUP_LABEL] = group
                leader = doc["kind"] != LWS_KIND or i == 0
                if leader and w.role != "prefill" and (attached(spec) or gateway_mode(spec)):
                    lab[INFERENCE_POOL_LABEL] = group
