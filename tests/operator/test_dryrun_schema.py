"""`tandem render` judges an InferenceService by the CRD's own openAPIV3Schema, as the API
server does under `kubectl apply`'s strict field validation: an unknown field is refused with
its path (exit 1, kubectl's message), a value the schema does not allow is refused naming the
field; every shipped example and every InferenceService in README.md and docs/ renders.
Seeded randomized checks: an unknown key inserted at any depth of an example is reported at
its exact path (and the document renders again without it); a value mutated anywhere is
refused exactly when openapi-schema-validator (OpenAPI 3.0) refuses it, at the same path."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import random
import re
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from tandem.cli import build_parser
from tandem.operator.crd_schema import (
    Invalid,
    check,
    crd_schema,
    drop_nulls_and_default,
    unknown_fields,
    validate,
)
from tandem.operator.dryrun import render, run
from tests.operator.test_dryrun import EXAMPLES, ROOT, needs, tandem_render

SCHEMA = crd_schema().schema
SMOLLM2 = next(p for p in EXAMPLES if p.stem == "aggregated")  # metadata.name: smollm2


def example(path: Path = SMOLLM2) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def render_cli(doc: dict[str, Any], *flags: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `tandem render -f - FLAGS` on `doc`, in this process
    with no TANDEM_* variable set (the real process:
    test_several_unknown_fields_are_named_together_as_kubectl_does)."""
    args = build_parser().parse_args(["render", "-f", "-", *flags])
    out, err = io.StringIO(), io.StringIO()
    bare = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    with contextlib.redirect_stderr(err), mock.patch.dict(os.environ, bare, clear=True):
        code = run(args, stdin=io.StringIO(yaml.safe_dump(doc)), stdout=out)
    return code, out.getvalue(), err.getvalue()


def render_ok(doc: dict[str, Any]) -> str:
    """`tandem render -n ml` of `doc`, with the values it needs (`needs`)."""
    args = build_parser().parse_args(["render", "-f", "-", "-n", "ml", *needs(doc)])
    return render(args, yaml.safe_dump(doc), {})


@pytest.mark.parametrize("where, field", [
    (("decode",), "replica"),
    ((), "foo"),
    (("decode", "engine"), "tensorParallelSize"),
    ((), "engine"),
])
def test_an_unknown_field_is_refused_with_its_path(where: tuple[str, ...], field: str) -> None:
    doc = example()
    node = doc["spec"]
    for key in where:
        node = node[key]
    node[field] = 2
    path = ".".join(("spec", *where, field))
    assert render_cli(doc) == (1, "", f'tandem render: stdin: InferenceService "smollm2": '
                               f'strict decoding error: unknown field "{path}"\n')


def test_several_unknown_fields_are_named_together_as_kubectl_does() -> None:
    doc = example()
    doc["spec"]["decode"]["replica"] = 3
    doc["spec"]["foo"] = {"bar": 1}
    doc["metadata"]["lables"] = {"a": "b"}
    proc = tandem_render("-f", "-", stdin=yaml.safe_dump(doc))
    assert proc.returncode == 1
    assert proc.stderr == ('tandem render: stdin: InferenceService "smollm2": strict decoding '
                           'error: unknown field "metadata.lables", unknown field '
                           '"spec.decode.replica", unknown field "spec.foo"\n')


@pytest.mark.parametrize("change, message", [
    ({"decode": {"replicas": -1}}, "spec.decode.replicas: Invalid value: -1: spec.decode."
     "replicas in body should be greater than or equal to 0"),
    ({"decode": {"replicas": "two"}}, 'spec.decode.replicas: Invalid value: "two": spec.decode.'
     'replicas in body must be of type integer: "string"'),
    ({"router": {"policy": "fastest"}}, 'spec.router.policy: Unsupported value: "fastest": '
     'supported values: '),
    ({"model": None}, "spec.model: Required value"),
    ({"lora": {"adapters": [{"name": "a", "uri": "hf://x/a"}, {"name": "a", "uri": "hf://x/b"}]}},
     'spec.lora.adapters[1]: Duplicate value: {"name":"a"}'),
])
def test_a_value_the_schema_refuses_is_named(change: dict[str, Any], message: str) -> None:
    doc = example()
    for key, value in change.items():
        if value is None:
            doc["spec"].pop(key)
        else:
            doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    code, out, err = render_cli(doc)
    assert (code, out) == (1, "")
    assert err.startswith(f'tandem render: stdin: The InferenceService "smollm2" is invalid: '
                          f"{message}"), err


