"""Per-pool and router pod settings (`PodSettings`, `parse_pod_settings`): scheduling,
image, log level, pull secrets, env, extra volumes, pod labels/annotations and the rollout
strategy (`default_strategy`: a GPU pool replaces its pods one at a time).

Kubernetes' own types (affinity, topology spread constraints, volumes, env sources) are
passed through as dicts after a shape check here; the rendered Deployment is what the API
server validates in full. Names the operator owns are refused by `render.pod` (which knows
what it rendered): selector labels, `tandem.dev/` keys, the operator's env vars, volume
names and mount paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tandem.operator.fields import get, get_obj
from tandem.operator.model_uri import SpecError

_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_PERCENT_OR_INT = re.compile(r"^[0-9]+%$")
RESERVED_PREFIX = "tandem.dev/"
AFFINITY_KEYS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
VALUE_FROM_KEYS = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # `tandem --log-level`


@dataclass(frozen=True)
class Strategy:
    """RollingUpdate bounds: an int or a percentage string ("25%"); not both 0."""

    max_surge: int | str = 1
    max_unavailable: int | str = 0


SURGE = Strategy(1, 0)  # a new pod first: the router's and CPU pools' default
ONE_AT_A_TIME = Strategy(0, 1)  # GPU pools': a surge pod on a full GPU pool never schedules


def default_strategy(gpu: bool) -> Strategy:
    return ONE_AT_A_TIME if gpu else SURGE


@dataclass(frozen=True)
class PodSettings:
    image: str | None = None  # wins over spec.image and the operator's images
    log_level: str | None = None  # wins over spec.logLevel; None: that (or the CLI's INFO)
    affinity: dict[str, Any] = field(default_factory=dict)
    topology_spread_constraints: tuple[dict[str, Any], ...] = ()  # no labelSelector: the pool's
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()  # added to the operator's defaults
    env: tuple[dict[str, Any], ...] = ()
    env_from: tuple[dict[str, Any], ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()  # of `volumes` only, in the main container
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    strategy: Strategy = Strategy()
    node_selector: dict[str, str] = field(default_factory=dict)  # router only (pools: PoolSpec)
    tolerations: tuple[dict[str, Any], ...] = ()  # router only


def _items(d: dict, key: str, where: str) -> list[dict[str, Any]]:
    items = get(d, key, list, [], where)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise SpecError(f"{where}.{key}[{i}]: expected an object, got {item!r}")
    return [dict(x) for x in items]


def _name(item: dict, where: str, pattern: re.Pattern[str] = _DNS_LABEL) -> str:
    name = item.get("name")
    if not isinstance(name, str) or not pattern.match(name) or len(name) > 253:
        raise SpecError(f"{where}.name: {name!r} is not a valid name")
    return name


def _one_of(item: dict, keys: tuple[str, ...] | None, where: str) -> None:
    present = [k for k in item if k not in ("name", "prefix", "optional")
               and (keys is None or k in keys)]
    if len(present) != 1 or not isinstance(item[present[0]], dict):
        what = "a volume source" if keys is None else " or ".join(keys)
        raise SpecError(f"{where}: exactly one of {what} (an object), got {sorted(item)}")


def _env(items: list[dict], where: str) -> None:
    for i, e in enumerate(items):
        w = f"{where}.env[{i}]"
        _name(e, w, _ENV_NAME)
        if set(e) - {"name", "value", "valueFrom"}:
            raise SpecError(f"{w}: unknown keys {sorted(set(e) - {'name', 'value', 'valueFrom'})}")
        if "value" in e and not isinstance(e["value"], str):
            raise SpecError(f"{w}.value: expected a string, got {e['value']!r}")
        if "valueFrom" in e:
            if "value" in e:
                raise SpecError(f"{w}: value and valueFrom are exclusive")
            _one_of(dict(e["valueFrom"]) if isinstance(e["valueFrom"], dict) else {},
                    VALUE_FROM_KEYS, f"{w}.valueFrom")


def _labels(d: dict, key: str, where: str, values: bool) -> dict[str, str]:
    out = dict(get_obj(d, key, where))
    for k, v in out.items():
        prefix, _, name = k.rpartition("/")
        if (not name or len(name) > 63 or not _LABEL_NAME.match(name)
                or (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)))):
            raise SpecError(f"{where}.{key}: {k!r} is not a valid key")
        if k.startswith(RESERVED_PREFIX):
            raise SpecError(f"{where}.{key}: {k!r}: keys under {RESERVED_PREFIX} are the "
                            "operator's")
        if not isinstance(v, str) or values and (len(v) > 63 or not _LABEL_NAME.match(v)):
            raise SpecError(f"{where}.{key}.{k}: {v!r} is not a valid value")
    return out


label_map = _labels  # the same checks for another label map (`monitoring.labels`)


def _bound(s: dict, key: str, where: str) -> int | str | None:
    value = s.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) and value >= 0 or
                                       isinstance(value, str) and _PERCENT_OR_INT.match(value)):
        raise SpecError(f"{where}.{key}: {value!r}: a count >= 0 or a percentage like '25%'")
    return value


def _zero(value: int | str) -> bool:
    return str(value).rstrip("%") == "0"


def _strategy(d: dict, where: str, gpu: bool) -> Strategy:
    """The bounds given, the others from `default_strategy(gpu)`; an unset bound whose
    default would leave both at 0 is 1 instead (maxUnavailable 0 alone on a GPU pool
    surges by one pod)."""
    w = f"{where}.strategy"
    s = get_obj(d, "strategy", where)
    surge, unavailable = _bound(s, "maxSurge", w), _bound(s, "maxUnavailable", w)
    if surge is not None and unavailable is not None and _zero(surge) and _zero(unavailable):
        raise SpecError(f"{w}: maxSurge and maxUnavailable cannot both be 0 (no rollout could "
                        "progress)")
    default = default_strategy(gpu)
    if surge is None:
        surge = 1 if unavailable is not None and _zero(unavailable) else default.max_surge
    if unavailable is None:
        unavailable = 1 if _zero(surge) else default.max_unavailable
    return Strategy(surge, unavailable)


def parse_log_level(d: dict, where: str) -> str | None:
    level = get(d, "logLevel", str, None, where)
    if level is not None and level not in LOG_LEVELS:
        raise SpecError(f"{where}.logLevel: {level!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def parse_pod_settings(d: dict[str, Any], where: str, *, scheduling: bool,
                       gpu: bool = False) -> PodSettings:
    """`scheduling`: also read nodeSelector and tolerations (the router; pools keep theirs
    in `PoolSpec`); `gpu`: a pool that requests nvidia.com/gpu (its strategy's default)."""
    affinity = dict(get_obj(d, "affinity", where))
    if set(affinity) - set(AFFINITY_KEYS) or not all(isinstance(v, dict)
                                                      for v in affinity.values()):
        raise SpecError(f"{where}.affinity: only {', '.join(AFFINITY_KEYS)} (objects)")
    spread = _items(d, "topologySpreadConstraints", where)
    for i, c in enumerate(spread):
        w = f"{where}.topologySpreadConstraints[{i}]"
        skew = c.get("maxSkew")
        if isinstance(skew, bool) or not isinstance(skew, int) or skew < 1:
            raise SpecError(f"{w}.maxSkew: an integer >= 1, got {skew!r}")
        if not isinstance(c.get("topologyKey"), str) or not c["topologyKey"]:
            raise SpecError(f"{w}.topologyKey is required")
        if c.get("whenUnsatisfiable") not in WHEN_UNSATISFIABLE:
            raise SpecError(f"{w}.whenUnsatisfiable: one of {', '.join(WHEN_UNSATISFIABLE)}")
    secrets = _items(d, "imagePullSecrets", where)
    for i, s in enumerate(secrets):
        _name(s, f"{where}.imagePullSecrets[{i}]", _DNS_SUBDOMAIN)
    env, env_from = _items(d, "env", where), _items(d, "envFrom", where)
    _env(env, where)
    for i, e in enumerate(env_from):
        _one_of(e, ("configMapRef", "secretRef"), f"{where}.envFrom[{i}]")
    volumes, mounts = _items(d, "volumes", where), _items(d, "volumeMounts", where)
    names = [_name(v, f"{where}.volumes[{i}]") for i, v in enumerate(volumes)]
    for i, v in enumerate(volumes):
        _one_of(v, None, f"{where}.volumes[{i}]")
    if len(set(names)) != len(names):
        raise SpecError(f"{where}.volumes: duplicate names")
    for i, m in enumerate(mounts):
        w = f"{where}.volumeMounts[{i}]"
        if m.get("name") not in names:
            raise SpecError(f"{w}.name: {m.get('name')!r} is not one of {where}.volumes")
        if not isinstance(m.get("mountPath"), str) or not m["mountPath"].startswith("/"):
            raise SpecError(f"{w}.mountPath: an absolute path, got {m.get('mountPath')!r}")
    return PodSettings(
        image=get(d, "image", str, None, where), log_level=parse_log_level(d, where),
        affinity=affinity, topology_spread_constraints=tuple(spread),
        priority_class_name=get(d, "priorityClassName", str, None, where),
        runtime_class_name=get(d, "runtimeClassName", str, None, where),
        image_pull_secrets=tuple(dict.fromkeys(s["name"] for s in secrets)),
        env=tuple(env), env_from=tuple(env_from), volumes=tuple(volumes),
        volume_mounts=tuple(mounts),
        labels=_labels(d, "podLabels", where, values=True),
        annotations=_labels(d, "podAnnotations", where, values=False),
        strategy=_strategy(d, where, gpu),
        node_selector=dict(get_obj(d, "nodeSelector", where)) if scheduling else {},
        tolerations=tuple(dict(t) for t in get(d, "tolerations", list, [], where))
        if scheduling else ())
