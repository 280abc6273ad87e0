"""The security side of an InferenceService's pods and children.

* Worker-plane signing (`protocol.signing`): the Secret `<isvc>-worker-auth` (key `key`, 32 random
  bytes; `worker_auth_secret`, created by `reconcile` only when absent and never rendered
  into the applied set, so no re-apply overwrites it), or `security.workerAuthSecretName`;
  mounted as a directory (no subPath: a rotated key reaches the pods, which re-read it) at
  `WORKER_AUTH_DIR` in the router and every worker, `--worker-auth-key-file` pointing at it.
* mTLS identity (`protocol.tls`): with `kvTransfer.tlsSecret`, `--grpc-tls-server-name
  NAME.NS.tandem.internal`; with `kvTransfer.tlsIssuerRef`, a cert-manager `Certificate`
  `<isvc>-grpc-tls` for exactly that name, written into tlsSecret (a namespaced Issuer by
  default; a ClusterIssuer, which any namespace could use to mint any name, only where the
  chart allows it: `admission`); with `kvTransfer.tlsOwnCA`, from a CA of the
  InferenceService's own (self-signed Issuer -> CA Certificate -> CA Issuer, all in its
  namespace): the Secret's ca.crt, which the peers trust, is that CA alone, so two
  namespaces' (or two InferenceServices') identities never verify each other.
* Redis: `router.redisUrlSecretRef` -> env `TANDEM_REDIS_URL` from the Secret, and
  router.yaml `redis` (and `index`) `env:TANDEM_REDIS_URL`: the URL never enters a ConfigMap.
* NetworkPolicies (`security.networkPolicy.enabled`, default on): worker pods admit only
  this InferenceService's routers (http, grpc), its own workers (grpc; every TCP port with the
  torch backend, whose TCPStore and gloo/NCCL sockets take ephemeral ports), the operator of
  the release (http: the autoscaler scrapes /metrics) and `monitoring.prometheus` (http);
  the pods of a multi-node pool's groups admit each other on every port (`NAME-POOL-group`:
  Ray's GCS and workers, NCCL sockets);
  router pods admit clients on http from anywhere, or only `router.allowedClients` (then
  also the Prometheus peer), and `monitoring.prometheus` alone on `metrics` (`METRICS_PORT`:
  /metrics without a key; no one else, the operator included, which scrapes workers
  only). Kubelet probes come from the node, which policies do not
  govern on the common CNIs.
* Router groups and gateway mode (`render.gateway`): an attached InferenceService renders
  no router policy, and its workers admit the routers of `router.attachTo`; in gateway mode
  the routers (the endpoint picker, NAME-epp) admit the gateway's proxies
  (`router.gateway.allowedClients`, else anyone) on their gRPC port only, no http, and
  NAME-inference-pool admits them on http to the InferencePool's pods (Ingress only).
* Egress (the same policies, `policyTypes: [Ingress, Egress]`): every pod may reach DNS
  (kube-system's kube-dns pods, UDP and TCP 53); workers their own peers (grpc; every port
  with the torch backend; a multi-node group every port within the group), and HTTPS (443)
  anywhere but `METADATA_RANGES` only when an init container downloads (`hf://` model or
  adapters); routers their own workers (http, grpc), the Kubernetes API (443 and 6443: their
  EndpointSlice discovery; the Hub's tokenizer files on 443 too) anywhere but
  `METADATA_RANGES`, the workers of the InferenceServices attached to them (pods labelled
  `tandem.dev/router-group=NAME`: http, grpc), and their Redis: the chart's Redis pods
  (`router.managedRedis`, the port from `TANDEM_REDIS_ADDRESS`) or, for
  `redisUrlSecretRef`, TCP 6379 anywhere but `METADATA_RANGES`. Nothing ever reaches the
  cloud metadata services (169.254.169.254, fd00:ec2::254, 100.100.100.200) nor link-local
  addresses.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.operator.render.common import (
    GRPC_PORT_NAME,
    HTTP_PORT_NAME,
    METRICS_PORT_NAME,
    Owner,
    labels,
    metadata,
)
from tandem.operator.render.gateway import (
    EXT_PROC_PORT_NAME,
    attached,
    gateway_mode,
    router_owner,
)
from tandem.operator.render.keda import reads_scaling
from tandem.operator.render.workload import Workload, pool_workloads
from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.spec_security import IssuerRef, SecretKeyRef
from tandem.protocol import engine_flags as flags
from tandem.protocol.labels import (
    COMPONENT_LABEL,
    GROUP,
    INFERENCE_POOL_LABEL,
    ROUTER_COMPONENT,
    ROUTER_GROUP_LABEL,
    WORKER_COMPONENT,
)
from tandem.protocol.tls import peer_identity

WORKER_AUTH_DIR = "/etc/tandem/worker-auth"
WORKER_AUTH_KEY = "key"  # the Secret's data key, and the file name under WORKER_AUTH_DIR
WORKER_AUTH_BYTES = 32
REDIS_URL_ENV = "TANDEM_REDIS_URL"
# on router (and operator) pods: the Helm release of the operator that deployed them, which
# the chart's Redis NetworkPolicy admits
OPERATOR_RELEASE_LABEL = f"{GROUP}/operator-release"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
OPERATOR_COMPONENT = "operator"
OPERATOR_NAMESPACE_ENV = "TANDEM_OPERATOR_NAMESPACE"
OPERATOR_RELEASE_ENV = "TANDEM_OPERATOR_RELEASE"
CERT_USAGES = ("server auth", "client auth", "digital signature", "key encipherment")
REDIS_ADDRESS_ENV = "TANDEM_REDIS_ADDRESS"  # the chart's Redis, host:port (`redis_acl`)
BYO_REDIS_PORT = 6379  # redisUrlSecretRef: the URL is in a Secret the operator cannot read
KUBE_API_PORTS = (443, 6443)
DNS_PORT = 53
# link-local (every cloud's instance metadata: 169.254.169.254, EKS pod identity
# 169.254.170.23) and the metadata addresses outside it (AWS IPv6, Alibaba)
METADATA_RANGES = {4: ("169.254.0.0/16", "100.100.100.200/32"),
                   6: ("fe80::/10", "fd00:ec2::254/128")}


@dataclass(frozen=True)
class OperatorPeer:
    """Who runs the operator (from the chart's env): its namespace and Helm release; either
    None (e.g. run from a laptop) leaves it out of the NetworkPolicies and labels."""

    namespace: str | None = None  # TANDEM_OPERATOR_NAMESPACE
    release: str | None = None  # TANDEM_OPERATOR_RELEASE
    redis_port: int | None = None  # the chart's Redis (TANDEM_REDIS_ADDRESS), beside it


def operator_from_env(environ: Mapping[str, str]) -> OperatorPeer:
    """The chart sets them on the operator (`os.environ`); unset ones stay None."""
    port = (environ.get(REDIS_ADDRESS_ENV) or "").rpartition(":")[2]
    return OperatorPeer(environ.get(OPERATOR_NAMESPACE_ENV) or None,
                        environ.get(OPERATOR_RELEASE_ENV) or None,
                        int(port) if port.isdigit() else None)


# ---- worker-auth Secret -----------------------------------------------------------------

def worker_auth_secret_name(spec: InferenceServiceSpec, owner: Owner) -> str:
    return spec.security.worker_auth_secret_name or f"{owner.name}-worker-auth"


def worker_auth_secret(owner: Owner) -> dict[str, Any]:
    """A new key Secret for `reconcile` to create once (fresh random bytes every call)."""
    key = base64.b64encode(secrets.token_bytes(WORKER_AUTH_BYTES)).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(owner, f"{owner.name}-worker-auth", "worker-auth"),
            "data": {WORKER_AUTH_KEY: key}}


def worker_auth_mount(spec: InferenceServiceSpec,
                      owner: Owner) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount): the key Secret as a directory; a missing `key` fails the pod start."""
    volume = {"name": "worker-auth", "secret": {
        "secretName": worker_auth_secret_name(spec, owner), "defaultMode": 0o440,
        "items": [{"key": WORKER_AUTH_KEY, "path": WORKER_AUTH_KEY}]}}
    return volume, {"name": "worker-auth", "mountPath": WORKER_AUTH_DIR, "readOnly": True}


def security_args(spec: InferenceServiceSpec, owner: Owner) -> list[str]:
    """Flags every router and worker gets: the signing key, and the gRPC peer identity."""
    args = [flags.WORKER_AUTH_KEY_FILE, f"{WORKER_AUTH_DIR}/{WORKER_AUTH_KEY}"]
    if spec.kv_transfer.tls_secret:
        args += [flags.GRPC_TLS_SERVER_NAME, peer_identity(owner.name, owner.namespace)]
    return args


def worker_security_args(spec: InferenceServiceSpec, owner: Owner) -> list[str]:
    """A worker's: every one has the key, so it serves only requests its routers signed
    (no unmetered inference for whatever reaches a pod)."""
    return security_args(spec, owner) + [flags.REQUIRE_SIGNED_REQUESTS]


# ---- cert-manager Certificate -----------------------------------------------------------

CERT_MANAGER = "cert-manager.io/v1"
CA_DAYS = 3650


def _issuer(owner: Owner, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": CERT_MANAGER, "kind": "Issuer",
            "metadata": metadata(owner, name, "grpc-tls"), "spec": spec}


def certificates(spec: InferenceServiceSpec, owner: Owner) -> list[dict[str, Any]]:
    """The gRPC identity's cert-manager objects, in apply order (issuers first)."""
    kv = spec.kv_transfer
    if not kv.tls_own_ca:
        cert = certificate(spec, owner)
        return [cert] if cert else []
    ca = f"{owner.name}-grpc-ca"
    root = _issuer(owner, f"{owner.name}-grpc-selfsigned", {"selfSigned": {}})
    ca_cert = {"apiVersion": CERT_MANAGER, "kind": "Certificate",
               "metadata": metadata(owner, ca, "grpc-tls"),
               "spec": {"isCA": True, "commonName": f"{owner.name}.{owner.namespace} gRPC CA",
                        "secretName": ca, "duration": f"{CA_DAYS * 24}h",
                        "privateKey": {"algorithm": "ECDSA", "size": 256},
                        "issuerRef": {"name": root["metadata"]["name"], "kind": "Issuer",
                                      "group": "cert-manager.io"}}}
    ca_issuer = _issuer(owner, ca, {"ca": {"secretName": ca}})
    leaf = certificate(spec, owner, IssuerRef(ca, "Issuer", "cert-manager.io"))
    assert leaf is not None
    return [root, ca_cert, ca_issuer, leaf]


def certificate(spec: InferenceServiceSpec, owner: Owner,
                issuer: IssuerRef | None = None) -> dict[str, Any] | None:
    kv = spec.kv_transfer
    issuer = issuer or kv.tls_issuer
    if issuer is None or not kv.tls_secret:
        return None
    return {"apiVersion": CERT_MANAGER, "kind": "Certificate",
            "metadata": metadata(owner, f"{owner.name}-grpc-tls", "grpc-tls"),
            "spec": {"secretName": kv.tls_secret,
                     "dnsNames": [peer_identity(owner.name, owner.namespace)],
                     "usages": list(CERT_USAGES),
                     "privateKey": {"algorithm": "RSA", "size": 2048,
                                    "rotationPolicy": "Always"},
                     "issuerRef": {"name": issuer.name, "kind": issuer.kind,
                                   "group": issuer.group}}}


# ---- Redis URL from a Secret ------------------------------------------------------------

def redis_key_prefix(owner: Owner) -> str:
    """The routers' `--redis-key-prefix` (router.yaml `redis_key_prefix`): namespace and
    name are DNS labels (no `:`), so no two InferenceServices share a key."""
    return f"tandem:{owner.namespace}:{owner.name}:"


def managed_redis_secret(owner: Owner) -> SecretKeyRef:
    """`router.managedRedis`: the URL Secret the operator writes (`operator.redis_acl`)."""
    return SecretKeyRef(f"{owner.name}-redis", "url")


def redis_ref(spec: InferenceServiceSpec, owner: Owner) -> SecretKeyRef | None:
    if spec.router.managed_redis:
        return managed_redis_secret(owner)
    return spec.router.redis_url_secret


def redis_env(spec: InferenceServiceSpec, owner: Owner) -> list[dict[str, Any]]:
    ref = redis_ref(spec, owner)
    if ref is None:
        return []
    return [{"name": REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name,
                                                                   "key": ref.key}}}]


