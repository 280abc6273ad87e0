"""The model in a pod: its volume (read-only where the worker reads it), the init container
that fetches an `hf://` repository, and the path the worker and the router's tokenizer use.

`pvc://` mounts the claim read-only at /models (worker and router: the router reads only the
tokenizer). `hf://` downloads into an emptyDir in an init container of each worker pod, so
the pods need egress to the Hub (and the router routes on text hashes: it has no tokenizer
file). `file://` is a path already in the image; the bundled model needs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.operator.model_uri import MODEL_DIR
from tandem.operator.render.common import (
    base_env,
    container_security_context,
)
from tandem.operator.spec import ModelSpec

# argv: repo, revision ("" = default branch), path in the repo ("" = all of it)
FETCH_SCRIPT = """\
import sys
from huggingface_hub import snapshot_download
repo, rev, path = sys.argv[1:4]
patterns = [path, path + "/*"] if path else None
snapshot_download(repo, revision=rev or None, local_dir=sys.argv[4], allow_patterns=patterns)
"""


@dataclass
class ModelMount:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    path: str | None = None  # the worker's --model (None: bundled)


def _read_only_mount() -> dict[str, Any]:
    return {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}


def worker_model(model: ModelSpec, image: str,
                 scratch_mounts: list[dict[str, Any]]) -> ModelMount:
    src = model.source
    out = ModelMount(path=src.worker_path)
    if src.kind == "pvc":
        out.volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": src.claim, "readOnly": True}})
        out.mounts.append(_read_only_mount())
    elif src.kind == "hf":
        out.volumes.append({"name": "model", "emptyDir": {}})
        out.mounts.append(_read_only_mount())
        out.init_containers.append({
            "name": "fetch-model", "image": image,
            "command": ["python", "-c", FETCH_SCRIPT, src.repo, src.revision, src.path,
                        MODEL_DIR],
            "env": base_env()[:3],
            "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR},
                             *(dict(m) for m in scratch_mounts)],
            "securityContext": container_security_context(),
            "terminationMessagePolicy": "FallbackToLogsOnError"})
    return out


def router_model(model: ModelSpec) -> ModelMount:
    """The worker's tokenizer file for the router, where one is reachable without a download;
    `path` None means the bundled model (found by the router itself) or none."""
    src = model.source
    if src.kind == "pvc":
        return ModelMount([{"name": "model", "persistentVolumeClaim": {
            "claimName": src.claim, "readOnly": True}}], [_read_only_mount()], [],
            src.worker_path)
    return ModelMount(path=src.worker_path if src.kind == "file" else None)
