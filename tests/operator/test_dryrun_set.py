"""`tandem render --set` parses as `helm --set` does: each case is given to the real helm
(`helm template` of a chart whose one template prints its values as JSON) and to
`chart_defaults.parse_set`, merged over the same defaults; the values must be equal, and what
helm refuses is refused. The two things `--set` leaves to `--values` (list indexes, an empty
key, which helm silently drops) are refused with a message saying so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.operator.chart_defaults import ValuesError, merge, parse_set
from tests.chart.conftest import Helm, helm  # noqa: F401 - the fixture

DEFAULTS: dict[str, Any] = {"keep": 1, "nest": {"a": 1, "b": "two", "list": ["x"]}}
TEMPLATE = ('apiVersion: v1\nkind: ConfigMap\nmetadata: {name: values}\n'
            'data:\n  json: {{ toJson .Values | quote }}\n')

CASES: list[tuple[str, ...]] = [
    # helm's documentation ("The Format and Limitations of --set")
    ("name=value",), ("a=b,c=d",), ("outer.inner=value",), ("name={a, b, c}",),
    (r"name=value1\,value2",), (r"nodeSelector.kubernetes\.io/role=master",),
    ("nest.a=null",), ("name=null",),
    # helm's typing
    ("a=0",), ("a=007",), ("a=1.5",), ("a=True",), ("a=FALSE",), ("a=NULL",), ("a=-3",),
    ("a=+3",), ("a=-0",), ("a=9223372036854775807",), ("a=9223372036854775808",),
    ("a=-9223372036854775808",), ("a=1e3",), ("a=0x10",), ("a=1_000",), ("a=Yes",),
    # lists, escapes, odd but accepted
    ("a={1,true,null,}",), ("a={}",), ("a={x},b=2",), ("a={x},",), (r"a={a\,b,c}",),
    ("a={{x}",), ("a=x}",), ("a=b=c",), ("a=",), ("a= x ",), ("a=1,",), ("a=x\\",),
    (r"a=\{x\}",), (r"a.b\.c=1",), ("a.b=1,a=2",), ("keep.x=1",), ("nest=1",),
    ("nest.c=3,nest.list={y,z}",),
    # several --set flags: one mapping, in order
    ("nest.a=5", "nest.b=null"), ("a.b=1", "a.c=2", "keep=3"), ("a=1", "a=2"),
    ("security.allowedRegistries={registry.example.com,ghcr.io/team}", "redis.enabled=true"),
]
REFUSED_BY_BOTH: list[tuple[str, ...]] = [
    ("a",), ("a.b",), ("a={x",), (",a=1",), ("a.=1",), ("a..b=1",), ("a={x}}",),
    ("a=1", "a.b=2"), ("a=1,a.b=2",),
]


@pytest.fixture(scope="module")
def values_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chart = tmp_path_factory.mktemp("values-chart")
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: values\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text(yaml.safe_dump(DEFAULTS))
    (chart / "templates").mkdir()
    (chart / "templates" / "values.yaml").write_text(TEMPLATE)
    return chart


def helm_values(helm: Helm, chart: Path, sets: tuple[str, ...]) -> dict[str, Any] | None:  # noqa: F811
    """The values `helm template --set S...` renders with (None: helm refused)."""
    args = ["template", "r", str(chart)]
    for s in sets:
        args += ["--set", s]
    proc = helm.run(*args, check=False)
    if proc.returncode != 0:
        assert "failed parsing --set data" in proc.stderr, proc.stderr
        return None
    (doc,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return json.loads(doc["data"]["json"])


def ours(sets: tuple[str, ...]) -> dict[str, Any]:
    given: dict[str, Any] = {}
    for s in sets:
        parse_set(s, given)
    return merge(DEFAULTS, given)


@pytest.mark.parametrize("sets", CASES, ids=" ".join)
def test_set_parses_as_helm_parses_it(helm: Helm, values_chart: Path,  # noqa: F811
                                      sets: tuple[str, ...]) -> None:
    want = helm_values(helm, values_chart, sets)
    assert want is not None, f"helm refused {sets}"
    assert ours(sets) == want


@pytest.mark.parametrize("sets", REFUSED_BY_BOTH, ids=" ".join)
def test_what_helm_refuses_is_refused(helm: Helm, values_chart: Path,  # noqa: F811
                                      sets: tuple[str, ...]) -> None:
    assert helm_values(helm, values_chart, sets) is None
    with pytest.raises(ValuesError):
        ours(sets)


@pytest.mark.parametrize("text, message", [
    ("servers[0].port=80", "'servers[0].port=80': list indexes (servers[...]) are not "
     "supported: give a list whole ({a,b}) or use --values"),
    ("=1", "'=1': an empty key"),
    ("a=1,=2", "'a=1,=2': an empty key"),
])
def test_what_set_leaves_to_values_is_refused_saying_so(text: str, message: str) -> None:
    with pytest.raises(ValuesError) as refused:
        parse_set(text)
    assert str(refused.value) == message