def redis_config(spec: InferenceServiceSpec, owner: Owner) -> dict[str, str]:
    """router.yaml's `redis` / `index`: the environment variable, never the URL; and the key
    prefix of this InferenceService."""
    if redis_ref(spec, owner) is None:
        return {}
    value = f"env:{REDIS_URL_ENV}"
    return {"redis": value, "redis_key_prefix": redis_key_prefix(owner),
            **({"index": value} if spec.router.shared_index else {})}


def router_pod_labels(operator: OperatorPeer | None) -> dict[str, str]:
    return {OPERATOR_RELEASE_LABEL: operator.release} if operator and operator.release else {}


# ---- NetworkPolicies ---------------------------------------------------------------------

def _port(name: str) -> dict[str, Any]:
    return {"port": name, "protocol": "TCP"}


def _pods(owner: Owner, component: str) -> dict[str, Any]:
    """Pods of this InferenceService only (a peer without namespaceSelector: its namespace)."""
    return {"podSelector": {"matchLabels": labels(owner, component)}}


def operator_peer(operator: OperatorPeer | None) -> dict[str, Any] | None:
    if operator is None or not operator.namespace or not operator.release:
        return None
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: operator.namespace}},
            "podSelector": {"matchLabels": {COMPONENT_LABEL: OPERATOR_COMPONENT,
                                            OPERATOR_RELEASE_LABEL: operator.release}}}


