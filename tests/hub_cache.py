"""A Hugging Face hub cache written by hand, as huggingface_hub lays it out:
`models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
refs/<revision>}` (what `snapshot_download` leaves behind), and a guard that fails any
network connection."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def add_snapshot(cache: Path, repo: str, files: Mapping[str, bytes | Path],
                 refs: tuple[str, ...] = ("main",), commit: str | None = None) -> Path:
    """Files (name -> bytes, or a file to copy) as the snapshot `commit` (default: a hash of
    their contents) of `repo`, each of `refs` pointing at it; returns the snapshot dir."""
    root = cache / ("models--" + repo.replace("/", "--"))
    data = {name: v if isinstance(v, bytes) else Path(v).read_bytes() for name, v in files.items()}
    if commit is None:
        commit = hashlib.sha1(b"".join(hashlib.sha1(n.encode() + d).digest()
                                       for n, d in sorted(data.items()))).hexdigest()
    snapshot = root / "snapshots" / commit
    for name, blob in data.items():
        digest = hashlib.sha256(blob).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / digest).write_bytes(blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / "blobs" / digest, link.parent), link)
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def snapshot_of(hub_home: Path, repo: str, ref: str) -> str:
    """The snapshot directory `ref` of `repo` points at in the cache under `hub_home`
    (`HF_HOME`: its `hub` folder)."""
    root = hub_home / "hub" / ("models--" + repo.replace("/", "--"))
    return str(root / "snapshots" / (root / "refs" / ref).read_text())


def go_offline(monkeypatch, hub_home: Path) -> None:
    """This test's hub cache is `hub_home` (`HF_HOME`) and `HF_HUB_OFFLINE=1`."""
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def add_model_dir(cache: Path, repo: str, model_dir: Path, **kwargs) -> Path:
    """Every file of `model_dir` as a snapshot of `repo` (see `add_snapshot`)."""
    files = {str(p.relative_to(model_dir)): p for p in sorted(model_dir.rglob("*"))
             if p.is_file()}
    return add_snapshot(cache, repo, files, **kwargs)


@contextmanager
def no_network() -> Iterator[list[tuple]]:
    """Every TCP/UDP connect in this process fails (and is recorded): proof that nothing
    reached for the network."""
    tries: list[tuple] = []
    real_connect = socket.socket.connect

    def refuse(sock: socket.socket, address: object) -> None:
        if sock.family == socket.AF_UNIX:
            return real_connect(sock, address)
        tries.append(address)  # type: ignore[arg-type]
        raise OSError(f"network disabled in this test: connect to {address}")

    socket.socket.connect = refuse  # type: ignore[method-assign]
    try:
        yield tries
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
