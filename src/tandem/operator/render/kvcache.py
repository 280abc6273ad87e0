"""What `spec.kvCache` renders: the workers' KV tier flags and the disk tier's volume
(`worker_kv_cache`), and the router's peer-pull flag (`router_peer_pull_args`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.operator.spec_kvcache import KVCacheSpec
from tandem.protocol import engine_flags as flags

KV_DISK_VOLUME = "kv-offload"


@dataclass
class WorkerKVCache:
    args: list[str] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)


def worker_kv_cache(spec: KVCacheSpec) -> WorkerKVCache:
    """Every role's worker gets the tiers (a prefill worker's evicted prefixes reload too)."""
    o = spec.offload
    if o is None:
        return WorkerKVCache()
    out = WorkerKVCache([flags.KV_OFFLOAD_HOST_BYTES, str(o.host_bytes)])
    if o.compression != "none":
        out.args += [flags.KV_OFFLOAD_COMPRESSION, o.compression]
    if o.disk_bytes:
        assert o.disk_path is not None
        out.args += [flags.KV_OFFLOAD_DISK_PATH, o.disk_path,
                     flags.KV_OFFLOAD_DISK_BYTES, str(o.disk_bytes)]
        source: dict[str, Any] = (
            {"persistentVolumeClaim": {"claimName": o.disk_claim}} if o.disk_claim else
            {"emptyDir": {"sizeLimit": str(o.disk_bytes)}})
        out.volumes.append({"name": KV_DISK_VOLUME, **source})
        out.mounts.append({"name": KV_DISK_VOLUME, "mountPath": o.disk_path})
    return out


def router_peer_pull_args(spec: KVCacheSpec) -> list[str]:
    """The router pulls from peers by default; only a disabled peerPull is rendered."""
    return [] if spec.peer_pull else ["--no-peer-pull"]
