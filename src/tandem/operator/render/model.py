"""The model in a pod: its volume (read-only where the worker reads it), the init container
that fetches an `hf://` repository, the router's tokenizer, and the path the worker uses.

Workers: `pvc://` mounts the claim read-only at /models; `hf://` downloads in an init
container (`python -m tandem.operator.fetch model`, HF_TOKEN from `model.hfTokenSecretRef`)
into an emptyDir of `model.storage` (its ephemeral-storage requested), or with `model.cache`
into a shared ReadWriteMany PVC filled once (a key per repository, revision and path, that
the worker mounts read-only by subPath); `file://` is a path in the image; the bundled model
needs nothing.

A draft model of `engine.speculative` (`draft_model`): `file://` is a path in the image; a
`pvc://` draft on the model's own claim is read through the model's mount, another claim is
mounted read-only at /draft-model (the model's cache PVC reuses its volume).

The router always gets the model's tokenizer: an init container writes only the tokenizer
files (`fetch tokenizer`) into an emptyDir at /tokenizer, which router.yaml names. It runs
in the router's image for `hf://` (the Hub's tokenizer files, or a GGUF's metadata by range
requests) and `pvc://` (the claim mounted into the init container only), and in the
workers' image for `file://` and the bundled model, whose files are in that image.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from tandem.operator.model_uri import MODEL_DIR, ModelSource
from tandem.operator.render.common import base_env, container_security_context
from tandem.operator.spec import ModelSpec
from tandem.operator.spec_security import SecretKeyRef
from tandem.operator.spec_speculative import SpeculativeSpec

FETCH = ["python", "-m", "tandem.operator.fetch"]
DRAFT_DIR = "/draft-model"  # in worker pods: the claim of a pvc:// draft (other than the model's)
TOKENIZER_DIR = "/tokenizer"  # in router pods: what the tokenizer init container wrote
TOKENIZER_STORAGE = "2Gi"  # tokenizer files, or a GGUF's metadata prefix while converting
CACHE_MOUNT = "/model-cache"  # the shared cache PVC, in the fetch init container
HF_TOKEN_ENV = "HF_TOKEN"


@dataclass
class ModelMount:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    path: str | None = None  # the worker's --model (None: bundled); the router's tokenizer
    ephemeral_storage: str | None = None  # the download's size, for the pod's request


def _read_only_mount(sub_path: str | None = None, volume: str = "model") -> dict[str, Any]:
    m = {"name": volume, "mountPath": MODEL_DIR, "readOnly": True}
    return {**m, "subPath": sub_path} if sub_path else m


def cache_key(src: ModelSource) -> str:
    """The model's directory on a shared cache PVC: one per repository, revision and path
    (a branch's later commits are not fetched again; pin a commit to be exact)."""
    key = f"hf--{src.repo.replace('/', '--')}--{src.revision or 'main'}"
    if src.path:
        key += "--" + hashlib.sha256(src.path.encode()).hexdigest()[:12]
    return key


def fetch_env(hf_token: SecretKeyRef | None) -> list[dict[str, Any]]:
    """TANDEM_CACHE_DIR, HF_HOME, HOME and, for gated repositories, HF_TOKEN from its Secret."""
    env = base_env()[:3]
    if hf_token is not None:
        env.append({"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": hf_token.name, "key": hf_token.key}}})
    return env


def _init(name: str, image: str, args: list[str], env: list[dict[str, Any]],
          mounts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "image": image, "command": [*FETCH, *args], "env": env,
            "volumeMounts": mounts, "securityContext": container_security_context(),
            "terminationMessagePolicy": "FallbackToLogsOnError"}


def _hf_args(src: ModelSource) -> list[str]:
    return ["--repo", src.repo, "--revision", src.revision, "--path", src.path]


