"""router.yaml: every key it may set, with its type and range (`RouterConfig`), read and
checked at start-up (`load_config`, `check_config`), before anything binds.

A key the router does not know is refused with its path (`unknown key "rate_limits.tenant"`),
never ignored; so is a value of the wrong type or out of range. `None` (an empty YAML value)
means the key is unset. `weights` is merged over the cache-aware policy's defaults
(`policy.DEFAULT_WEIGHTS`): a scorer left out keeps its default weight, 0 switches it off.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from tandem.router.flowcontrol.policies import FAIRNESS, ORDERINGS
from tandem.router.guardrails.config import GuardrailsConfig
from tandem.router.policy import DEFAULT_WEIGHTS, POLICIES
from tandem.router.scorers import SCORERS

_POLICIES = tuple(sorted(POLICIES))
_SCORERS = tuple(sorted(SCORERS))

Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]
Weight = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class RouterConfigError(ValueError):
    """router.yaml is unreadable or invalid; the message is one line naming the key (the CLI
    reports it as a usage error, exit 2)."""


class _Strict(BaseModel):
    """No unknown keys, no coercion (a YAML string is not a number, a number not a bool)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# one optional field per registered scorer: `weights.astrology` is an unknown key like any
Weights: type[_Strict] = create_model(  # type: ignore[call-overload]
    "Weights", __base__=_Strict, **{name: (Weight | None, None) for name in _SCORERS})


class Limits(_Strict):
    """A rate-limit bucket pair (`ratelimit.Limits`); 0 = unlimited."""

    requests_per_s: Rate | None = None
    burst_requests: Rate | None = None
    tokens_per_min: Rate | None = None


class RateLimits(_Strict):
    default: Limits | None = None
    tenants: dict[str, Limits] | None = None


class PriorityRange(_Strict):
    """`priority.PriorityRange` checks min <= default <= max and the bounds."""

    min: int | None = None
    max: int | None = None
    default: int | None = None


class Priority(_Strict):
    default: PriorityRange | None = None
    tenants: dict[str, PriorityRange] | None = None


class Saturation(_Strict):
    """A worker is saturated at >= `waiting` waiting requests or `kv` KV-cache use."""

    waiting: Positive | None = None
    kv: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None


class BandLimit(_Strict):
    max_requests: Positive | None = None
    max_bytes: Positive | None = None


Band = Annotated[int, Field(ge=-(1 << 31), le=(1 << 31) - 1)]


class FlowControlConfig(_Strict):
    """`flowcontrol.settings.FlowSettings`: the queue in front of saturated workers."""

    enabled: bool | None = None
    fairness: Literal[tuple(sorted(FAIRNESS))] | None = None  # type: ignore[valid-type]
    ordering: Literal[tuple(sorted(ORDERINGS))] | None = None  # type: ignore[valid-type]
    ttl_s: Seconds | None = None
    saturation: Saturation | None = None
    bands: dict[Band | Literal["default"], BandLimit] | None = None
    tenant_weights: dict[str, Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
                         ] | None = None
    shared: bool | None = None


