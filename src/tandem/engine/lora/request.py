"""`LoRARequest` (vLLM's): which adapter a request runs with, and where its files are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_NAME_LEN = 128


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by `lora_name` (what clients put in the OpenAI `model` field), a positive
    `lora_int_id` unique per adapter, and `lora_path`: a PEFT directory
    (`adapter_config.json` + `adapter_model.safetensors`). `sha256`, when set, pins the hex
    digest of `adapter_model.safetensors`. A request naming a loaded adapter may leave the
    path empty."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    sha256: str | None = None

    def __post_init__(self) -> None:
        check_name(self.lora_name)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or (
                self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if self.sha256 is not None and (len(self.sha256) != 64 or any(
                c not in "0123456789abcdef" for c in self.sha256.lower())):
            raise ValueError("sha256 must be 64 hex digits")


def check_name(name: object) -> str:
    """An adapter name: 1..128 printable characters without whitespace or '/'-leading."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
        raise ValueError(f"an adapter name is 1 to {MAX_NAME_LEN} characters")
    if not name.isprintable() or any(c.isspace() for c in name):
        raise ValueError(f"adapter name {name!r} has whitespace or unprintable characters")
    return name


@dataclass(frozen=True)
class LoRAState:
    """The adapters a request may name on one engine, as it reports them: `(name, digest)`
    pairs in load order (the digest is the adapter's identity in block hashes), under a
    `version` bumped on every load and unload of engine `instance` (random per process).
    A report of a lower version of the same instance is older: routers drop it."""

    instance: str
    version: int
    adapters: tuple[tuple[str, str], ...] = ()

    def names(self) -> list[str]:
        return [name for name, _ in self.adapters]

    def to_json(self) -> dict[str, Any]:
        """The `/ready` and load / unload answers' `lora` object."""
        return {"instance": self.instance, "version": self.version,
                "adapters": dict(self.adapters)}
