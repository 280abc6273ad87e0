"""The user's pod settings (`PodSettings`) merged into a rendered Deployment (or both pod
templates of a LeaderWorkerSet, its rollout strategy from the same fields), last, so they
meet everything the operator put there: a user env var, volume, mount path, pod label or
annotation that collides with one of the operator's is a `SpecError` naming the field; the
user cannot override the selector labels, config hash, reserved env or volumes.

Env and envFrom reach every container (the fetch init containers too: HTTPS_PROXY,
HF_ENDPOINT for a mirror); volumeMounts only the main one. A topology spread constraint
without a labelSelector spreads the pool's own pods (an LWS's: every pod of its groups).
Image pull secrets are the operator's defaults (`TANDEM_IMAGE_PULL_SECRETS`) followed by the
pool's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from tandem.operator.model_uri import SpecError
from tandem.operator.pod_settings import PodSettings
from tandem.operator.render.multinode import LWS_KIND, pod_templates

PULL_SECRETS_ENV = "TANDEM_IMAGE_PULL_SECRETS"  # comma-separated Secret names (the chart's)


def pull_secrets_from_env(value: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.strip() for s in (value or "").split(",") if s.strip()))


def _check_new(where: str, key: str, existing: set[str], what: str) -> None:
    if key in existing:
        raise SpecError(f"{where}: {key!r} is {what} the operator sets")


def _under(path: str, other: str) -> bool:
    p, o = PurePosixPath(path), PurePosixPath(other)
    return p == o or o in p.parents or p in o.parents


def apply_pod_settings(workload: dict[str, Any], pod: PodSettings, where: str,
                       selector: Mapping[str, str],
                       default_pull_secrets: Sequence[str] = ()) -> None:
    """Merge `pod` (the settings of spec field `where`, e.g. "decode") into `workload`, a
    Deployment or a LeaderWorkerSet; `selector`: every pod it runs (a pool's
    `Workload.pod_selector`), what a topology spread constraint without a labelSelector
    spreads."""
    for template in pod_templates(workload):
        _merge(template, selector, pod, where, default_pull_secrets)
    rolling = {"maxSurge": pod.strategy.max_surge, "maxUnavailable": pod.strategy.max_unavailable}
    if workload["kind"] == LWS_KIND:
        workload["spec"]["rolloutStrategy"] = {"type": "RollingUpdate",
                                               "rollingUpdateConfiguration": rolling}
    else:
        workload["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": rolling}


def _merge(template: dict[str, Any], selector: Mapping[str, str], pod: PodSettings, where: str,
           default_pull_secrets: Sequence[str]) -> None:
    spec = template["spec"]
    meta = template["metadata"]
    for key, field_name, what in (("labels", "podLabels", "a label"),
                                  ("annotations", "podAnnotations", "an annotation")):
        values = getattr(pod, key)
        for k in values:
            _check_new(f"{where}.{field_name}", k, set(meta.get(key, {})), what)
        if values:
            meta.setdefault(key, {}).update(values)
    containers = spec["containers"] + spec.get("initContainers", [])
    for c in containers:
        names = {e["name"] for e in c.get("env", [])}
        for i, e in enumerate(pod.env):
            _check_new(f"{where}.env[{i}].name", e["name"], names, "an env var")
        if pod.env:
            c["env"] = c.get("env", []) + copy.deepcopy(list(pod.env))
        if pod.env_from:
            c["envFrom"] = c.get("envFrom", []) + copy.deepcopy(list(pod.env_from))
    volumes = {v["name"] for v in spec.get("volumes", [])}
    for i, v in enumerate(pod.volumes):
        _check_new(f"{where}.volumes[{i}].name", v["name"], volumes, "a volume")
    if pod.volumes:
        spec["volumes"] = spec.get("volumes", []) + copy.deepcopy(list(pod.volumes))
    main = spec["containers"][0]
    for i, m in enumerate(pod.volume_mounts):
        for own in main.get("volumeMounts", []):
            if _under(m["mountPath"], own["mountPath"]):
                raise SpecError(f"{where}.volumeMounts[{i}].mountPath: {m['mountPath']!r} "
                                f"overlaps {own['mountPath']!r}, which the operator mounts")
    if pod.volume_mounts:
        main["volumeMounts"] = main.get("volumeMounts", []) + copy.deepcopy(
            list(pod.volume_mounts))
    if pod.affinity:
        spec["affinity"] = copy.deepcopy(pod.affinity)
    if pod.topology_spread_constraints:
        spec["topologySpreadConstraints"] = [
            {"labelSelector": {"matchLabels": dict(selector)}, **copy.deepcopy(c)}
            for c in pod.topology_spread_constraints]
    for key, value in (("priorityClassName", pod.priority_class_name),
                       ("runtimeClassName", pod.runtime_class_name)):
        if value:
            spec[key] = value
    secrets = dict.fromkeys([*default_pull_secrets, *pod.image_pull_secrets])
    if secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in secrets]
    if pod.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **pod.node_selector}
    if pod.tolerations:
        spec["tolerations"] = spec.get("tolerations", []) + copy.deepcopy(list(pod.tolerations))
