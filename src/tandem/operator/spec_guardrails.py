"""`spec.router.guardrails` -> router.yaml `guardrails` (`GuardrailsSpec`, `parse_guardrails`).

The CRD's keys are router.yaml's, camelCased one for one (`maxChars` <-> `max_chars`);
tenant names under `policies.tenants` are kept verbatim. One key differs: a classifier's
`apiKeySecretRef {name, key}` (a Secret key) becomes `api_key_file`, the path where the
router pod mounts that key read-only (`KEYS_DIR/<guardrail>/api-key`, `key_volume`).

The converted dict is checked by the router's own checker (`tandem.router.config
.check_config`), patterns compiled by its engine (RE2), so what the operator admits is what
the router starts with; the rendered dict is the checker's (the router's defaults filled in).
A `SpecError` names the CRD path (`router.guardrails.input[0].maxChars`). The router's
modules are imported only when a spec sets guardrails (the operator stays torch-free and
light either way).
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from typing import Any

from tandem.operator.model_uri import SpecError
from tandem.operator.spec_security import SecretKeyRef, secret_key_ref

KEYS_DIR = "/etc/tandem/guardrails"  # the router pod's mount of the classifiers' API keys
KEYS_VOLUME = "guardrail-keys"
KEY_FILE = "api-key"
SECRET_REF = "apiKeySecretRef"  # the CRD's key for router.yaml's `api_key_file`
LAYERS = ("input", "output")
_CAMEL = re.compile(r"^[a-z][a-zA-Z0-9]*$")


@dataclass(frozen=True)
class GuardrailKey:
    """A classifier's API key: Secret key `secret`, mounted at `KEYS_DIR/<path>`."""

    guardrail: str
    secret: SecretKeyRef

    @property
    def path(self) -> str:
        return f"{self.guardrail}/{KEY_FILE}"


