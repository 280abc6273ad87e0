"""The generated references (docs/reference/) stay true: each page equals what
`scripts/gen_reference.py` generates from the code now, the generator leaves out no flag,
metric or CRD field, the vLLM flag mapping names only real Tandem flags, and the metrics the
Grafana dashboard and docs/observability.md name are ones Tandem exports."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIX = "python scripts/gen_reference.py"
METRIC = re.compile(r"\b(vllm:[a-z0-9_:]+|tandem_[a-z0-9_]+)")


def _load() -> ModuleType:
    name = "tandem_gen_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return _load()


@pytest.fixture(scope="module")
def pages(gen: ModuleType) -> dict[str, str]:
    return {path.name: text for path, text in gen.generate().items()}


@pytest.mark.parametrize("name", ["cli.md", "metrics.md", "inferenceservice.md"])
def test_reference_page_is_current(pages: dict[str, str], name: str) -> None:
    committed = ROOT / "docs" / "reference" / name
    assert committed.exists(), f"docs/reference/{name} is missing: run {FIX}"
    assert committed.read_text() == pages[name], f"docs/reference/{name} is stale: run {FIX}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_cli_reference_lists_every_flag(gen: ModuleType, pages: dict[str, str]) -> None:
    parser = gen.tandem_parser()
    subs = _subparsers(parser)
    assert {"serve", "worker", "router", "generate", "operator", "render"} <= set(subs)
    page = pages["cli.md"]
    sections = re.split(r"^## ", page, flags=re.M)
    by_command = {s.split("`")[1]: s for s in sections if s.startswith("`tandem")}
    for name, sub in [("tandem", parser)] + [(f"tandem {n}", p) for n, p in subs.items()]:
        section = by_command[name]
        for action in sub._actions:
            if action.help is argparse.SUPPRESS or isinstance(
                    action, argparse._SubParsersAction):
                continue
            for flag in action.option_strings or [gen._positional(action)]:
                assert f"`{flag}`" in section, f"{name} {flag} missing from cli.md"
            if action.option_strings and action.choices and not isinstance(action.choices,
                                                                             dict):
                assert "{" + ",".join(map(str, action.choices)) + "}" in section


def test_vllm_mapping_names_real_flags(gen: ModuleType) -> None:
    parser = gen.tandem_parser()
    subs = _subparsers(parser)
    global_flags = gen.flags_of(parser)
    assert len(gen.VLLM_FLAGS) >= 30
    for row in gen.VLLM_FLAGS:
        assert row.vllm.startswith(("--", "MODEL")), row
        assert row.tandem or row.note, f"{row.vllm}: say what Tandem has instead"
        for flag in row.tandem:
            assert flag in gen.flags_of(subs[row.command]) | global_flags, (
                f"the vLLM mapping names `tandem {row.command} {flag}`, which does not exist")
    vllm = [v for row in gen.VLLM_FLAGS for v in row.vllm.split(", ")]
    assert len(vllm) == len(set(vllm)), "a vLLM flag is mapped twice"


def _exported_samples(gen: ModuleType) -> dict[str, set[str]]:
    """Sample names per process, read from what the registries yield (not the generator's
    walk): the worker with every optional feature on, and the router."""
    from tandem.router.metrics import RouterMetrics

    out: dict[str, set[str]] = {"worker": set(), "router": set()}
    worker = gen._worker_registry(memory=True, spec=True, lora=True, tiers=True)
    for process, registry in (("worker", worker), ("router", RouterMetrics().registry)):
        for family in registry.collect():
            out[process].update(family.name + s for s in gen.SUFFIXES[family.type])
    return out


def test_metrics_reference_lists_every_metric(gen: ModuleType, pages: dict[str, str]) -> None:
    page = pages["metrics.md"]
    worker_part, router_part = page.split("## Router", 1)
    samples = _exported_samples(gen)
    assert "vllm:num_requests_running" in samples["worker"]
    assert "tandem_router_requests_total" in samples["router"]
    for name in samples["worker"]:
        assert f"`{name}`" in worker_part, f"worker metric {name} missing from metrics.md"
    for name in samples["router"]:
        assert f"`{name}`" in router_part, f"router metric {name} missing from metrics.md"
    documented = set(METRIC.findall(page))
    exported = samples["worker"] | samples["router"]
    assert documented <= exported | {m.name for m in gen.worker_metrics()}, (
        f"metrics.md names metrics nothing exports: {sorted(documented - exported)}")


def test_operator_exports_no_metrics() -> None:
    """metrics.md says the operator exports none: it defines no Prometheus metric."""
    defines = re.compile(r"\b(Counter|Gauge|Histogram|Summary|Info|Enum|\w+MetricFamily)\(")
    for path in (ROOT / "src" / "tandem" / "operator").rglob("*.py"):
        text = path.read_text()
        if "prometheus_client" in text:
            assert not defines.search(text), f"{path} defines a metric: document it"


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads((ROOT / "charts" / "tandem" / "dashboards" / "tandem.json")
                           .read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return {m for expr in exprs for m in METRIC.findall(expr)}


def test_dashboard_metrics_are_in_the_reference() -> None:
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    used = _dashboard_metrics()
    assert len(used) >= 10
    missing = sorted(m for m in used if f"`{m}`" not in page)
    assert not missing, f"the dashboard queries metrics the reference lacks: {missing}"


def test_observability_page_names_real_metrics() -> None:
    """Every metric docs/observability.md names is in the reference, and it lists every
    dashboard panel."""
    text = (ROOT / "docs" / "observability.md").read_text()
    reference = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    named = set(METRIC.findall(text))
    assert named
    known = set(METRIC.findall(reference))

    def exported(m: str) -> bool:  # a sample, a histogram by its name, or a `prefix_*`
        return (m in known or f"{m}_bucket" in known
                or m.endswith("_") and any(k.startswith(m) for k in known))

    unknown = sorted(m for m in named if not exported(m))
    assert not unknown, f"observability.md names metrics the reference lacks: {unknown}"
    dashboard = json.loads((ROOT / "charts" / "tandem" / "dashboards" / "tandem.json")
                           .read_text())
    for panel in dashboard["panels"]:
        assert panel["title"] in text, f"dashboard panel {panel['title']!r} not described"


def _properties(node: dict[str, Any], path: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(path, name, node) of every property below `node`, through arrays and maps."""
    out = []
    for name, child in (node.get("properties") or {}).items():
        out.append((f"{path}.{name}", name, child))
        out += _properties(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += _properties(node[key], f"{path}[]")
    return out


def test_crd_reference_lists_every_field(pages: dict[str, str]) -> None:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservice.yaml").read_text())
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    page = pages["inferenceservice.md"]
    flat = " ".join(page.split())
    fields = _properties(schema["properties"]["spec"], "spec")
    fields += _properties(schema["properties"]["status"], "status")
    assert len(fields) > 100
    for path, name, node in fields:
        assert f"| `{name}` |" in page, f"{path} missing from inferenceservice.md"
        if "description" in node:
            desc = " ".join(node["description"].split()).replace("|", "\\|")
            assert desc in flat, f"{path}'s description missing from inferenceservice.md"
        if "default" in node:
            assert f"`{json.dumps(node['default'])}`" in page, path
    for column in version["additionalPrinterColumns"]:
        assert f"`{column['jsonPath']}`" in page
    for rule in (r for _, _, n in fields for r in n.get("x-kubernetes-validations", [])):
        assert " ".join(rule["message"].split()) in flat, rule["message"]


def test_generator_check_mode_names_the_fix(gen: ModuleType, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gen, "REFERENCE", tmp_path / "reference")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert f"reference/cli.md is stale: run {FIX}" in capsys.readouterr().err
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
