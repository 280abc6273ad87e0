"""`tandem render` checks the chart's values as helm does (the merged values against
charts/tandem/values.schema.json, from the package's byte-identical copies): each case is
given to the real `helm template` and to `tandem render`, and what one refuses the other
refuses (`--set redis.enable=true`, a typo, is no longer silently ignored). And the
manifest's metadata is typed as the API server types ObjectMeta."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from tandem.operator import chart_defaults
from tests.chart.conftest import Helm, helm  # noqa: F401 - the fixture
from tests.operator.test_dryrun import ROOT
from tests.operator.test_dryrun_schema import example, render_cli

PACKAGED = ROOT / "src" / "tandem" / "operator" / "chart"
PREFIX = "tandem render: stdin: the chart's values (--values, --set): "

REFUSED: list[tuple[str, ...]] = [
    ("redis.enable=true",), ("image.tag=2",), ("watchNamespaces={a,a}",),
    ("operator.leaderElection.renewDeadline=0",), ("operator.leaderElection.retryPeriod=0.5",),
    ("redis=null",), ("childImagePullSecrets={a}",), ("image.pullPolicy=always",),
    ("security.allowedRegistries={-bad}",), ("image=abc",),
]
ACCEPTED: list[tuple[str, ...]] = [
    ("podSecurityContext.runAsUser=1000",), ("redis.enabled=true,redis.port=6380",),
    ("image.tag=2.0", "global.x=1"), ("operator.leaderElection.renewDeadline=7",),
    ("watchNamespaces={default,b}",),
]


def test_the_packaged_chart_files_are_the_charts() -> None:
    assert sorted(p.name for p in PACKAGED.iterdir() if p.is_file()) == sorted([
        chart_defaults.VALUES_FILE, chart_defaults.SCHEMA_FILE])
    for name in (chart_defaults.VALUES_FILE, chart_defaults.SCHEMA_FILE):
        assert (PACKAGED / name).read_bytes() == (ROOT / "charts" / "tandem" /
                                                  name).read_bytes(), (
            f"cp charts/tandem/{name} src/tandem/operator/chart/")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "operator/chart/*" in data["package-data"]["tandem"]


@pytest.mark.parametrize("sets", REFUSED + ACCEPTED, ids=" ".join)
def test_set_is_refused_where_helm_refuses_it(helm: Helm, sets: tuple[str, ...]) -> None:  # noqa: F811
    refused_by_helm = helm.run(*helm.template_args(sets=sets), check=False).returncode != 0
    assert refused_by_helm == (sets in REFUSED)
    code, out, err = render_cli(example(), *(a for s in sets for a in ("--set", s)))
    if refused_by_helm:
        assert (code, out) == (2, "") and err.startswith(
            PREFIX + "values don't meet the chart's values.schema.json: "), err
    else:
        assert code == 0, err


@pytest.mark.parametrize("text, message", [
    ("redis: {enable: true}", "redis.enable: the chart has no such value"),
    ("operator: {extraArgs: [--log-level, DEBUG]}\nfoo: 1\nsecurity: {allowHostPath: 'no'}",
     'foo: the chart has no such value; security.allowHostPath: Invalid value: "no": '
     'security.allowHostPath in body must be of type boolean: "string"'),
])
def test_a_values_file_is_checked_against_the_schema(helm: Helm, tmp_path: Path,  # noqa: F811
                                                     text: str, message: str) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(text)
    assert helm.run(*helm.template_args(values=(values,)), check=False).returncode != 0
    code, out, err = render_cli(example(), "--values", str(values))
    assert (code, out, err) == (2, "", PREFIX + "values don't meet the chart's "
                                f"values.schema.json: {message}\n")


def test_open_objects_and_env_values_pass(helm: Helm, tmp_path: Path) -> None:  # noqa: F811
    """JSON Schema's rule, not a structural schema's: an object without
    `additionalProperties: false` takes any key (an EnvVar's value, a securityContext)."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "operator": {"env": [{"name": "TANDEM_ALLOWED_SECRETS", "value": "hf-*"}]},
        "securityContext": {"readOnlyRootFilesystem": True},
        "dashboards": {"labels": {"grafana_dashboard": "1"}}}))
    helm.run(*helm.template_args(values=(values,)))
    code, _, err = render_cli(example(), "--values", str(values))
    assert code == 0, err


@pytest.mark.parametrize("meta, message", [
    ({"namespace": 5}, 'metadata.namespace: Invalid value: 5: metadata.namespace in body must '
                       'be of type string: "integer"'),
    ({"uid": 7}, 'metadata.uid: Invalid value: 7: metadata.uid in body must be of type string: '
                 '"integer"'),
    ({"namespace": "Team_A"}, "metadata.namespace 'Team_A' is not a namespace name (a "
                              "DNS-1123 label)"),
])
def test_metadata_is_typed_as_object_meta(meta: dict[str, object], message: str) -> None:
    doc = example()
    doc["metadata"].update(meta)
    code, out, err = render_cli(doc)
    assert (code, out) == (1, "") and err.rstrip("\n").endswith(message), err


def test_a_namespace_flag_that_is_no_namespace_is_a_usage_error() -> None:
    code, out, err = render_cli(example(), "-n", "Team A")
    assert (code, out) == (2, "") and err == (
        "tandem render: stdin: --namespace 'Team A' is not a namespace name (a DNS-1123 "
        "label)\n")


def test_a_list_whose_items_are_no_list_is_refused() -> None:
    code, out, err = render_cli({"apiVersion": "v1", "kind": "List", "items": 5})
    assert (code, out, err) == (1, "", "tandem render: stdin: document 1: a List's items "
                                       "must be a list, got int\n")


def test_replicas_that_are_no_ascii_number_are_a_usage_error() -> None:
    doc = yaml.safe_load((ROOT / "charts" / "tandem" / "examples" / "aggregated.yaml")
                         .read_text())
    code, out, err = render_cli(doc, "--replicas", "worker=\u00b2")
    assert (code, out) == (2, "") and err.endswith(
        "--replicas 'worker=\u00b2': POOL=N, N a whole number\n"), err
