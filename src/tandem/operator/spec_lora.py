"""`spec.lora`: multi-LoRA adapters every worker pool serves on the base model (`LoRASpec`,
`parse_lora`), as `tandem worker --enable-lora --max-loras N --max-lora-rank R
[--max-cpu-loras N] --lora-modules NAME=PATH ... --lora-dir /adapters` takes them.

An adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors) at a
location like `model.uri` (no bundled name):

    pvc://CLAIM[/PATH]            PATH inside a PersistentVolumeClaim, mounted read-only
    hf://ORG/REPO[@REV][/PATH]    fetched (those two files only) by an init container
    file:///ABS/PATH              a path inside the worker image (not under /adapters)

`sha256` pins adapter_model.safetensors (the engine's `LoRARequest.sha256`); the fetch init
container checks it before the worker starts (`render.lora`). Names follow the engine's rule
(1..128 printable characters, no whitespace) and, for the worker's NAME=PATH flag, hold no
'=' and do not start with '-'; they must differ from the served model's name. The checks
repeat `tandem.engine.config._check_lora` (this module imports no engine code;
tests/operator/test_spec_lora.py holds them together).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from tandem.operator.fields import get, get_int
from tandem.operator.model_uri import ModelSource, SpecError, parse_model_uri
from tandem.operator.spec_security import SecretKeyRef, secret_key_ref

ADAPTER_DIR = "/adapters"  # workers' mount root for adapters, and their --lora-dir
MAX_ADAPTERS = 64
MAX_NAME_LEN = 128  # tandem.engine.lora.request.MAX_NAME_LEN
MAX_SLOTS = 4096  # the engine's bound on max_loras (and max_cpu_loras here)
MAX_RANK = 512
DEFAULT_LORA_STORAGE = "4Gi"  # the hf:// adapters' emptyDir, all of them together
_STORAGE = re.compile(r"^[1-9][0-9]*(Ki|Mi|Gi|Ti)$")
_SHA256 = re.compile(r"^[a-f0-9]{64}$")
_KEYS = {"maxLoras", "maxLoraRank", "maxCpuLoras", "adapters", "storage", "hfTokenSecretRef"}


@dataclass(frozen=True)
class AdapterSpec:
    name: str  # what clients put in the OpenAI `model` field
    uri: str
    source: ModelSource  # kind pvc, hf or file
    sha256: str | None = None  # of adapter_model.safetensors


@dataclass(frozen=True)
class LoRASpec:
    max_loras: int = 1  # adapters resident in device slots (distinct adapters per step)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # host cache; None: the worker's (max_loras)
    adapters: tuple[AdapterSpec, ...] = ()
    storage: str | None = None  # hf:// adapters' download size; None: DEFAULT_LORA_STORAGE
    hf_token: SecretKeyRef | None = None  # HF_TOKEN of the adapters' fetch init container

    @property
    def fetched(self) -> bool:
        """Some adapter comes from the Hub (an emptyDir and a download)."""
        return any(a.source.kind == "hf" for a in self.adapters)

    @property
    def download_storage(self) -> str | None:
        """The hf:// adapters' emptyDir size; None without one."""
        return (self.storage or DEFAULT_LORA_STORAGE) if self.fetched else None


