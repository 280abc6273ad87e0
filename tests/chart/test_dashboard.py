"""The Grafana dashboard queries only metrics that Tandem really exports: every metric name in
its PromQL is a sample name of the worker's registry (`tandem.serving.metrics`, vLLM's names)
or the router's (`tandem.router.metrics`), and it covers the metrics it promises."""

from __future__ import annotations

import dataclasses
import json
import re

from tests.chart.conftest import CHART

METRIC = re.compile(r"\b(vllm:[a-z0-9_:]+|tandem_[a-z0-9_]+)")
PROMISED = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total", "tandem_router_requests_total",
    "tandem_router_decisions_total", "tandem_router_routing_seconds_bucket",
}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "summary": ("", "_sum", "_count"), "info": ("_info",)}


def exported_names() -> set[str]:
    from tandem.engine.llm_engine import EngineStats
    from tandem.router.metrics import RouterMetrics
    from tandem.serving.metrics import ServerMetrics

    stats = EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})
    names = set()
    for registry in (ServerMetrics("m", lambda: stats).registry, RouterMetrics().registry):
        for family in registry.collect():
            names.update(family.name + s for s in SUFFIXES[family.type])
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads((CHART / "dashboards" / "tandem.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return exprs


def test_dashboard_metrics_exist() -> None:
    exported = exported_names()
    used = {m for expr in dashboard_queries() for m in METRIC.findall(expr)}
    assert used, "no metric found in the dashboard"
    assert used <= exported, f"not exported by workers or routers: {sorted(used - exported)}"
    assert used >= PROMISED, f"missing from the dashboard: {sorted(PROMISED - used)}"


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads((CHART / "dashboards" / "tandem.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
    for expr in dashboard_queries():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
