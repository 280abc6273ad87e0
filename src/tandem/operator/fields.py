"""Typed readers for a raw spec dict: each names the field (`where.key`) in its `SpecError`."""

from __future__ import annotations

import re
from typing import Any

from tandem.operator.model_uri import SpecError

GPU = "nvidia.com/gpu"
# dataclass field metadata: `config_hash` leaves the field out while it holds its default (a
# field added after pools were deployed keeps their hash, so an operator upgrade rolls none)
HASH_IF_SET_KEY = "hash_if_set"
HASH_IF_SET: dict[str, bool] = {HASH_IF_SET_KEY: True}
_KV_MEMORY = re.compile(r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_QUANTITY = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|"
                       r"[eE][+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))?$")
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any,
        where: str) -> Any:
    value = d.get(key, default)
    if value is None or value is default:
        return value
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise SpecError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, "
                        f"got {value!r}")
    return value


def get_int(d: dict, key: str, default: int | None, where: str, lo: int = 0,
            hi: int = 1 << 31) -> Any:
    value = get(d, key, int, default, where)
    if value is not None and not lo <= value <= hi:
        raise SpecError(f"{where}.{key}: {value} is not in [{lo}, {hi}]")
    return value


def get_num(d: dict, key: str, default: float | None, where: str) -> float | None:
    value = get(d, key, (int, float), default, where)
    if value is not None and value < 0:
        raise SpecError(f"{where}.{key}: {value} is negative")
    return None if value is None else float(value)


def get_enum(d: dict, key: str, default: str, where: str, allowed: tuple[str, ...]) -> str:
    value = get(d, key, str, default, where)
    if value not in allowed:
        raise SpecError(f"{where}.{key}: {value!r} is not one of {', '.join(allowed)}")
    return value


def get_obj(d: dict, key: str, where: str) -> dict[str, Any]:
    return get(d, key, dict, None, where) or {}


def kv_memory(value: str | None) -> str | None:
    if value is None:
        return None
    m = _KV_MEMORY.match(value)
    if not m:
        raise SpecError(f"engine.kvCacheMemory {value!r}: a fraction like 0.5 or bytes like 8Gi")
    number = float(m.group(1))
    if m.group(3):
        return str(int(number * _UNITS[m.group(3)]))
    if number <= 0 or (number > 1 and number != int(number)):
        raise SpecError(f"engine.kvCacheMemory {value!r}: a fraction in (0, 1] or whole bytes")
    return str(int(number)) if number > 1 else repr(number)


def resources(d: dict, where: str) -> dict[str, dict[str, int | str]]:
    out = {k: dict(get_obj(d, k, where)) for k in ("requests", "limits") if k in d}
    for kind, values in out.items():
        for name, q in values.items():
            if isinstance(q, bool) or not isinstance(q, int | str) or not _QUANTITY.match(str(q)):
                raise SpecError(f"{where}.{kind}.{name}: {q!r} is not a quantity")
    requests, limits = out.get("requests", {}), out.get("limits", {})
    if GPU in requests and str(requests[GPU]) != str(limits.get(GPU)):
        raise SpecError(f"{where}: {GPU} requests must equal its limits (set limits only)")
    if GPU in limits and GPU not in requests and requests:
        out["requests"] = {**requests, GPU: limits[GPU]}
    return out
