"""The model digest a worker verifies before serving (`tandem worker --model-sha256`).

* a `.gguf` (any single file): SHA-256 of its bytes, as `sha256sum model.gguf` prints;
* an HF directory: SHA-256 of the `sha256sum` listing of its weights, the `*.safetensors`
  files directly in it, sorted by name (byte order), i.e. what
  `cd DIR && LC_ALL=C sha256sum *.safetensors | sha256sum` prints. Only the weights count:
  config and tokenizer files are not pinned.

Torch-free; files are read in 8 MiB chunks (`protocol.file_digest`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tandem.protocol.file_digest import file_sha256


class DigestMismatchError(ValueError):
    """The model on disk is not the one the deployment pinned."""


def model_sha256(path: str | Path) -> str:
    """The digest of a `.gguf` file or an HF directory's weights (see the module docstring)."""
    p = Path(path)
    if p.is_file():
        return file_sha256(p)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such model file or directory")
    files = sorted((f for f in p.glob("*.safetensors") if f.is_file()),
                   key=lambda f: f.name.encode())
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors files to hash")
    listing = "".join(f"{file_sha256(f)}  {f.name}\n" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def verify_model(path: str | Path, expected: str) -> str:
    """The digest when it equals `expected` (hex, any case); else `DigestMismatchError`."""
    actual = model_sha256(path)
    if actual != expected.strip().lower():
        raise DigestMismatchError(
            f"model digest mismatch for {path}: expected sha256 {expected.strip().lower()}, "
            f"found {actual}; refusing to serve a model other than the pinned one")
    return actual