def test_null_fields_are_dropped_and_defaults_applied_as_the_api_server_stores_them() -> None:
    doc = example()
    doc["spec"]["prefill"] = None  # `prefill:` with nothing after it
    stored = check(doc)
    assert stored == check(example())  # null is absent, then defaulted
    assert stored["spec"]["prefill"]["replicas"] == 0 and "prefill" not in example()["spec"]
    assert stored["spec"]["decode"]["engine"]["blockSize"] == 16  # a default
    assert stored["spec"]["router"]["replicas"] == 2
    assert render_ok(doc) == render_ok(example())


def docs_isvcs() -> list[tuple[str, dict[str, Any]]]:
    """Every InferenceService in a ```yaml block of README.md and docs/*.md."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```ya?ml\n(.*?)```", page.read_text(), re.S)
        for i, block in enumerate(blocks):
            if "kind: InferenceService" not in block:
                continue
            for doc in yaml.safe_load_all(block):
                if isinstance(doc, dict) and doc.get("kind") == "InferenceService":
                    out.append((f"{page.name}#{i}", doc))
    return out


@pytest.mark.parametrize("where, doc", [(p.name, example(p)) for p in EXAMPLES] + docs_isvcs(),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_every_shipped_and_documented_inference_service_renders(where: str,
                                                                doc: dict[str, Any]) -> None:
    assert "kind: Deployment" in render_ok(doc), where


SPEC_ONLY = {"model", "lora", "router", "prefill", "decode", "kvTransfer", "monitoring"}


def docs_spec_fragments() -> list[tuple[str, dict[str, Any]]]:
    """Every ```yaml block of README.md and docs/*.md that is part of a spec: `spec:` alone,
    or keys only a spec has (`image` and `security` are also the chart's values keys)."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```ya?ml\n(.*?)```", page.read_text(), re.S)
        for i, block in enumerate(blocks):
            try:
                docs = list(yaml.safe_load_all(block))
            except yaml.YAMLError:
                continue
            for doc in docs:
                if isinstance(doc, dict) and doc and (set(doc) == {"spec"}
                                                      or set(doc) <= SPEC_ONLY):
                    out.append((f"{page.name}#{i}", doc.get("spec", doc)))
    return out


@pytest.mark.parametrize("where, spec", docs_spec_fragments() or [("none", {})],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_every_documented_spec_fragment_names_only_crd_fields(where: str,
                                                              spec: dict[str, Any]) -> None:
    assert unknown_fields(SCHEMA["properties"]["spec"], spec, "spec") == [], where


# ---- randomized: unknown keys at any depth -------------------------------------------------

def closed_objects(node: dict[str, Any], value: Any, path: str) -> list[tuple[str, dict]]:
    """(path, object) of every object in `value` whose schema lists its fields (no
    additionalProperties, not x-kubernetes-preserve-unknown-fields), metadata included."""
    out = []
    if isinstance(value, dict):
        props = node.get("properties")
        if path == "metadata" or (props and not node.get("x-kubernetes-preserve-unknown-fields")
                                  and "additionalProperties" not in node):
            out.append((path, value))
        for key, sub in value.items():
            if props and key in props:
                out += closed_objects(props[key], sub, f"{path}.{key}" if path else key)
            elif isinstance(node.get("additionalProperties"), dict):
                out += closed_objects(node["additionalProperties"], sub, f"{path}[{key}]")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            out += closed_objects(node["items"], item, f"{path}[{i}]")
    return out


def test_a_random_unknown_key_at_a_random_depth_is_reported_at_its_path() -> None:
    rng = random.Random(20240537)
    sources = [example(p) for p in EXAMPLES]
    seen_depths = set()
    for case in range(400):
        doc = copy.deepcopy(rng.choice(sources))
        path, obj = rng.choice(closed_objects(SCHEMA, doc, ""))
        key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzXYZ") for _ in range(
            rng.randint(1, 12)))
        if key in obj or key in ("name", "namespace", "labels", "annotations", "uid"):
            continue
        obj[key] = rng.choice([1, "x", True, {"a": 1}, [1, 2], 0.5])
        want = f"{path}.{key}" if path else key
        with pytest.raises(Invalid) as refused:
            check(doc)
        assert refused.value.unknown == (want,), (case, want)
        assert f'unknown field "{want}"' in str(refused.value)
        seen_depths.add(want.count(".") + want.count("["))
        del obj[key]
        check(doc)  # valid again
    assert max(seen_depths) >= 4 and min(seen_depths) == 0


def test_an_unknown_key_renders_again_once_removed_through_the_cli() -> None:
    rng = random.Random(7)
    doc = example(next(p for p in EXAMPLES if p.stem == "disaggregated"))
    for _ in range(3):
        path, obj = rng.choice(closed_objects(SCHEMA, doc, "")[1:])
        obj["zz"] = 1
        code, _, err = render_cli(doc)
        assert code == 1 and f'unknown field "{path}.zz"' in err
        del obj["zz"]
        assert render_cli(doc, *needs(doc))[0] == 0


# ---- randomized: values, against openapi-schema-validator ----------------------------------

def leaves(node: dict[str, Any], value: Any, path: tuple) -> list[tuple[tuple, dict]]:
    """(path as keys, schema) of every field of `value` the schema declares."""
    out = []
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, sub in value.items():
            schema = props.get(key, extra if isinstance(extra, dict) else None)
            if schema is not None and path + (key,) != ("metadata",):
                out.append((path + (key,), schema))
                out += leaves(schema, sub, path + (key,))
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            out.append((path + (i,), node["items"]))
            out += leaves(node["items"], item, path + (i,))
    return out


def mutation(rng: random.Random, schema: dict[str, Any], old: Any) -> Any:
    choices: list[Any] = ["word", -1, 0, 7, 1e9, 2.5, True, [], [1], {}, {"k": "v"}, "",
                          "x" * 300, "1Gi", "hf://org/model"]
    choices += list(schema.get("enum") or [])
    if isinstance(old, int | float) and not isinstance(old, bool):
        choices += [old + 1, old - 1, -old]
    return rng.choice(choices)


def oas_paths(doc: dict[str, Any]) -> set[str]:
    errors = OAS30Validator(SCHEMA).iter_errors(doc)
    return {"".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
            .lstrip(".") for e in errors}


def test_random_value_mutations_are_refused_exactly_when_openapi_refuses_them() -> None:
    rng = random.Random(37)
    sources = [drop_nulls_and_default(SCHEMA, example(p)) for p in EXAMPLES]
    refused = accepted = 0
    for case in range(400):
        doc = copy.deepcopy(rng.choice(sources))
        path, schema = rng.choice(leaves(SCHEMA, doc, ()))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = mutation(rng, schema, parent[path[-1]])
        ours = validate(SCHEMA, doc)
        theirs = oas_paths(doc)
        assert bool(ours) == bool(theirs), (case, path, parent[path[-1]], ours, theirs)
        for error in ours:
            where = re.sub(r"\[([^\]0-9][^\]]*)\]", r".\1", error.split(": ", 1)[0])
            if error.endswith("Required value"):  # OpenAPI names the object
                where = where.rpartition(".")[0]
            assert any(where == t or where.startswith(t) or t.startswith(where)
                       for t in theirs), (case, error, theirs)
        refused += bool(ours)
        accepted += not ours
    assert refused > 100 and accepted > 20  # both outcomes well covered
