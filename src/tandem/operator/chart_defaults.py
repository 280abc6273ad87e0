"""The Tandem chart's defaults, as `tandem render` mirrors them: the environment the chart's
`templates/deployment.yaml` gives the operator (TANDEM_IMAGE ... TANDEM_ALLOWED_NAMESPACES),
computed from the chart's values (`chart_values`: the package's copy of
`charts/tandem/values.yaml`), a release name and a namespace, as `helm install RELEASE
charts/tandem -n NAMESPACE [-f VALUES] [--set KEY=VALUE]` would give it (`parse_set`: helm's
`--set` syntax, the common case), after helm's check of the merged values against the
chart's values.schema.json (`check_values`, also a packaged copy).
tests/operator/test_dryrun_chart.py holds this module and the chart together (`helm
template`, compared variable by variable)."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml

from tandem.operator.crd_schema import unknown_fields, validate

APP_VERSION = "0.1.0"  # Chart.yaml appVersion: the images' default tag
CHART_NAME = "tandem"
RELEASE = "tandem"  # the README's `helm install tandem charts/tandem -n tandem-system`
NAMESPACE = "tandem-system"
REDIS_ADMIN_PASSWORD_FILE = "/etc/tandem/redis-admin/password"  # the chart's mount

VALUES_FILE = "values.yaml"  # the package's copies of charts/tandem/'s (byte for byte)
SCHEMA_FILE = "values.schema.json"


def _packaged(name: str) -> str:
    return (resources.files("tandem.operator") / "chart" / name).read_text("utf-8")


@functools.cache
def _chart_values() -> dict[str, Any]:
    return yaml.safe_load(_packaged(VALUES_FILE))


def chart_values() -> dict[str, Any]:
    """The chart's default values (a fresh copy of its values.yaml)."""
    return copy.deepcopy(_chart_values())


