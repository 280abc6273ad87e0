"""What an InferenceService may ask of the operator's pods, as the chart's admin values allow
(`AdmissionPolicy`, from the operator's environment): the operator must not be a confused
deputy that gives whoever may create an InferenceService more than a Pod of their own would.

The rendered pods meet the Pod Security Standards "restricted" profile (`render.common`:
non-root, no privilege escalation, every capability dropped, RuntimeDefault seccomp, no host
namespaces or ports; the spec has no field for any of those). What the user's pod settings
may add is checked here, each refusal a `SpecError` naming the field:

* volumes: only the restricted profile's types (configMap, csi, downwardAPI, emptyDir,
  ephemeral, persistentVolumeClaim, projected, secret); `hostPath` only with
  `security.allowHostPath` (then the pods meet "baseline" at most);
* `runtimeClassName`: only one of `security.allowedRuntimeClasses` (default: nvidia);
* Secrets in env (`valueFrom.secretKeyRef`), `envFrom.secretRef`, secret and projected
  volumes: only names matching `security.allowedSecrets` (shell patterns; default none:
  a Secret reaches a pod only through the spec's own typed fields: API keys, HF token,
  Redis URL, TLS, worker-auth key);
* images (spec.image, router.image, each pool's image): only under one of
  `security.allowedRegistries` when set (`registry.example.com` or
  `registry.example.com/team`; Docker Hub short names are `docker.io/library/NAME`);
* the InferenceService's namespace: only one of `security.allowedNamespaces` when set;
* `kvTransfer.tlsIssuerRef` of kind ClusterIssuer: only one of
  `security.allowedClusterIssuers` (default none): a ClusterIssuer signs for any namespace,
  so whoever may use it can mint another namespace's gRPC identity; a namespaced Issuer or
  `kvTransfer.tlsOwnCA` keeps the identity within the namespace.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.model_uri import SpecError
from tandem.operator.pod_settings import PodSettings
from tandem.operator.spec import InferenceServiceSpec

ALLOW_HOST_PATH_ENV = "TANDEM_ALLOW_HOST_PATH"  # "true"
RUNTIME_CLASSES_ENV = "TANDEM_ALLOWED_RUNTIME_CLASSES"  # comma-separated; unset: nvidia
SECRETS_ENV = "TANDEM_ALLOWED_SECRETS"  # comma-separated shell patterns
REGISTRIES_ENV = "TANDEM_ALLOWED_REGISTRIES"  # comma-separated
NAMESPACES_ENV = "TANDEM_ALLOWED_NAMESPACES"  # comma-separated
CLUSTER_ISSUERS_ENV = "TANDEM_ALLOWED_CLUSTER_ISSUERS"  # comma-separated
RESTRICTED_VOLUMES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret")


@dataclass(frozen=True)
class AdmissionPolicy:
    allow_host_path: bool = False
    allowed_runtime_classes: tuple[str, ...] = ("nvidia",)
    allowed_secrets: tuple[str, ...] = ()  # shell patterns of Secret names
    allowed_registries: tuple[str, ...] = ()  # empty: any image
    allowed_namespaces: tuple[str, ...] = ()  # empty: any namespace
    allowed_cluster_issuers: tuple[str, ...] = ()  # kvTransfer.tlsIssuerRef ClusterIssuers


def _list(value: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for v in (value or "").split(",") if v.strip()))


def policy_from_env(environ: Mapping[str, str]) -> AdmissionPolicy:
    runtime = environ.get(RUNTIME_CLASSES_ENV)
    return AdmissionPolicy(
        allow_host_path=environ.get(ALLOW_HOST_PATH_ENV, "").lower() == "true",
        allowed_runtime_classes=("nvidia",) if runtime is None else _list(runtime),
        allowed_secrets=_list(environ.get(SECRETS_ENV)),
        allowed_registries=tuple(r.rstrip("/") for r in _list(environ.get(REGISTRIES_ENV))),
        allowed_namespaces=_list(environ.get(NAMESPACES_ENV)),
        allowed_cluster_issuers=_list(environ.get(CLUSTER_ISSUERS_ENV)))


def normalized_image(image: str) -> str:
    """`image` with its registry spelled out (Docker Hub's implicit `docker.io/library/`)."""
    first, sep, rest = image.partition("/")
    if not sep:
        return f"docker.io/library/{image}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{image}"
    return image


def image_allowed(image: str, registries: tuple[str, ...]) -> bool:
    ref = normalized_image(image)
    return not registries or any(ref.startswith(f"{r}/") for r in registries)


def _kinds(v: dict[str, Any]) -> list[str]:
    """A volume's source keys (`pod_settings` checked there is exactly one)."""
    return [k for k in v if k != "name"]


def _secret_refs(pod: PodSettings, where: str) -> Iterator[tuple[str, str]]:
    """(field, Secret name) of every Secret the pod settings reference."""
    for i, e in enumerate(pod.env):
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if isinstance(ref, dict):
            yield f"{where}.env[{i}].valueFrom.secretKeyRef", str(ref.get("name"))
    for i, e in enumerate(pod.env_from):
        if isinstance(e.get("secretRef"), dict):
            yield f"{where}.envFrom[{i}].secretRef", str(e["secretRef"].get("name"))
    for i, v in enumerate(pod.volumes):
        if isinstance(v.get("secret"), dict):
            yield f"{where}.volumes[{i}].secret", str(v["secret"].get("secretName"))
        sources = (v.get("projected") or {}).get("sources") or []
        for j, s in enumerate(sources if isinstance(sources, list) else []):
            if isinstance(s, dict) and isinstance(s.get("secret"), dict):
                yield (f"{where}.volumes[{i}].projected.sources[{j}].secret",
                       str(s["secret"].get("name")))


def _pods(spec: InferenceServiceSpec) -> Iterator[tuple[str, PodSettings]]:
    yield "router", spec.router.pod
    for _, role, pool in spec.worker_pools():
        yield ("prefill" if role == "prefill" else "decode"), pool.pod


def admit(spec: InferenceServiceSpec, namespace: str, policy: AdmissionPolicy) -> None:
    """`SpecError` naming the first field `policy` does not allow."""
    if policy.allowed_namespaces and namespace not in policy.allowed_namespaces:
        raise SpecError(f"metadata.namespace: this operator may not deploy into {namespace!r} "
                        f"(allowed: {', '.join(policy.allowed_namespaces)})")
    issuer = spec.kv_transfer.tls_issuer
    if (issuer is not None and issuer.kind == "ClusterIssuer"
            and issuer.name not in policy.allowed_cluster_issuers):
        raise SpecError(f"kvTransfer.tlsIssuerRef: ClusterIssuer {issuer.name!r} is not allowed "
                        "(the chart's security.allowedClusterIssuers); use a namespaced Issuer "
                        "or kvTransfer.tlsOwnCA")
    images = [("spec.image", spec.image)] + [(f"{w}.image", p.image) for w, p in _pods(spec)]
    for where, image in images:
        if image and not image_allowed(image, policy.allowed_registries):
            raise SpecError(f"{where}: {image!r} is not from an allowed registry "
                            f"({', '.join(policy.allowed_registries)})")
    for where, pod in _pods(spec):
        for i, v in enumerate(pod.volumes):
            kind = _kinds(v)[0]
            if kind == "hostPath" and policy.allow_host_path:
                continue
            if kind not in RESTRICTED_VOLUMES:
                extra = " (hostPath needs the chart's security.allowHostPath)" if (
                    kind == "hostPath") else ""
                raise SpecError(f"{where}.volumes[{i}].{kind}: volume type not allowed; "
                                f"allowed: {', '.join(RESTRICTED_VOLUMES)}{extra}")
        runtime = pod.runtime_class_name
        if runtime and runtime not in policy.allowed_runtime_classes:
            raise SpecError(f"{where}.runtimeClassName: {runtime!r} is not allowed (the "
                            "chart's security.allowedRuntimeClasses: "
                            f"{', '.join(policy.allowed_runtime_classes) or 'none'})")
        for field, name in _secret_refs(pod, where):
            if not any(fnmatch.fnmatchcase(name, p) for p in policy.allowed_secrets):
                raise SpecError(f"{field}: Secret {name!r} is not allowed in pod settings (the "
                                "chart's security.allowedSecrets; Secrets reach the pods "
                                "through the spec's own fields)")