class ServedModel(_Strict):
    """A model listed and held (its requests queued) even with no worker: scale from zero."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    start_timeout_s: Seconds | None = None


class RouterConfig(_Strict):
    """Every router.yaml key (`tandem.router.main`'s docstring says what each does); the
    flags of the same names (dashes for underscores) win over them."""

    workers: list[str] | None = None
    discovery: Literal["static", "kubernetes"] | None = None
    namespace: str | None = None
    label_selector: str | None = None
    inference_service: str | None = None
    router_group: str | None = None
    worker_port_name: str | None = None
    policy: Literal[_POLICIES] | None = None  # type: ignore[valid-type]
    weights: Weights | None = None  # type: ignore[valid-type]
    saturation_queue: Positive | None = None
    saturation_kv: Annotated[float, Field(gt=0, le=1)] | None = None
    speculative_ttl_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] | None = None
    churn_half_life_s: Seconds | None = None
    pd_threshold: Count | None = None
    pd_max_prefill_queue: Count | None = None
    pd_max_local_prefill: Count | None = None
    peer_pull: bool | None = None
    pd_decision: Literal["cost", "threshold"] | None = None
    pd_itl_weight: Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False)] | None = None
    pd_stall_budget: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] | None = None
    retries: Count | None = None
    max_migrations: Count | None = None
    max_prompt_tokens: Positive | None = None
    max_tokens_cap: Positive | None = None
    max_body_bytes: Positive | None = None
    tokenizers: dict[str, str] | None = None
    processes: Positive | None = None
    redis: str | None = None
    index: str | None = None
    redis_key_prefix: str | None = None
    drain_seconds: Annotated[float, Field(ge=0, lt=86400, allow_inf_nan=False)] | None = None
    debug_headers: bool | None = None
    metrics_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    metrics_auth: bool | None = None
    openapi: bool | None = None
    send_timeout_seconds: Seconds | None = None
    max_connections: Positive | None = None
    priority: Priority | None = None
    rate_limits: RateLimits | None = None
    flow_control: FlowControlConfig | None = None
    served_models: list[ServedModel] | None = None
    # the gateway's endpoint picker (`extproc`): its port and address, and each
    # InferenceObjective's priority (its flow-control band; higher is served first)
    ext_proc_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    ext_proc_host: str | None = None
    ext_proc_fallbacks: Count | None = None
    # mutual TLS on the picker's port: the client CA (PEM path) and the client names served
    ext_proc_tls_client_ca: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    ext_proc_allowed_clients: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=2048)]],
        Field(min_length=1, max_length=64)] | None = None
    objectives: dict[str, Annotated[int, Field(ge=-(1 << 31), lt=1 << 31)]] | None = None
    inference_pool: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    # input, output and policy guardrails (`guardrails.config`)
    guardrails: GuardrailsConfig | None = None


def check_config(data: Any, source: str = "router.yaml") -> dict[str, Any]:
    """`data` checked against `RouterConfig`: the keys that are set, as plain values
    (`RouterConfigError` naming the first bad key, prefixed with `source`)."""
    if not isinstance(data, Mapping):
        raise RouterConfigError(f"{source}: expected a mapping of keys, not {data!r}")
    try:
        config = RouterConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise RouterConfigError(f"{source}: {_describe(exc.errors()[0])}") from None
    cfg = config.model_dump(exclude_none=True)
    from tandem.router.priority import PriorityPolicy

    try:  # each range's min <= default <= max, within bounds
        PriorityPolicy.from_dict(cfg.get("priority"))
    except ValueError as exc:
        raise RouterConfigError(f"{source}: priority.{exc}") from None
    if "guardrails" in cfg:  # each pattern compiles, by a linear-time engine
        from tandem.router.guardrails import Guardrails

        try:
            Guardrails.from_config(cfg["guardrails"])
        except ValueError as exc:
            raise RouterConfigError(f"{source}: guardrails: {exc}") from None
    return cfg


def load_config(path: str | None) -> dict[str, Any]:
    """router.yaml at `path` (None or "": no file, no keys), checked by `check_config`."""
    if not path:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise RouterConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # e.g. a binary file given by mistake
        raise RouterConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})"
                                ) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise RouterConfigError(f"{path}: not valid YAML{line}: "
                                f"{getattr(exc, 'problem', None) or exc}") from None
    return check_config({} if data is None else data, path)


def merged_weights(weights: Mapping[str, float] | None) -> dict[str, float]:
    """router.yaml's `weights` over the defaults: a scorer left out keeps its default."""
    return {**DEFAULT_WEIGHTS, **(weights or {})}


def _describe(error: Mapping[str, Any]) -> str:
    path = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        known = _known(error["loc"][:-1])
        near = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
        hint = f'did you mean "{near[0]}"? ' if near else ""
        return f'unknown key "{path}" ({hint}known: {", ".join(known)})'
    message = str(error["msg"])
    message = message[:1].lower() + message[1:]
    return f"{path}: {message}, not {error['input']!r}"


def _known(loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed at `loc` (a path into `RouterConfig`)."""
    model: Any = RouterConfig
    for part in loc:
        if isinstance(model, type) and issubclass(model, BaseModel):
            model = _unwrap(model.model_fields[str(part)].annotation)
        elif typing.get_origin(model) is dict:  # a tenant's name
            model = _unwrap(typing.get_args(model)[1])
        elif typing.get_origin(model) is list:  # an item's index
            model = _unwrap(typing.get_args(model)[0])
    if isinstance(model, type) and issubclass(model, BaseModel):
        return sorted(model.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation
