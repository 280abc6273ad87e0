"""The router's front-door mode and grouping (`parse_gateway`, `check_attached`).

`router.mode`: `router` (default: Tandem's router Deployment and Service are the front door)
or `gateway`: an existing Gateway API gateway (Istio, kgateway, GKE, Envoy Gateway ...) is
the front door and Tandem's router runs as its endpoint picker (EPP, Envoy ext_proc) behind
an `InferencePool`; `router.gateway` configures that (`GatewaySpec`). `router.attachTo`
names another InferenceService of the namespace whose router (or EPP) also serves this one's
model: this one renders no router of its own, so it may set no field that configures one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.operator.fields import get, get_enum, get_int, get_obj
from tandem.operator.model_uri import SpecError
from tandem.operator.spec_security import peers

MODES = ("router", "gateway")
FAILURE_MODES = ("FailClose", "FailOpen")  # InferencePool endpointPickerRef.failureMode
DEFAULT_EXT_PROC_PORT = 9002  # the Gateway API Inference Extension's EPP port
MAX_PARENT_REFS = 32  # HTTPRoute spec.parentRefs maxItems
MAX_OBJECTIVES = 256
MAX_CLIENT_NAMES = 64  # router.gateway.tls.clientAuth.allowedNames
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
_SECTION = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PARENT_KEYS = {"group", "kind", "namespace", "name", "sectionName", "port"}


@dataclass(frozen=True)
class GatewaySpec:
    """`router.gateway` (mode `gateway`)."""

    # Gateway API ParentReferences of the example HTTPRoute; () renders no HTTPRoute
    parent_refs: tuple[dict[str, Any], ...] = ()
    ext_proc_port: int = DEFAULT_EXT_PROC_PORT  # the EPP's gRPC port (its Service's too)
    failure_mode: str = "FailClose"  # what the gateway does when the EPP does not answer
    tls_secret: str | None = None  # kubernetes.io/tls Secret: ext_proc over TLS
    # tls.clientAuth (mutual TLS): a Secret holding ca.crt, the CA of the gateway's client
    # certificates, and the identities (SAN DNS / URI or CN) served; () = any of that CA
    client_ca_secret: str | None = None
    client_names: tuple[str, ...] = ()
    # NetworkPolicy peers of the gateway's proxies (the EPP's gRPC port and the workers'
    # http port); () = any
    allowed_clients: tuple[dict[str, Any], ...] = ()
    objectives: dict[str, int] = field(default_factory=dict)  # InferenceObjective -> priority
    request_timeout_seconds: int = 300  # the HTTPRoute rule's timeouts.request


def _parent_ref(ref: Any, where: str) -> dict[str, Any]:
    if not isinstance(ref, dict):
        raise SpecError(f"{where}: expected an object, got {ref!r}")
    unknown = set(ref) - _PARENT_KEYS
    if unknown:
        raise SpecError(f"{where}: unknown fields {sorted(unknown)}")
    name = get(ref, "name", str, None, where)
    if not name or len(name) > 253:
        raise SpecError(f"{where}.name is required (at most 253 characters)")
    checks = (("group", _DNS_SUBDOMAIN, 253), ("kind", _KIND, 63),
              ("namespace", _DNS_LABEL, 63), ("sectionName", _SECTION, 253))
    for key, pattern, most in checks:
        value = get(ref, key, str, None, where)
        if value is not None and (len(value) > most or not (
                pattern.match(value) or (key == "group" and value == ""))):
            raise SpecError(f"{where}.{key}: {value!r} is not valid")
    get_int(ref, "port", None, where, 1, 65535)
    return dict(ref)


def _objectives(d: dict[str, Any], where: str) -> dict[str, int]:
    out = {}
    raw = get_obj(d, "objectives", where)
    if len(raw) > MAX_OBJECTIVES:
        raise SpecError(f"{where}.objectives: at most {MAX_OBJECTIVES}")
    for name, priority in raw.items():
        if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
            raise SpecError(f"{where}.objectives: {name!r} is not an object name")
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                -(1 << 31) <= priority < 1 << 31):
            raise SpecError(f"{where}.objectives.{name}: an integer priority "
                            "(higher = more important)")
        out[name] = priority
    return out


def _client_auth(tls: dict[str, Any], where: str) -> tuple[str | None, list[str]]:
    """`tls.clientAuth`: (the client CA's Secret, the allowed names), (None, []) unset."""
    if "clientAuth" not in tls:
        return None, []
    auth = get_obj(tls, "clientAuth", where)
    w = f"{where}.clientAuth"
    ca = get(auth, "caSecretName", str, None, w)
    if not ca or len(ca) > 253:
        raise SpecError(f"{w}.caSecretName is required (a Secret name)")
    names = get(auth, "allowedNames", list, [], w)
    if len(names) > MAX_CLIENT_NAMES or not all(
            isinstance(n, str) and 0 < len(n) <= 2048 for n in names):
        raise SpecError(f"{w}.allowedNames: at most {MAX_CLIENT_NAMES} names of 1-2048 "
                        "characters")
    return ca, names


def parse_gateway(d: dict[str, Any], mode: str) -> GatewaySpec | None:
    """`router.gateway`: None in mode `router`, which refuses the field."""
    w = "router.gateway"
    if mode != "gateway":
        if "gateway" in d:
            raise SpecError("router.gateway needs router.mode: gateway")
        return None
    g = get_obj(d, "gateway", "router")
    refs = get(g, "parentRefs", list, [], w)
    if len(refs) > MAX_PARENT_REFS:
        raise SpecError(f"{w}.parentRefs: at most {MAX_PARENT_REFS}")
    tls = get_obj(g, "tls", w)
    secret = get(tls, "secretName", str, None, f"{w}.tls")
    if "tls" in g and not secret:
        raise SpecError(f"{w}.tls.secretName is required")
    client_ca, client_names = _client_auth(tls, f"{w}.tls")
    return GatewaySpec(
        parent_refs=tuple(_parent_ref(r, f"{w}.parentRefs[{i}]") for i, r in enumerate(refs)),
        ext_proc_port=get_int(g, "extProcPort", DEFAULT_EXT_PROC_PORT, w, 1024, 65535),
        failure_mode=get_enum(g, "failureMode", "FailClose", w, FAILURE_MODES),
        tls_secret=secret,
        client_ca_secret=client_ca,
        client_names=tuple(client_names),
        allowed_clients=peers(g.get("allowedClients"), f"{w}.allowedClients"),
        objectives=_objectives(g, w),
        request_timeout_seconds=get_int(g, "requestTimeoutSeconds", 300, w, 1, 86400))


def check_gateway(router: Any) -> None:
    """Gateway mode: the router fields of a front door it does not have are refused."""
    if router.mode != "gateway":
        return
    if router.service_type != "ClusterIP" or router.allowed_clients:
        raise SpecError("router.mode gateway: the gateway is the front door (the endpoint "
                        "picker's Service is ClusterIP, its http port closed); set "
                        "router.gateway.allowedClients, not router.serviceType or "
                        "router.allowedClients")


def parse_attach_to(d: dict[str, Any]) -> str | None:
    name = get(d, "attachTo", str, None, "router")
    if name is not None and (not _DNS_LABEL.match(name) or len(name) > 63):
        raise SpecError(f"router.attachTo {name!r}: the name of an InferenceService")
    return name


# the CRD's router defaults: a defaulted field is not one the user set
_CRD_DEFAULTS: dict[str, Any] = {
    "replicas": 1, "policy": "cost", "pdThreshold": 16, "pdMaxPrefillQueue": 0,
    "pdMaxLocalPrefill": 1024, "pdDecision": "cost", "pdItlWeight": 1.0,
    "pdStallBudget": 0.005,
    "managedRedis": False, "sharedIndex": False,
    "serviceType": "ClusterIP", "strategy": {}, "mode": "router"}


def check_attached(router: Any, default: Any, raw: dict[str, Any]) -> None:
    """With `router.attachTo`: every other router field at its default (`default`: a bare
    RouterSpec), else `SpecError` naming the fields of `raw` (spec.router) that configure a
    router."""
    if router.attach_to is None:
        return
    changed = [f.name for f in fields(router)
               if f.name != "attach_to" and getattr(router, f.name) != getattr(default, f.name)]
    if changed:
        keys = [k for k, v in raw.items()
                if k != "attachTo" and _CRD_DEFAULTS.get(k, object()) != v]
        raise SpecError(f"router.attachTo: this InferenceService is served by the router of "
                        f"{router.attach_to!r} and renders none of its own; set the router "
                        f"fields there, not here (router.{', router.'.join(keys)})")