def _policy(owner: Owner, name: str, component: str, ingress: list[dict[str, Any]],
            egress: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, name, component),
            "spec": {"podSelector": {"matchLabels": labels(owner, component)},
                     "policyTypes": ["Ingress", "Egress"], "ingress": ingress,
                     "egress": egress}}


def dns_egress() -> dict[str, Any]:
    """The cluster DNS: kube-system's kube-dns pods (CoreDNS keeps the label)."""
    return {"to": [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": [{"port": DNS_PORT, "protocol": "UDP"},
                      {"port": DNS_PORT, "protocol": "TCP"}]}


def outside(*ports: int) -> dict[str, Any]:
    """TCP `ports` anywhere but the metadata and link-local ranges."""
    return {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(METADATA_RANGES[4])}},
                   {"ipBlock": {"cidr": "::/0", "except": list(METADATA_RANGES[6])}}],
            "ports": [{"port": p, "protocol": "TCP"} for p in ports]}


def downloads(spec: InferenceServiceSpec) -> bool:
    """Does a worker's init container fetch from the Hub (the model or an adapter)?"""
    adapters = spec.lora.adapters if spec.lora is not None else ()
    return spec.model.source.kind == "hf" or any(a.source.kind == "hf" for a in adapters)


def redis_egress(spec: InferenceServiceSpec,
                 operator: OperatorPeer | None) -> list[dict[str, Any]]:
    if spec.router.managed_redis and operator and operator.namespace and operator.release:
        return [{"to": [{"namespaceSelector": {"matchLabels": {
                    NAMESPACE_LABEL: operator.namespace}},
                    "podSelector": {"matchLabels": {
                        COMPONENT_LABEL: "redis", "app.kubernetes.io/instance":
                        operator.release}}}],
                 "ports": [{"port": operator.redis_port or BYO_REDIS_PORT,
                            "protocol": "TCP"}]}]
    if spec.router.managed_redis or spec.router.redis_url_secret is not None:
        # a Redis the operator cannot place: any pod, or any address but the metadata's
        rule = outside(BYO_REDIS_PORT)
        rule["to"].insert(0, {"namespaceSelector": {}})
        return [rule]
    return []


