"""`spec.model.uri` → where the worker finds the model (`ModelSource`).

    pvc://CLAIM[/PATH]            PATH inside a PersistentVolumeClaim (mounted read-only)
    hf://ORG/REPO[@REV][/FILE]    a Hugging Face repository, fetched by an init container
    file:///ABS/PATH              a path inside the container image
    SmolLM2-135M-Instruct         the bundled model (no volume, no flag)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from tandem.protocol.bundled import BUNDLED_NAME

MODEL_DIR = "/models"  # where a PVC or a fetched repository is mounted in worker pods
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
_HF = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(@(?P<rev>[\w.-]+))?(/(?P<file>.+))?$")


class SpecError(ValueError):
    """An InferenceService spec that cannot be deployed (a permanent error)."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "pvc" | "hf" | "file" | "bundled"
    claim: str = ""  # pvc
    repo: str = ""  # hf: ORG/REPO
    revision: str = ""  # hf: branch, tag or commit ("" = main)
    path: str = ""  # pvc and hf: inside the claim / repository ("" = its root); file: absolute

    @property
    def worker_path(self) -> str | None:
        """`tandem worker --model`: None for the bundled model."""
        if self.kind == "bundled":
            return None
        if self.kind == "file":
            return self.path
        return str(PurePosixPath(MODEL_DIR, self.path)) if self.path else MODEL_DIR

    @property
    def default_name(self) -> str:
        """The served model name when `spec.model.name` is not set."""
        if self.kind == "bundled":
            return BUNDLED_NAME
        if self.path:  # a .gguf file's name without the extension, a directory's whole name
            name = PurePosixPath(self.path).name
            return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name
        return self.claim or self.repo.rsplit("/", 1)[-1]


def _clean(path: str, uri: str) -> str:
    parts = PurePosixPath(path).parts
    if ".." in parts:
        raise SpecError(f"model.uri {uri!r}: '..' is not allowed")
    return str(PurePosixPath(*parts)) if parts else ""


def parse_model_uri(uri: str) -> ModelSource:
    if uri == BUNDLED_NAME:
        return ModelSource("bundled")
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("pvc", "hf", "file"):
        raise SpecError(f"model.uri {uri!r}: expected pvc://, hf://, file:// or "
                        f"{BUNDLED_NAME!r}")
    if scheme == "file":
        if not rest.startswith("/") or rest == "/":
            raise SpecError(f"model.uri {uri!r}: file:// takes an absolute path (file:///...)")
        return ModelSource("file", path="/" + _clean(rest.lstrip("/"), uri))
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not _DNS_SUBDOMAIN.match(claim) or len(claim) > 253:
            raise SpecError(f"model.uri {uri!r}: {claim!r} is not a PersistentVolumeClaim name")
        return ModelSource("pvc", claim=claim, path=_clean(path, uri))
    m = _HF.match(rest)
    if not m:
        raise SpecError(f"model.uri {uri!r}: expected hf://ORG/REPO[@REVISION][/FILE]")
    return ModelSource("hf", repo=m["repo"], revision=m["rev"] or "",
                       path=_clean(m["file"] or "", uri))
