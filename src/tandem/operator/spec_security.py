"""The security fields of an InferenceService spec as typed, frozen dataclasses.

`spec.security` (the worker-auth HMAC Secret, NetworkPolicies), `spec.kvTransfer.tlsIssuerRef`
(a cert-manager issuer for the gRPC certificate), `spec.router.redisUrlSecretRef` (the Redis
URL, password included, from a Secret), `spec.router.allowedClients` and
`spec.monitoring.prometheus` (NetworkPolicy peers). Peers and label selectors are checked as
the Kubernetes API would check them in a NetworkPolicy, so a bad one is a `SpecError` naming
the field rather than a failed apply.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from tandem.operator.fields import get, get_enum, get_obj
from tandem.operator.model_uri import SpecError

_SECRET_NAME = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
_SELECTOR_OPS = ("In", "NotIn", "Exists", "DoesNotExist")
MAX_PEERS = 32


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class IssuerRef:
    """A cert-manager issuer (`Certificate.spec.issuerRef`)."""

    name: str
    kind: str = "Issuer"  # "Issuer" | "ClusterIssuer"
    group: str = "cert-manager.io"


@dataclass(frozen=True)
class SecuritySpec:
    worker_auth_secret_name: str | None = None  # None: the operator's `<isvc>-worker-auth`
    network_policy: bool = True


def secret_name(value: str | None, where: str) -> str | None:
    if value is not None and (len(value) > 253 or not _SECRET_NAME.match(value)):
        raise SpecError(f"{where}: {value!r} is not a Secret name (a DNS subdomain)")
    return value


def parse_security(d: dict[str, Any]) -> SecuritySpec:
    w = "security"
    policy = get_obj(d, "networkPolicy", w)
    return SecuritySpec(
        worker_auth_secret_name=secret_name(get(d, "workerAuthSecretName", str, None, w),
                                            f"{w}.workerAuthSecretName"),
        network_policy=get(policy, "enabled", bool, True, f"{w}.networkPolicy"))


def secret_key_ref(d: dict[str, Any] | None, where: str, default_key: str) -> SecretKeyRef | None:
    if d is None:
        return None
    name = secret_name(get(d, "name", str, None, where), f"{where}.name")
    if not name:
        raise SpecError(f"{where}.name is required")
    key = get(d, "key", str, default_key, where)
    if not key or len(key) > 253 or not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
        raise SpecError(f"{where}.key: {key!r} is not a Secret key")
    return SecretKeyRef(name, key)


def issuer_ref(d: dict[str, Any] | None, where: str) -> IssuerRef | None:
    if d is None:
        return None
    name = get(d, "name", str, None, where)
    if not name:
        raise SpecError(f"{where}.name is required")
    return IssuerRef(name, get_enum(d, "kind", "Issuer", where, ("Issuer", "ClusterIssuer")),
                     get(d, "group", str, "cert-manager.io", where))


def label_selector(d: Any, where: str) -> dict[str, Any]:
    """A `metav1.LabelSelector` (matchLabels, matchExpressions), checked and copied."""
    if not isinstance(d, dict) or set(d) - {"matchLabels", "matchExpressions"}:
        raise SpecError(f"{where}: a label selector has only matchLabels and matchExpressions")
    labels = get_obj(d, "matchLabels", where)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise SpecError(f"{where}.matchLabels: string keys and values only")
    for i, e in enumerate(get(d, "matchExpressions", list, [], where)):
        at = f"{where}.matchExpressions[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("key"), str) or not e["key"]:
            raise SpecError(f"{at}.key is required")
        op = get_enum(e, "operator", "", at, _SELECTOR_OPS)
        values = get(e, "values", list, [], at)
        if not all(isinstance(v, str) for v in values):
            raise SpecError(f"{at}.values: strings only")
        if (op in ("In", "NotIn")) != bool(values):
            raise SpecError(f"{at}: values are required with In / NotIn and forbidden with "
                            "Exists / DoesNotExist")
    return copy.deepcopy(d)


def _cidr(value: Any, where: str) -> None:
    try:
        ipaddress.ip_network(value, strict=False)
    except (TypeError, ValueError):
        raise SpecError(f"{where}: {value!r} is not a CIDR") from None
    if "/" not in str(value):
        raise SpecError(f"{where}: {value!r} is not a CIDR (no /prefix)")


def peer(d: Any, where: str, ip_block: bool = True) -> dict[str, Any]:
    """A `NetworkPolicyPeer`: an ipBlock alone, or a podSelector and/or namespaceSelector."""
    keys = {"podSelector", "namespaceSelector"} | ({"ipBlock"} if ip_block else set())
    if not isinstance(d, dict) or not d or set(d) - keys:
        raise SpecError(f"{where}: one of {', '.join(sorted(keys))}")
    if "ipBlock" in d:
        if len(d) > 1:
            raise SpecError(f"{where}: ipBlock goes alone (no pod or namespace selector)")
        block = d["ipBlock"]
        if not isinstance(block, dict) or set(block) - {"cidr", "except"}:
            raise SpecError(f"{where}.ipBlock: cidr and except only")
        _cidr(block.get("cidr"), f"{where}.ipBlock.cidr")
        for i, c in enumerate(get(block, "except", list, [], f"{where}.ipBlock")):
            _cidr(c, f"{where}.ipBlock.except[{i}]")
        return copy.deepcopy(d)
    return {k: label_selector(v, f"{where}.{k}") for k, v in d.items()}


def peers(values: Any, where: str) -> tuple[dict[str, Any], ...]:
    if values is None:
        return ()
    if not isinstance(values, list) or len(values) > MAX_PEERS:
        raise SpecError(f"{where}: a list of at most {MAX_PEERS} NetworkPolicy peers")
    return tuple(peer(v, f"{where}[{i}]") for i, v in enumerate(values))


# the Prometheus Operator's Prometheus pods (kube-prometheus-stack labels them so) in the
# namespace `monitoring`: who scrapes a ServiceMonitor unless monitoring.prometheus says
PROMETHEUS_NAMESPACE = "monitoring"
DEFAULT_PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": PROMETHEUS_NAMESPACE}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def prometheus_peer(d: dict[str, Any] | None,
                    service_monitor: bool = False) -> dict[str, Any] | None:
    """`monitoring.prometheus`: the Prometheus pods the NetworkPolicies admit to /metrics;
    unset with `monitoring.serviceMonitor`, `DEFAULT_PROMETHEUS` (its scrapes would be
    dropped otherwise), else None (no one)."""
    if d is None:
        return copy.deepcopy(DEFAULT_PROMETHEUS) if service_monitor else None
    return peer(d, "monitoring.prometheus", ip_block=False)
