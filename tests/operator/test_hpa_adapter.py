"""`autoscaling.mode: hpa` names the metrics adapter it needs.

* The status of an InferenceService with such a pool carries the condition MetricsAdapter
  (Unknown): each HPA's per-pod metric and the prometheus-adapter install command with the
  chart's rules; none without an HPA pool. The status validates against the CRD's schema.
* The chart ships those rules (examples/prometheus-adapter/values.yaml): one per HPA metric
  the operator renders, each computed from a series the workers really export (their
  /metrics, rendered by the worker's own collector), counters as per-second rates.
* The CRD's `autoscaling.mode` description gives the same install command."""

from __future__ import annotations

import re
from typing import Any

import yaml
from openapi_schema_validator import OAS30Validator
from prometheus_client import generate_latest

from tandem.operator.render import Owner, render_all
from tandem.operator.render.monitoring import ADAPTER_INSTALL, ADAPTER_VALUES
from tandem.operator.spec import SIGNALS, parse_spec, signal_for
from tandem.operator.status import METRICS_ADAPTER, observed
from tests.chart.conftest import ROOT
from tests.operator.manifests import by_kind
from tests.operator.samples import crd, schema, spec

OWNER = Owner("demo", "ml", "uid-1")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"
HPA_METRICS = {s.hpa_metric: s for s in (*SIGNALS.values(), signal_for("tokensPerSecond",
                                                                       "prefill"))}


def hpa_spec() -> dict[str, Any]:
    raw = spec("disaggregated")
    raw["prefill"]["autoscaling"] = {"mode": "hpa", "maxReplicas": 4, "target": 2000,
                                     "signal": "tokensPerSecond"}
    raw["decode"]["autoscaling"] = {"mode": "hpa", "maxReplicas": 4, "target": 0.8,
                                    "signal": "kvUtilization"}
    return raw


def adapter(conditions: list[dict[str, Any]]) -> dict[str, Any] | None:
    found = [c for c in conditions if c["type"] == METRICS_ADAPTER]
    assert len(found) <= 1
    return found[0] if found else None


def test_an_hpa_pool_gets_a_condition_naming_its_metric_and_the_adapter() -> None:
    s = parse_spec(hpa_spec())
    hpas = {h["metadata"]["name"]: h["spec"]["metrics"][0]["pods"]["metric"]["name"]
            for h in by_kind(render_all(s, OWNER), "HorizontalPodAutoscaler")}
    assert hpas == {"demo-prefill": "vllm_prompt_tokens_per_second",
                    "demo-decode": "vllm_kv_cache_usage_perc"}
    status = observed(s, OWNER, {}, {}, 3, T0)
    cond = adapter(status["conditions"])
    assert cond is not None
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == (
        "Unknown", "CustomMetricsRequired", 3)
    for name, metric in hpas.items():
        assert f"HorizontalPodAutoscaler {name} reads the per-pod metric {metric}" in (
            cond["message"])
    assert "prometheus-adapter" in cond["message"] and ADAPTER_INSTALL in cond["message"]
    assert (ROOT / ADAPTER_VALUES).is_file()
    # the three usual conditions are still there; the CRD's status schema accepts them
    assert [c["type"] for c in status["conditions"]] == [
        "Ready", "Progressing", "Degraded", METRICS_ADAPTER]
    status_schema = schema()["properties"]["status"]
    assert list(OAS30Validator(status_schema).iter_errors(
        {"conditions": status["conditions"]})) == []
    # its transition time stays while it holds
    again = observed(s, OWNER, {"conditions": status["conditions"]}, {}, 4, T1)
    assert adapter(again["conditions"])["lastTransitionTime"] == T0


def test_no_condition_without_an_hpa_pool() -> None:
    for name in ("disaggregated", "autoscaling"):
        raw = spec(name)
        for pool in ("prefill", "decode"):
            if raw.get(pool, {}).get("autoscaling", {}).get("mode") == "hpa":
                raw[pool]["autoscaling"]["mode"] = "operator"
        status = observed(parse_spec(raw), OWNER, {}, {}, 1, T0)
        assert adapter(status["conditions"]) is None


def exported_metric_names() -> set[str]:
    """The sample names a worker's /metrics shows (its own collector, one engine snapshot)."""
    from tandem.engine.llm_engine import EngineStats
    from tandem.serving.metrics import ServerMetrics

    stats = EngineStats(num_running=1, num_waiting=2, kv_cache_usage=0.5, num_free_blocks=8,
                        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                        prompt_tokens=10, generation_tokens=5, kv_unused_slots=0,
                        in_flight_tokens=0)
    text = generate_latest(ServerMetrics("demo", lambda: stats).registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_adapter_rules_serve_every_hpa_metric_from_what_the_workers_export() -> None:
    values = yaml.safe_load((ROOT / ADAPTER_VALUES).read_text())
    assert values["rules"]["default"] is False
    rules = values["rules"]["custom"]
    served = {r["name"]["as"]: r for r in rules}
    assert len(served) == len(rules)  # one rule per metric
    assert set(served) == set(HPA_METRICS)
    exported = exported_metric_names()
    for metric, signal in HPA_METRICS.items():
        rule = served[metric]
        series = signal.worker_metric  # as Prometheus stores it (counters end in _total)
        assert series in exported, f"the workers do not export {series}"
        assert re.fullmatch(rule["name"]["matches"], series)
        assert rule["seriesQuery"].startswith(series + "{")
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}
        query = rule["metricsQuery"]
        assert "<<.Series>>{<<.LabelMatchers>>}" in query and "by (<<.GroupBy>>)" in query
        assert ("rate(" in query) == signal.rate, metric


def test_the_crd_names_the_adapter_and_its_install_command() -> None:
    text = crd()
    (version,) = text["spec"]["versions"]
    mode = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "decode"]["properties"]["autoscaling"]["properties"]["mode"]
    assert f"`{ADAPTER_INSTALL}`" in " ".join(mode["description"].split())