@dataclass(frozen=True)
class GuardrailsSpec:
    """router.yaml `guardrails` as the router checked it (`config`, snake_case keys) and the
    Secret keys its classifiers read (`keys`)."""

    config: dict[str, Any] = field(default_factory=dict)
    keys: tuple[GuardrailKey, ...] = ()

    def key_volume(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(the pod volume, the router container's read-only mount) of `keys`; None: none."""
        if not self.keys:
            return None
        sources = [{"secret": {"name": k.secret.name,
                               "items": [{"key": k.secret.key, "path": k.path}]}}
                   for k in self.keys]
        return ({"name": KEYS_VOLUME, "projected": {"defaultMode": 0o440, "sources": sources}},
                {"name": KEYS_VOLUME, "mountPath": KEYS_DIR, "readOnly": True})


def snake(key: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)


def camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def to_router_yaml(d: dict[str, Any], where: str = "router.guardrails"
                   ) -> tuple[dict[str, Any], tuple[GuardrailKey, ...]]:
    """The CRD's `d` with router.yaml's keys (unchecked, but for the key spelling and the
    Secret references) and the Secret keys it mounts."""
    keys: list[GuardrailKey] = []

    def walk(value: Any, w: str, path: tuple[Any, ...]) -> Any:
        if isinstance(value, list):
            return [walk(v, f"{w}[{i}]", (*path, i)) for i, v in enumerate(value)]
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, v in value.items():
            if path == ("policies", "tenants"):  # a tenant's name, verbatim
                out[key] = walk(v, f"{w}.{key}", (*path, key))
            elif not isinstance(key, str) or not _CAMEL.match(key) or camel(snake(key)) != key:
                hint = f" (keys are camelCase: {camel(key)})" if isinstance(key, str) else ""
                raise SpecError(f'{w}: unknown key "{key}"{hint}')
            elif key == SECRET_REF and len(path) == 2 and path[0] in LAYERS:
                if not isinstance(v, dict) or set(v) - {"name", "key"}:
                    raise SpecError(f"{w}.{key}: expected an object {{name, key}}, got {v!r}")
                ref = secret_key_ref(v, f"{w}.{key}", KEY_FILE)
                assert ref is not None  # `v` is an object
                keys.append(GuardrailKey(str(value.get("name")), ref))
                out["api_key_file"] = f"{KEYS_DIR}/{keys[-1].path}"
            else:
                out[snake(key)] = walk(v, f"{w}.{key}", (*path, snake(key)))
        return out

    return walk(d, where, ()), tuple(keys)


def parse_guardrails(d: Any, where: str = "router.guardrails") -> GuardrailsSpec | None:
    """`spec.router.guardrails` converted and checked by the router; None when unset.
    `SpecError` names the first bad field by its CRD path."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise SpecError(f"{where}: expected an object, got {d!r}")
    converted, keys = to_router_yaml(d, where)
    from tandem.router.config import RouterConfigError, check_config

    try:
        checked = check_config({"guardrails": converted})
    except RouterConfigError as exc:
        raise SpecError(_explain(converted, str(exc), where)) from None
    return GuardrailsSpec(checked.get("guardrails", {}), keys)


# ---- the router's complaint, by CRD path ---------------------------------------------------

def _explain(converted: dict[str, Any], message: str, where: str) -> str:
    from pydantic import ValidationError

    from tandem.router.guardrails.config import GuardrailsConfig

    try:
        GuardrailsConfig.model_validate(converted)
    except ValidationError as exc:
        return _describe(exc.errors()[0], where)
    detail = message.split(": guardrails: ", 1)[-1]  # a pattern that does not compile
    m = re.match(r"guardrail (\S+): (.*)", detail, re.S)
    if m:
        for layer in LAYERS:
            for i, entry in enumerate(converted.get(layer) or ()):
                if entry.get("name") == m.group(1):
                    at = ".pattern" if entry.get("type") == "regex" else ""
                    return f'{where}.{layer}[{i}]{at}: guardrail "{m.group(1)}": {m.group(2)}'
    return f"{where}: {detail}"


def _describe(error: Any, where: str) -> str:
    loc = list(error["loc"])
    if len(loc) > 2 and loc[0] in LAYERS and isinstance(loc[1], int):
        del loc[2]  # the entry's type (the union's tag)
    path = where + "".join(_part(loc, n) for n in range(len(loc)))
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        known = ", ".join(_known(list(error["loc"][:-1])))
        return f'{path}: unknown key ({"known: " + known if known else "none known here"})'
    if error["type"] == "union_tag_not_found":
        return f"{path}.type: required"
    if error["type"] == "union_tag_invalid":
        ctx = error.get("ctx") or {}
        return (f"{path}.type: {ctx.get('tag')!r} is not one of "
                f"{str(ctx.get('expected_tags', '')).replace(chr(39), '')}")
    if error["type"] == "value_error" and not loc:  # names and policies: across entries
        head, sep, rest = message.partition(": ")
        return f"{where}.{head}: {rest}" if sep and head.startswith("policies.") else (
            f"{where}: {message}")
    return f"{path}: {message[:1].lower() + message[1:]}, not {error['input']!r}"


def _part(loc: list[Any], n: int) -> str:
    part = loc[n]
    if part == "[key]":  # a tenant's name itself
        return ""
    if isinstance(part, int):
        return f"[{part}]"
    if n == 2 and loc[:2] == ["policies", "tenants"]:
        return f".{part}"
    return f".{SECRET_REF}" if part == "api_key_file" else f".{camel(str(part))}"


def _known(loc: list[Any]) -> list[str]:
    """The CRD keys allowed at `loc` (the router's loc, the entries' type tags included)."""
    from tandem.router.guardrails import config as g

    model: Any = None
    if not loc:
        model = g.GuardrailsConfig
    elif loc[0] in LAYERS and len(loc) == 3:
        entries = g.InputEntry if loc[0] == "input" else g.OutputEntry
        union = typing.get_args(entries)[0]
        model = {typing.get_args(c.model_fields["type"].annotation)[0]: c
                 for c in typing.get_args(union)}.get(loc[2])
    elif loc[0] == "policies":
        model = g.Policies if len(loc) == 1 else g.Policy
    elif loc == ["audit"]:
        model = g.Audit
    if model is None:
        return []
    return sorted(SECRET_REF if k == "api_key_file" else camel(k) for k in model.model_fields)