def _resolve(node: Any, definitions: Mapping[str, Any]) -> Any:
    """`node` with each `{"$ref": "#/definitions/NAME"}` replaced by that definition (the
    chart's schema has no recursive ones)."""
    if isinstance(node, list):
        return [_resolve(v, definitions) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        return _resolve(definitions[ref.removeprefix("#/definitions/")], definitions)
    return {k: _resolve(v, definitions) for k, v in node.items() if k != "definitions"}


@functools.cache
def values_schema() -> dict[str, Any]:
    """The chart's values.schema.json, its `$ref`s resolved."""
    schema = json.loads(_packaged(SCHEMA_FILE))
    return _resolve(schema, schema.get("definitions") or {})


class ValuesError(ValueError):
    """A values file `tandem render --values` cannot read as the chart's."""


def merge(base: Any, override: Any) -> Any:
    """Helm's coalescing of a values file over the defaults: mappings merge key by key, any
    other value replaces, and null deletes a default (a null with no default stays null)."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return copy.deepcopy(override)
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None and key in out:
            del out[key]
        else:
            out[key] = merge(out.get(key), value)
    return out


_INT = re.compile(r"[+-]?[0-9]+")


def typed(text: str) -> Any:
    """A `--set` value as helm types it: true/false/null in any case, a whole number that
    fits 64 bits and does not start with 0 (or is 0), else the string itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "null":
        return None
    if text == "0" or (text[:1] != "0" and _INT.fullmatch(text)
                       and -2**63 <= int(text) < 2**63):
        return int(text)
    return text


def _until(text: str, i: int, stops: str) -> tuple[str, int, str | None]:
    """(the characters from `i` up to the first unescaped one of `stops`, the index after
    it, that stop or None at the end); a backslash takes the next character as it is."""
    out = []
    while i < len(text):
        char = text[i]
        i += 1
        if char == "\\":
            out.append(text[i:i + 1])
            i += 1
        elif char in stops:
            return "".join(out), i, char
        else:
            out.append(char)
    return "".join(out), i, None


def parse_set(text: str, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """`helm --set TEXT` parsed into `into` (a new mapping by default), as helm's strvals:
    `a.b=v,c=w` (dotted paths; commas separate assignments), `{x,y}` a list, a backslash
    escapes `.`, `,`, `=`, `{` or `}`; values typed by `typed`. List indexes (`a[0].b=v`)
    are not supported (a values file says it); `ValuesError` for what helm also refuses
    and for an empty key."""
    into = {} if into is None else into
    i = 0
    while i < len(text):
        path: list[str] = []
        while True:
            key, i, stop = _until(text, i, ".=[,")
            if stop is None or stop == ",":
                raise ValuesError(f"{text!r}: key {'.'.join(path + [key])!r} has no value")
            if stop == "[":
                raise ValuesError(f"{text!r}: list indexes ({key}[...]) are not supported: "
                                  "give a list whole ({a,b}) or use --values")
            if not key:
                raise ValuesError(f"{text!r}: an empty key")
            path.append(key)
            if stop == "=":
                break
        if text[i:i + 1] == "{":
            value: Any = []
            i += 1
            while True:
                item, i, stop = _until(text, i, ",}")
                if stop is None:
                    raise ValuesError(f"{text!r}: list must terminate with '}}'")
                value.append(typed(item))
                if stop == "}":
                    i += text[i:i + 1] == ","
                    break
        else:
            raw, i, _ = _until(text, i, ",")
            value = typed(raw)
        node = into
        for n, key in enumerate(path[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ValuesError(f"{text!r}: {'.'.join(path[:n + 1])} is {child!r}, not a "
                                  "mapping")
            node = child
        node[path[-1]] = value
    return into


def load_values(texts: list[str], sets: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The chart's values with each YAML text (`helm -f`, in order) merged over them, then
    the `--set` texts (in order, into one mapping, as helm parses them) over those."""
    values = chart_values()
    for i, text in enumerate(texts, 1):
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValuesError(f"values file {i}: not valid YAML: {exc}") from None
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ValuesError(f"values file {i}: a mapping is expected, got "
                              f"{type(doc).__name__}")
        values = merge(values, doc)
    given: dict[str, Any] = {}
    for text in sets:
        parse_set(text, given)
    values = merge(values, given)
    check_values(values)
    return values


def check_values(values: Mapping[str, Any]) -> None:
    """`ValuesError` with what helm refuses of the merged `values` by the chart's
    values.schema.json: a key the chart does not have (`redis.enable`), a value of the wrong
    type, range or pattern, a required key deleted by a null."""
    schema = values_schema()
    errors = [f"{path}: the chart has no such value" for path in
              unknown_fields(schema, values, json_schema=True)]
    errors += validate(schema, values)
    if errors:
        raise ValuesError(
            "values don't meet the chart's values.schema.json: " + "; ".join(errors))


def _get(values: Mapping[str, Any], path: str, kind: type | tuple[type, ...]) -> Any:
    node: Any = values
    for key in path.split("."):
        node = node.get(key) if isinstance(node, Mapping) else None
    if node is None:
        node = kind() if isinstance(kind, type) else kind[0]()
    if not isinstance(node, kind):
        raise ValuesError(f"{path}: {type(node).__name__} is not "
                          f"{getattr(kind, '__name__', kind)}")
    return node


def _str(values: Mapping[str, Any], path: str) -> str:
    return str(_get(values, path, (str, int, float)))


def fullname(values: Mapping[str, Any], release: str) -> str:
    """The chart's `tandem.fullname`: the prefix of its resource names."""
    if _str(values, "fullnameOverride"):
        return _str(values, "fullnameOverride")[:63].rstrip("-")
    name = _str(values, "nameOverride") or CHART_NAME
    return (release if name in release else f"{release}-{name}")[:63].rstrip("-")


def images(values: Mapping[str, Any]) -> dict[str, str]:
    """The chart's image references: `tandem.image`, `.controlImage`, `.workerImage` and
    `.workerCudaImage` (a digest wins over a tag; an empty tag is the appVersion)."""
    repo, tag = _str(values, "image.repository"), _str(values, "image.tag") or APP_VERSION
    digest = _str(values, "image.digest")
    image = f"{repo}@{digest}" if digest else f"{repo}:{tag}"
    c_repo, c_digest = _str(values, "controlImage.repository"), _str(values,
                                                                      "controlImage.digest")
    control = (f"{c_repo}@{c_digest}" if c_repo and c_digest else
               f"{c_repo}:{_str(values, 'controlImage.tag') or APP_VERSION}" if c_repo
               else image)
    w_repo = _str(values, "workerImage.repository") or repo
    w_tag, w_digest = _str(values, "workerImage.tag"), _str(values, "workerImage.digest")
    worker = (f"{w_repo}@{w_digest}" if w_digest else
              f"{w_repo}:{w_tag or tag}" if _str(values, "workerImage.repository") or w_tag
              else image)
    cuda_digest = _str(values, "workerImage.cudaDigest")
    cuda = (f"{w_repo}@{cuda_digest}" if cuda_digest else
            f"{w_repo}:{_str(values, 'workerImage.cudaTag') or (w_tag or tag) + '-cu128'}")
    return {"image": image, "control": control, "worker": worker, "cuda": cuda}


def _join(values: Mapping[str, Any], path: str) -> str:
    return ",".join(str(v) for v in _get(values, path, list))


def operator_env(values: Mapping[str, Any] | None = None, release: str = RELEASE,
                 namespace: str = NAMESPACE) -> dict[str, str]:
    """The operator container's environment variables with a plain value, as the chart's
    Deployment sets them (TANDEM_OPERATOR_NAMESPACE, a fieldRef there, is `namespace`);
    `operator.env` entries with a `value` come last and win."""
    values = chart_values() if values is None else values
    img = images(values)
    env = {"TANDEM_IMAGE": img["image"], "TANDEM_ROUTER_IMAGE": img["control"],
           "TANDEM_WORKER_IMAGE": img["worker"], "TANDEM_WORKER_CUDA_IMAGE": img["cuda"],
           "TANDEM_IMAGE_PULL_POLICY": _str(values, "image.pullPolicy")}
    secrets = _get(values, "childImagePullSecrets", list)
    if secrets:
        env["TANDEM_IMAGE_PULL_SECRETS"] = ",".join(
            str(s.get("name", "")) if isinstance(s, Mapping) else "" for s in secrets)
    env["TANDEM_OPERATOR_NAMESPACE"] = namespace
    env["TANDEM_OPERATOR_RELEASE"] = release
    if _get(values, "redis.enabled", bool):
        redis = f"{fullname(values, release)}-redis"[:63].rstrip("-")
        port = _get(values, "redis.port", int)
        if isinstance(port, bool) or not 0 < port < 65536:
            raise ValuesError(f"redis.port: {port!r} is not a port (1-65535)")
        env["TANDEM_REDIS_ADDRESS"] = f"{redis}.{namespace}.svc:{port}"
        env["TANDEM_REDIS_ADMIN_PASSWORD_FILE"] = REDIS_ADMIN_PASSWORD_FILE
    env["TANDEM_ALLOW_HOST_PATH"] = str(_get(values, "security.allowHostPath", bool)).lower()
    for var, key in (("TANDEM_ALLOWED_RUNTIME_CLASSES", "allowedRuntimeClasses"),
                     ("TANDEM_ALLOWED_SECRETS", "allowedSecrets"),
                     ("TANDEM_ALLOWED_REGISTRIES", "allowedRegistries"),
                     ("TANDEM_ALLOWED_CLUSTER_ISSUERS", "allowedClusterIssuers")):
        env[var] = _join(values, f"security.{key}")
    env["TANDEM_ALLOWED_NAMESPACES"] = (_join(values, "watchNamespaces")
                                        or _join(values, "security.allowedNamespaces"))
    for var in _get(values, "operator.env", list):
        if isinstance(var, Mapping) and isinstance(var.get("name"), str) and "value" in var:
            env[var["name"]] = str(var["value"])
    return env
