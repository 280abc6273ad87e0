"""Where adapters may be read from (torch-free).

Adapter loading takes a path from a client (`POST /v1/load_lora_adapter`) or a config;
path traversal there is a known class of vulnerability in peers. `resolve_adapter_dir`
accepts a directory only when it lies inside one of the configured roots after every
symlink is resolved: no URL schemes, no NUL bytes, no `..` components, and the two files it
reads (`adapter_config.json`, `adapter_model.safetensors`) must be regular files whose real
paths are inside the same root. Nothing outside the roots is opened or even stat-ed beyond
`realpath`'s resolution of the given name.

The check and the read are one decision: `open_confined` opens each file once by walking
from the root, one component at a time, without following any symlink (`O_NOFOLLOW`), and
the loader reads only through that descriptor. A directory swapped for a symlink between
the check and the read fails the walk instead of leading outside the root.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_PATH_LEN = 4096


class AdapterPathError(ConfigError):
    """A path outside the allowed roots, or not an adapter directory (HTTP 400)."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class AdapterDir:
    """A checked adapter directory: its real path and the real root it lies in."""

    real: Path
    root: str


def resolve_adapter_dir(path: str, roots: list[str] | tuple[str, ...] | None) -> Path:
    """`resolve_adapter(path, roots).real`."""
    return resolve_adapter(path, roots).real


def resolve_adapter(path: str, roots: list[str] | tuple[str, ...] | None) -> AdapterDir:
    """The real path of adapter directory `path` (absolute, or relative to the first root),
    inside one of `roots`; AdapterPathError otherwise. With no roots every path is refused
    (an engine lists its roots, `--lora-dir`, to load adapters by path from clients);
    `roots=None`: a trusted path from the operator's own configuration (`--lora-modules`),
    checked only for being an adapter directory."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_LEN or "\x00" in path:
        raise AdapterPathError("lora_path must be a non-empty path")
    if "://" in path or path.startswith(("http:", "https:", "file:", "s3:", "hf:")):
        raise AdapterPathError("lora_path must be a local directory, not a URL")
    if ".." in Path(path).parts:
        raise AdapterPathError("lora_path must not contain '..'")
    if roots is not None and not roots:
        raise AdapterPathError("no adapter directory is configured (--lora-dir): adapters "
                               "cannot be loaded by path")
    if roots is None:
        real = os.path.realpath(path)
        root = os.sep
    else:
        real_roots = [os.path.realpath(r) for r in roots]
        candidate = path if os.path.isabs(path) else os.path.join(real_roots[0], path)
        real = os.path.realpath(candidate)
        root = next((r for r in real_roots if _inside(real, r)), None)
    if root is None:
        raise AdapterPathError(f"lora_path {path!r} is outside the allowed adapter "
                               "directories")
    if not os.path.isdir(real):
        raise AdapterPathError(f"lora_path {path!r} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = os.path.join(real, name)
        if os.path.lexists(file) and not _inside(os.path.realpath(file), root):
            raise AdapterPathError(f"{name} in {path!r} links outside the allowed "
                                   "adapter directories")
        if not os.path.isfile(file):
            raise AdapterPathError(f"{path!r} has no {name} (a PEFT adapter directory has "
                                   f"{CONFIG_FILE} and {WEIGHTS_FILE}; .bin weights are "
                                   "not loaded)")
    return AdapterDir(Path(real), root)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_confined(adapter: AdapterDir, name: str) -> int:
    """A read-only descriptor of regular file `name` in `adapter`, reached from its root one
    component at a time without following symlinks (AdapterPathError when any component is
    now a link or missing, or the file is not a regular file). The caller closes it."""
    rel = os.path.relpath(os.path.join(adapter.real, name), adapter.root)
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or ".." in parts:
        raise AdapterPathError(f"{name} is outside the adapter directory's root")
    fd = os.open(adapter.root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | (0 if last else _DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError as e:
                raise AdapterPathError(
                    f"{os.path.join(adapter.real, name)} changed after it was checked (a "
                    f"component is now a link or gone: {e.strerror})") from None
            os.close(fd)
            fd = nxt
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterPathError(f"{name} in {str(adapter.real)!r} is not a regular file")
        return fd
    except BaseException:
        os.close(fd)
        raise


