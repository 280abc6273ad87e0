"""A router without the model's tokenizer routes on text hashes (approximate): it says so at
start-up, in its log and in `tandem_router_approximate_routing{model}`, and again per model
the first time one is routed that way; with a tokenizer configured, neither appears."""

from __future__ import annotations

import re

import httpx

from tandem.protocol.bundled import BUNDLED_NAME
from tandem.router.main import MAX_APPROXIMATE_MODELS, TokenizerResolver
from tandem.router.metrics import RouterMetrics
from tests.router.stub_worker import StubWorker
from tests.router.test_router_lifecycle import Router, completion
from tests.serving.helpers import free_port

GAUGE = "tandem_router_approximate_routing"


def gauges(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(
        rf'^{GAUGE}\{{model="([^"]*)"\}} (\S+)$', text, re.M)}


def test_a_router_started_without_a_tokenizer_logs_and_exposes_approximate_routing(tmp_path):
    worker = StubWorker(free_port())
    router = Router(tmp_path, [f"http://127.0.0.1:{worker.port}"])
    try:
        router.wait_ready()
        assert "approximate routing for every model but" in router.log()
        assert gauges(httpx.get(router.url + "/metrics", timeout=10).text) == {"*": 1.0}
        r = httpx.post(router.url + "/v1/completions", timeout=10,
                       json={"model": "stub-model", "prompt": "hello there", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert "model 'stub-model' has no tokenizer: routed approximately" in router.log()
        assert gauges(httpx.get(router.url + "/metrics", timeout=10).text) == {
            "*": 1.0, "stub-model": 1.0}
        assert completion(router.url).status_code == 200  # logged once per model
        assert router.log().count("model 'stub-model' has no tokenizer") == 1
    finally:
        router.stop()
        worker.stop()


def test_a_configured_tokenizer_means_no_approximate_gauge_and_names_are_bounded(tmp_path):
    resolver = TokenizerResolver([], {"m": str(tmp_path / "tok")})
    metrics = RouterMetrics()
    resolver.bind_metrics(metrics)
    text = metrics.exposition().decode()
    assert gauges(text) == {}  # a tokenizer is configured: no "*"
    for i in range(MAX_APPROXIMATE_MODELS + 10):  # client-chosen names: bounded labels
        assert resolver(f"other-{i}") is None
    assert len(gauges(metrics.exposition().decode())) == MAX_APPROXIMATE_MODELS
    assert BUNDLED_NAME not in resolver.approximate
