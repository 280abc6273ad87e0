"""`file_sha256`: the hex SHA-256 of a file, read in chunks (torch-free; the worker's model
pin, the engine's LoRA adapter pin and the operator's fetch init container share it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 8 << 20


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