def worker_model(model: ModelSpec, image: str,
                 scratch_mounts: list[dict[str, Any]]) -> ModelMount:
    src = model.source
    out = ModelMount(path=src.worker_path)
    scratch = [dict(m) for m in scratch_mounts]
    if src.kind == "pvc":
        out.volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": src.claim, "readOnly": True}})
        out.mounts.append(_read_only_mount())
    elif src.kind == "hf" and model.cache_pvc:
        key = cache_key(src)
        out.volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": model.cache_pvc}})
        out.mounts.append(_read_only_mount(key))
        out.init_containers.append(_init(
            "fetch-model", image,
            ["model", *_hf_args(src), "--dest", f"{CACHE_MOUNT}/{key}", "--shared"],
            fetch_env(model.hf_token), [{"name": "model", "mountPath": CACHE_MOUNT}, *scratch]))
    elif src.kind == "hf":
        out.ephemeral_storage = model.download_storage
        out.volumes.append({"name": "model", "emptyDir": {"sizeLimit": out.ephemeral_storage}})
        out.mounts.append(_read_only_mount())
        out.init_containers.append(_init(
            "fetch-model", image, ["model", *_hf_args(src), "--dest", MODEL_DIR],
            fetch_env(model.hf_token), [{"name": "model", "mountPath": MODEL_DIR}, *scratch]))
    return out


def draft_model(model: ModelSpec, spec: SpeculativeSpec | None) -> ModelMount:
    """The draft (or EAGLE head) of a pool's `engine.speculative`: its volume and mount, if
    any, and `path`, the worker's speculative_config.model (None: no model; "self" as is)."""
    src = spec.source if spec is not None else None
    if src is None:
        return ModelMount(path=spec.model if spec is not None else None)
    if src.kind == "file":
        return ModelMount(path=src.path)
    main = model.source
    if main.kind == "pvc" and main.claim == src.claim:  # the claim's root is at MODEL_DIR
        return ModelMount(path=str(PurePosixPath(MODEL_DIR, src.path)))
    out = ModelMount(path=str(PurePosixPath(DRAFT_DIR, src.path)))
    if main.kind == "hf" and model.cache_pvc == src.claim:
        name = "model"  # the cache PVC, already a volume of the pod
    else:
        name = "draft-model"
        out.volumes.append({"name": name, "persistentVolumeClaim": {
            "claimName": src.claim, "readOnly": True}})
    out.mounts.append({"name": name, "mountPath": DRAFT_DIR, "readOnly": True})
    return out


def router_model(model: ModelSpec, image: str, worker_image: str,
                 scratch_mounts: list[dict[str, Any]], key: str = "") -> ModelMount:
    """The tokenizer init container, its emptyDir and the router container's read-only mount
    of it; `path` is the directory router.yaml names for the served model. `key` ("-N")
    names a further model's (an InferenceService attached to this router): volumes
    tokenizer-N (and model-N), init container fetch-tokenizer-N, directory /tokenizer-N."""
    src = model.source
    name, vol, where = f"tokenizer{key}", f"model{key}", f"{TOKENIZER_DIR}{key}"
    volumes: list[dict[str, Any]] = [{"name": name,
                                      "emptyDir": {"sizeLimit": TOKENIZER_STORAGE}}]
    mounts = [{"name": name, "mountPath": where}, *map(dict, scratch_mounts)]
    dest = ["--dest", where]
    container = f"fetch-tokenizer{key}"
    if src.kind == "hf":
        init = _init(container, image, ["tokenizer", *_hf_args(src), *dest],
                     fetch_env(model.hf_token), mounts)
    elif src.kind == "pvc":
        volumes.append({"name": vol, "persistentVolumeClaim": {
            "claimName": src.claim, "readOnly": True}})
        init = _init(container, image,
                     ["tokenizer", "--local", src.worker_path or MODEL_DIR, *dest],
                     base_env()[:3], [*mounts, _read_only_mount(volume=vol)])
    elif src.kind == "file":
        init = _init(container, worker_image, ["tokenizer", "--local", src.path, *dest],
                     base_env()[:3], mounts)
    else:
        init = _init(container, worker_image, ["tokenizer", "--bundled", *dest],
                     base_env()[:3], mounts)
    return ModelMount(volumes, [{"name": name, "mountPath": where, "readOnly": True}], [init],
                      where)
