"""`spec.kvCache`: KV tiers under every worker's device pool and the router's peer pulls
(`KVCacheSpec`, `parse_kv_cache`).

    kvCache:
      offload:
        hostBytes: 8Gi        # host-memory tier (--kv-offload-host-bytes); required
        diskBytes: 100Gi      # disk tier under it (--kv-offload-disk-bytes)
        diskPath: /kv         # where (--kv-offload-disk-path); default DEFAULT_DISK_PATH
        diskClaimName: kv-pvc # a PersistentVolumeClaim mounted there; default: an emptyDir
                              # with sizeLimit diskBytes
        compression: none     # none | zlib (--kv-offload-compression)
      peerPull:
        enabled: true         # the router names a holder of the prefix (--no-peer-pull)

Byte sizes are whole bytes or Kubernetes binary/decimal quantities (8Gi, 500M)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tandem.operator.fields import get, get_enum, get_obj
from tandem.operator.model_uri import SpecError
from tandem.protocol.engine_flags import KV_OFFLOAD_COMPRESSIONS

DEFAULT_DISK_PATH = "/var/cache/tandem-kv"
_SIZE = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_OFFLOAD_KEYS = {"hostBytes", "diskBytes", "diskPath", "diskClaimName", "compression"}
_KEYS = {"offload", "peerPull"}
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class OffloadSpec:
    host_bytes: int
    disk_bytes: int = 0  # 0: no disk tier
    disk_path: str | None = None  # set exactly when disk_bytes is
    disk_claim: str | None = None  # a PVC mounted at disk_path; None: an emptyDir
    compression: str = "none"


@dataclass(frozen=True)
class KVCacheSpec:
    offload: OffloadSpec | None = None
    peer_pull: bool = True


def byte_quantity(value: Any, where: str) -> int:
    """Whole bytes from an integer or a quantity like 8Gi; SpecError naming `where`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise SpecError(f"{where}: {value} is negative")
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None:
        raise SpecError(f"{where}: {value!r} is not bytes (an integer, or like 8Gi or 500M)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _offload(d: dict[str, Any]) -> OffloadSpec:
    where = "kvCache.offload"
    unknown = set(d) - _OFFLOAD_KEYS
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if "hostBytes" not in d:
        raise SpecError(f"{where}.hostBytes is required (the host tier; disk is under it)")
    host = byte_quantity(d["hostBytes"], f"{where}.hostBytes")
    if host == 0:
        raise SpecError(f"{where}.hostBytes must be > 0 (leave kvCache.offload out for none)")
    disk = byte_quantity(d.get("diskBytes", 0), f"{where}.diskBytes")
    path = get(d, "diskPath", str, None, where)
    claim = get(d, "diskClaimName", str, None, where)
    if (path is not None or claim is not None) and not disk:
        raise SpecError(f"{where}.diskPath and diskClaimName need {where}.diskBytes > 0")
    if path is not None and (not path.startswith("/") or len(path) > 1024 or ".." in path):
        raise SpecError(f"{where}.diskPath {path!r}: an absolute path without '..'")
    if claim is not None and not _CLAIM.match(claim):
        raise SpecError(f"{where}.diskClaimName {claim!r}: a PersistentVolumeClaim name")
    return OffloadSpec(host, disk, (path or DEFAULT_DISK_PATH) if disk else None, claim,
                       get_enum(d, "compression", "none", where, KV_OFFLOAD_COMPRESSIONS))


def parse_kv_cache(d: dict[str, Any] | None) -> KVCacheSpec:
    if not d:
        return KVCacheSpec()
    unknown = set(d) - _KEYS
    if unknown:
        raise SpecError(f"kvCache: unknown field(s) {', '.join(sorted(unknown))}")
    offload = get_obj(d, "offload", "kvCache")
    pull = get_obj(d, "peerPull", "kvCache")
    if set(pull) - {"enabled"}:
        raise SpecError("kvCache.peerPull: only 'enabled' is known")
    return KVCacheSpec(_offload(offload) if offload else None,
                       get(pull, "enabled", bool, True, "kvCache.peerPull"))
