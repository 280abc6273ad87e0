"""`spec.lora` in a worker pod (every pool: a prefill worker computes the prompt with the
request's adapter too): the `--enable-lora` flags, the adapters' volumes and the init
container that fetches and checks them.

Adapter `i` lives at /adapters/<i>-<slug of its name> (the index keeps two names that slug
alike apart; volume names are index-based DNS labels too), mounted read-only in the worker:

    pvc://CLAIM[/PATH]     the claim by subPath PATH; one volume per claim (a claim the pod
                           mounts already, the model's say, is reused)
    hf://ORG/REPO[@REV]    one emptyDir, `lora-download` (sizeLimit `lora.storage`, added to
                           the worker's ephemeral-storage request), by subPath per adapter;
                           the init container downloads adapter_config.json and
                           adapter_model.safetensors of PATH into it
    file:///PATH           the image's path, as is (`--lora-modules` paths are trusted)

`sha256` is checked by the same init container, `fetch-adapters` (`python -m
tandem.operator.fetch adapters`, in the pool's image: it sees the worker's own mounts and
file:// paths), before the worker starts: a mismatch fails the pod with the file and both
digests in its termination message. The worker flag has no digest, so the check is this one,
once per pod start, on volumes the worker mounts read-only. `--lora-dir /adapters` lets
`POST /v1/load_lora_adapter` load more adapters from volumes a pool mounts under /adapters
(its `volumes` / `volumeMounts`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from tandem.operator.render.common import container_security_context
from tandem.operator.render.model import FETCH, fetch_env
from tandem.operator.spec_lora import ADAPTER_DIR, AdapterSpec, LoRASpec
from tandem.protocol import engine_flags as flags

DOWNLOAD_VOLUME = "lora-download"
INIT_NAME = "fetch-adapters"
_SLUG_LEN = 40


@dataclass
class LoRAMount:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # the worker's, read-only
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    ephemeral_storage: str | None = None  # the hf:// adapters' download, for the request


def adapter_dir(i: int, name: str) -> str:
    """Adapter `i`'s directory under /adapters: a path segment and a DNS label alike."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:_SLUG_LEN].strip("-")
    return f"{i}-{slug or 'adapter'}"


def adapter_path(i: int, a: AdapterSpec) -> str:
    """Where the worker reads adapter `i` (its `--lora-modules` PATH)."""
    if a.source.kind == "file":
        return a.source.path
    root = PurePosixPath(ADAPTER_DIR, adapter_dir(i, a.name))
    return str(root / a.source.path) if a.source.kind == "hf" and a.source.path else str(root)


def lora_args(lora: LoRASpec | None) -> list[str]:
    """The worker's LoRA flags; none without `spec.lora`."""
    if lora is None:
        return []
    args = [flags.ENABLE_LORA, flags.MAX_LORAS, str(lora.max_loras),
            flags.MAX_LORA_RANK, str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += [flags.MAX_CPU_LORAS, str(lora.max_cpu_loras)]
    if lora.adapters:
        args += [flags.LORA_MODULES, *(f"{a.name}={adapter_path(i, a)}"
                                     for i, a in enumerate(lora.adapters))]
    return [*args, flags.LORA_DIR, ADAPTER_DIR]


def _claim_volume(claim: str, i: int, volumes: list[dict[str, Any]],
                  new: list[dict[str, Any]]) -> str:
    """The pod's volume of `claim`: one it has (the model's, a draft's), else a new one."""
    for v in [*volumes, *new]:
        if (v.get("persistentVolumeClaim") or {}).get("claimName") == claim:
            return v["name"]
    new.append({"name": f"lora-{i}", "persistentVolumeClaim": {"claimName": claim,
                                                                "readOnly": True}})
    return new[-1]["name"]


def _plan(i: int, a: AdapterSpec) -> str | None:
    """The init container's JSON for adapter `i`; None when there is nothing to do."""
    src = a.source
    if src.kind == "hf":
        item = {"repo": src.repo, "revision": src.revision, "path": src.path,
                "dest": str(PurePosixPath(ADAPTER_DIR, adapter_dir(i, a.name)))}
    elif a.sha256:
        item = {"local": adapter_path(i, a)}
    else:
        return None
    if a.sha256:
        item["sha256"] = a.sha256
    return json.dumps(item, separators=(",", ":"), sort_keys=True)


def worker_lora(lora: LoRASpec | None, image: str, scratch_mounts: list[dict[str, Any]],
                volumes: list[dict[str, Any]]) -> LoRAMount:
    """The adapters' volumes (`volumes`: the pod's so far, whose claims are reused), the
    worker's mounts and the fetch / check init container (in `image`, the pool's)."""
    out = LoRAMount()
    if lora is None:
        return out
    init_mounts: list[dict[str, Any]] = []  # the adapters it touches; downloads writable
    if lora.fetched:
        out.ephemeral_storage = lora.download_storage
        out.volumes.append({"name": DOWNLOAD_VOLUME,
                            "emptyDir": {"sizeLimit": out.ephemeral_storage}})
    for i, a in enumerate(lora.adapters):
        d, src = adapter_dir(i, a.name), a.source
        m: dict[str, Any] = {"mountPath": str(PurePosixPath(ADAPTER_DIR, d))}
        if src.kind == "pvc":
            m = {"name": _claim_volume(src.claim, i, volumes, out.volumes), **m,
                 "readOnly": True, **({"subPath": src.path} if src.path else {})}
        elif src.kind == "hf":
            m = {"name": DOWNLOAD_VOLUME, **m, "subPath": d}
            init_mounts.append(dict(m))
            m = {**m, "readOnly": True}
        else:
            continue  # file://: in the image
        out.mounts.append(m)
        if src.kind == "pvc" and a.sha256:
            init_mounts.append(dict(m))
    plan = [p for i, a in enumerate(lora.adapters) if (p := _plan(i, a)) is not None]
    if plan:
        out.init_containers.append({
            "name": INIT_NAME, "image": image, "command": [*FETCH, "adapters", *plan],
            "env": fetch_env(lora.hf_token),
            "volumeMounts": [*map(dict, scratch_mounts), *init_mounts],
            "securityContext": container_security_context(),
            "terminationMessagePolicy": "FallbackToLogsOnError"})
    return out