def network_policies(spec: InferenceServiceSpec, owner: Owner,
                     operator: OperatorPeer | None = None,
                     workloads: Sequence[Workload] | None = None,
                     members: Sequence[InferenceServiceSpec] = ()) -> list[dict[str, Any]]:
    """The workers' and the router's policies, then one per LeaderWorkerSet pool
    (`group_policy`); `workloads` default `pool_workloads`."""
    if not spec.security.network_policy:
        return []
    http, grpc = _port(HTTP_PORT_NAME), _port(GRPC_PORT_NAME)
    prom = [spec.prometheus] if spec.prometheus is not None else []
    peers = [_pods(owner, WORKER_COMPONENT)]
    torch_peers = spec.kv_transfer.backend == "torch" and spec.disaggregated
    workers: list[dict[str, Any]] = [  # (attached: the routers of router.attachTo)
        {"from": [_pods(router_owner(spec, owner), ROUTER_COMPONENT)], "ports": [http, grpc]},
        # decode -> prefill gRPC (KV transfer); the torch backend's TCPStore (decode side)
        # and gloo/NCCL pair sockets listen on ephemeral ports, in both directions
        {"from": peers} if torch_peers else {"from": peers, "ports": [grpc]}]
    workers_out = [dns_egress(), {"to": peers} if torch_peers else {"to": peers,
                                                                     "ports": [grpc]}]
    if downloads(spec):  # the init containers' Hub download (a policy governs the whole pod)
        workers_out.append(outside(443))
    router_out = [dns_egress(), {"to": peers, "ports": [http, grpc]},
                  outside(*KUBE_API_PORTS), *redis_egress(spec, operator),
                  group_egress(owner)]
    scrapers = [p for p in (operator_peer(operator), *prom) if p is not None]
    if scrapers:
        workers.append({"from": scrapers, "ports": [http]})
    clients = list(spec.router.allowed_clients)
    router = ([{"from": clients + prom, "ports": [http]}] if clients
              else [{"ports": [http]}])  # the front door: anyone, on http only
    if gateway_mode(spec):  # the EPP: the gateway's proxies on gRPC, no http front door
        router = gateway_ingress(spec, _port(EXT_PROC_PORT_NAME))
    # its metrics-api scaler reads /scaling; an attached service's KEDA reads this router's
    keda: list[dict[str, Any]] = []
    for s in (spec, *members):
        if s.keda is not None and s.keda not in keda:
            keda.append(s.keda)
    # the operator's autoscaler reads /scaling for a pool in mode operator on demand
    me = operator_peer(operator)
    if me is not None and any(reads_scaling(p.autoscaling) and p.autoscaling.mode == "operator"
                              for s in (spec, *members) for _, _, p in s.worker_pools()):
        keda.append(me)
    if prom or keda:  # /metrics and /scaling without a key: Prometheus, KEDA, the operator
        router.append({"from": prom + keda, "ports": [_port(METRICS_PORT_NAME)]})
    groups = [group_policy(owner, w)
              for w in (pool_workloads(spec, owner) if workloads is None else workloads)
              if w.multinode]
    front = ([] if attached(spec) else
             [_policy(owner, f"{owner.name}-router", ROUTER_COMPONENT, router, router_out)])
    pool = [inference_pool_policy(spec, owner)] if gateway_mode(spec) else []
    return [_policy(owner, f"{owner.name}-workers", WORKER_COMPONENT, workers, workers_out),
            *front, *pool, *groups]


