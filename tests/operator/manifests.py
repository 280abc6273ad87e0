"""Helpers for tests of rendered manifests."""

from __future__ import annotations

from typing import Any

from tandem.operator.render import Owner, render_all
from tandem.operator.spec import parse_spec
from tests.operator.samples import spec

OWNER = Owner(name="demo", namespace="ml", uid="0b5c6a9e-1111-4222-8333-444455556666")
K8S = "1.32"


def render(name_or_spec: str | dict, **kw: Any) -> list[dict[str, Any]]:
    raw = spec(name_or_spec) if isinstance(name_or_spec, str) else name_or_spec
    return render_all(parse_spec(raw), OWNER, image="tandem:test", **kw)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def set_path(raw: dict, path: str, value: Any) -> dict:
    """Set `raw`'s value at a dotted `path` (creating maps on the way); returns `raw`."""
    node = raw
    *keys, last = path.split(".")
    for k in keys:
        node = node.setdefault(k, {})
    node[last] = value
    return raw
