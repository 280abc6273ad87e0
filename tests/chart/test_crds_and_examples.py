"""The chart's CRDs are the repository's (`crds/`), byte for byte, and the example
InferenceServices shipped in `charts/tandem/examples/` are valid against that CRD as the API
server would judge them: its openAPIV3Schema (OpenAPI 3.0 validation after structural
defaulting) and its CEL rules (`x-kubernetes-validations`, evaluated with cel-python)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.conftest import CHART, ROOT
from tests.operator.samples import apply_defaults, unknown_fields

SOURCE_CRDS = ROOT / "crds"
CHART_CRDS = CHART / "crds"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))


def test_chart_crds_are_the_repository_crds() -> None:
    source = sorted(p.name for p in SOURCE_CRDS.glob("*.yaml"))
    copied = sorted(p.name for p in CHART_CRDS.glob("*.yaml"))
    assert source, f"no CRD in {SOURCE_CRDS}"
    assert copied == source, f"charts/tandem/crds/ holds {copied}, crds/ holds {source}"
    for name in source:
        assert (CHART_CRDS / name).read_bytes() == (SOURCE_CRDS / name).read_bytes(), (
            f"charts/tandem/crds/{name} differs from crds/{name}: "
            f"cp crds/{name} charts/tandem/crds/")


def test_the_packaged_crd_is_the_repository_crd() -> None:
    """`tandem render` validates against the CRD inside the package (it runs where crds/ is
    not): src/tandem/operator/crd/ holds crds/'s files, byte for byte, as package data."""
    import tomllib

    packaged = ROOT / "src" / "tandem" / "operator" / "crd"
    assert sorted(p.name for p in packaged.glob("*.yaml")) == sorted(
        p.name for p in SOURCE_CRDS.glob("*.yaml"))
    for path in SOURCE_CRDS.glob("*.yaml"):
        assert (packaged / path.name).read_bytes() == path.read_bytes(), (
            f"src/tandem/operator/crd/{path.name} differs from crds/{path.name}: "
            f"cp crds/{path.name} src/tandem/operator/crd/")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "operator/crd/*.yaml" in data["package-data"]["tandem"]


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((SOURCE_CRDS / "inferenceservice.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return crd, version


def cel_failures(node: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of the CEL rules that `value` breaks, the whole tree down."""
    import celpy

    out = []
    env = celpy.Environment()
    for rule in node.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            out.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, sub_value in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                out += cel_failures(sub, sub_value, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            out += cel_failures(node["items"], item, f"{path}[{i}]")
    return out


def check(resource: dict[str, Any]) -> list[str]:
    from openapi_schema_validator import OAS30Validator

    crd, version = crd_schema()
    schema = version["schema"]["openAPIV3Schema"]
    assert resource["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
    assert resource["kind"] == crd["spec"]["names"]["kind"]
    obj = apply_defaults(schema, copy.deepcopy(resource))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
              for e in OAS30Validator(schema).iter_errors(obj)]
    return errors + cel_failures(schema, obj)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_inference_services(example: Path) -> None:
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    assert docs
    _, version = crd_schema()
    schema = version["schema"]["openAPIV3Schema"]
    for doc in docs:
        assert check(doc) == [], example.name
        assert unknown_fields(schema, doc) == [], f"{example.name}: fields the CRD prunes"
        assert "namespace" not in doc["metadata"]  # applied to the user's namespace


def test_examples_cover_aggregated_and_disaggregated() -> None:
    specs = {p.stem: yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES}
    assert specs["aggregated"].get("prefill", {}).get("replicas", 0) == 0
    assert specs["disaggregated"]["prefill"]["replicas"] >= 1
    assert specs["disaggregated"]["decode"]["replicas"] >= 1


def test_the_checker_rejects_what_the_api_server_would() -> None:
    """The harness above is not vacuous: a schema error and a CEL error are both caught."""
    good = yaml.safe_load((CHART / "examples" / "disaggregated.yaml").read_text())
    bad = copy.deepcopy(good)
    bad["spec"]["router"]["policy"] = "fastest"
    assert any("policy" in e for e in check(bad))
    bad = copy.deepcopy(good)
    bad["spec"]["decode"]["engine"]["blockSize"] = 32  # prefill's is 16
    assert any("blockSize" in e for e in check(bad))
    bad = copy.deepcopy(good)
    bad["spec"]["decode"]["engine"]["blokSize"] = 16
    _, version = crd_schema()
    assert unknown_fields(version["schema"]["openAPIV3Schema"], bad) == [
        ".spec.decode.engine.blokSize"]


def test_the_documented_examples_are_valid_inference_services() -> None:
    """Every InferenceService shown in README.md or a docs/*.md page passes the CRD schema,
    its CEL rules and the operator's own parser, and renders (docs that drift from the CRD
    fail here)."""
    from tandem.operator.render import render_all
    from tandem.operator.render.common import Owner
    from tandem.operator.spec import parse_spec

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    docs = []
    for page in pages:
        text = page.read_text()
        blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
        docs += [d for b in blocks for d in yaml.safe_load_all(b)
                 if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    assert docs, "neither README.md nor docs/*.md shows an InferenceService"
    assert len(docs) >= 2, "docs/kubernetes.md shows a disaggregated and a secured example"
    _, version = crd_schema()
    schema = version["schema"]["openAPIV3Schema"]
    for doc in docs:
        assert check(doc) == []
        assert unknown_fields(schema, doc) == []
        spec = parse_spec(doc["spec"])
        owner = Owner(name=doc["metadata"]["name"], namespace="default", uid="u-1")
        assert render_all(spec, owner)


def test_the_tensor_parallel_example_has_a_single_node_and_a_multi_node_pool() -> None:
    """examples/tensor-parallel.yaml: decode TP=4 on one 4-GPU pod (a Deployment), prefill
    TP=16 over two 8-GPU pods (a LeaderWorkerSet of 2-pod groups)."""
    from tandem.operator.render import render_all
    from tandem.operator.render.common import Owner
    from tandem.operator.spec import parse_spec

    doc = yaml.safe_load((CHART / "examples" / "tensor-parallel.yaml").read_text())
    spec = parse_spec(doc["spec"])
    assert (spec.decode.layout.tensor, spec.decode.layout.nodes) == (4, 1)
    assert (spec.prefill.layout.tensor, spec.prefill.layout.nodes) == (16, 2)
    docs = render_all(spec, Owner(doc["metadata"]["name"], "default", "u-1"))
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "llama-70b-decode") in kinds
    assert ("LeaderWorkerSet", "llama-70b-prefill") in kinds
    assert ("Deployment", "llama-70b-prefill") not in kinds