def group_egress(owner: Owner) -> dict[str, Any]:
    """A router reaches the workers of the InferenceServices attached to it (http, grpc)."""
    return {"to": [{"podSelector": {"matchLabels": {COMPONENT_LABEL: WORKER_COMPONENT,
                                                    ROUTER_GROUP_LABEL: owner.name}}}],
            "ports": [_port(HTTP_PORT_NAME), _port(GRPC_PORT_NAME)]}


def gateway_ingress(spec: InferenceServiceSpec, port: dict[str, Any]) -> list[dict[str, Any]]:
    """`port` from `router.gateway.allowedClients`, or from anyone when unset."""
    assert spec.router.gateway is not None
    clients = list(spec.router.gateway.allowed_clients)
    return [{"from": clients, "ports": [port]}] if clients else [{"ports": [port]}]


def inference_pool_policy(spec: InferenceServiceSpec, owner: Owner) -> dict[str, Any]:
    """Gateway mode: the InferencePool's pods (this service's and attached ones' decode or
    aggregated workers) admit the gateway's proxies on http (NAME-inference-pool; Ingress
    only: their own policies keep governing the rest)."""
    pods = {"podSelector": {"matchLabels": {INFERENCE_POOL_LABEL: owner.name}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, f"{owner.name}-inference-pool", WORKER_COMPONENT),
            "spec": {**pods, "policyTypes": ["Ingress"],
                     "ingress": gateway_ingress(spec, _port(HTTP_PORT_NAME))}}


def group_policy(owner: Owner, workload: Workload) -> dict[str, Any]:
    """A LeaderWorkerSet pool's pods (`Workload.pod_selector`) admit and reach each other on
    every port (Ray picks its own): NAME-POOL-group."""
    group = {"podSelector": {"matchLabels": dict(workload.pod_selector)}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, f"{workload.name}-group", WORKER_COMPONENT),
            "spec": {**group, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"from": [group]}], "egress": [{"to": [group]}]}}