def check_adapter_name(name: Any, where: str) -> str:
    """The engine's `check_name`, plus what the worker's NAME=PATH syntax cannot carry."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
        raise SpecError(f"{where}: 1 to {MAX_NAME_LEN} characters, got {name!r}")
    if not name.isprintable() or any(c.isspace() for c in name):
        raise SpecError(f"{where} {name!r}: whitespace or unprintable characters")
    if "=" in name or name.startswith("-"):
        raise SpecError(f"{where} {name!r}: no '=' and no leading '-' (the worker's "
                        "--lora-modules NAME=PATH)")
    return name


def _source(uri: Any, where: str) -> ModelSource:
    if not isinstance(uri, str) or not uri:
        raise SpecError(f"{where} is required (pvc://CLAIM[/PATH], hf://ORG/REPO[@REV][/PATH] "
                        "or file:///PATH)")
    try:
        src = parse_model_uri(uri)
    except SpecError as exc:
        raise SpecError(str(exc).replace("model.uri", where, 1)) from None
    if src.kind == "bundled":
        raise SpecError(f"{where} {uri!r}: an adapter's location (pvc://, hf:// or file://), "
                        "not a model")
    root = PurePosixPath(ADAPTER_DIR)
    if src.kind == "file" and (PurePosixPath(src.path) == root or root in
                               PurePosixPath(src.path).parents):
        raise SpecError(f"{where} {uri!r}: {ADAPTER_DIR} is where the operator mounts "
                        "adapters; use a path outside it")
    return src


def _adapter(d: Any, where: str) -> AdapterSpec:
    if not isinstance(d, dict):
        raise SpecError(f"{where}: expected an object {{name, uri, sha256}}, got {d!r}")
    if unknown := sorted(set(d) - {"name", "uri", "sha256"}):
        raise SpecError(f"{where}: unknown keys {unknown} (name, uri, sha256)")
    name = check_adapter_name(d.get("name"), f"{where}.name")
    uri = d.get("uri")
    sha = get(d, "sha256", str, None, where)
    if sha is not None and not _SHA256.match(sha):
        raise SpecError(f"{where}.sha256 {sha!r}: 64 lowercase hex digits (of "
                        "adapter_model.safetensors)")
    return AdapterSpec(name, uri, _source(uri, f"{where}.uri"), sha)


def parse_lora(d: dict[str, Any] | None) -> LoRASpec | None:
    """`spec.lora`; None when unset (the workers run without LoRA)."""
    if d is None:
        return None
    w = "lora"
    if unknown := sorted(set(d) - _KEYS):
        raise SpecError(f"{w}: unknown keys {unknown} ({', '.join(sorted(_KEYS))})")
    slots = get_int(d, "maxLoras", 1, w, 1, MAX_SLOTS)
    cpu = get_int(d, "maxCpuLoras", None, w, 1, MAX_SLOTS)
    if cpu is not None and cpu < slots:
        raise SpecError(f"{w}.maxCpuLoras {cpu} is below maxLoras {slots} (the host cache "
                        "holds at least the resident adapters)")
    raw = get(d, "adapters", list, [], w)
    if len(raw) > MAX_ADAPTERS:
        raise SpecError(f"{w}.adapters: {len(raw)} adapters, at most {MAX_ADAPTERS}")
    adapters = tuple(_adapter(a, f"{w}.adapters[{i}]") for i, a in enumerate(raw))
    seen: set[str] = set()
    for i, a in enumerate(adapters):
        if a.name in seen:
            raise SpecError(f"{w}.adapters[{i}].name {a.name!r}: another adapter has this name")
        seen.add(a.name)
    storage = get(d, "storage", str, None, w)
    if storage is not None and not _STORAGE.match(storage):
        raise SpecError(f"{w}.storage {storage!r}: a size like 4Gi (Ki, Mi, Gi or Ti)")
    out = LoRASpec(max_loras=slots, max_lora_rank=get_int(d, "maxLoraRank", 16, w, 1, MAX_RANK),
                   max_cpu_loras=cpu, adapters=adapters, storage=storage,
                   hf_token=secret_key_ref(get(d, "hfTokenSecretRef", dict, None, w),
                                           f"{w}.hfTokenSecretRef", "token"))
    if (out.storage or out.hf_token) and not out.fetched:
        raise SpecError(f"{w}.hfTokenSecretRef and {w}.storage are for hf:// adapters only")
    return out


def check_served_name(lora: LoRASpec | None, served_name: str) -> None:
    """An adapter named like the served model would never be reachable by that name."""
    for i, a in enumerate(lora.adapters if lora else ()):
        if a.name == served_name:
            raise SpecError(f"lora.adapters[{i}].name {a.name!r} is the served model's name "
                            "(model.name); name the adapter differently")
