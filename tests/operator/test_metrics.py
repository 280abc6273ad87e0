"""The autoscaler's inputs: Prometheus text parsing, the per-replica signal (gauges, rates
from counters, counter resets), and `HttpMetricsSource` for real: EndpointSlices listed from
kmock's Kubernetes API over HTTP, `/metrics` scraped from a local HTTP server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes.client import ApiClient, Configuration, DiscoveryV1Api

from tandem.operator.metrics import HttpMetricsSource, counters, parse, per_replica
from tandem.operator.spec import signal_for
from tandem.serving.ports import free_port
from tests.operator.kube_emulator import FakeCluster

TEXT = """\
# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="b"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage; 1 means 100 percent.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.25
# HELP vllm:generation_tokens Generated tokens.
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="a"} 1200.0
"""
WAITING = signal_for("waitingRequests", "decode")
TOKENS = signal_for("tokensPerSecond", "decode")


def test_parse_sums_label_sets_and_keeps_sample_names():
    got = parse(TEXT)
    assert got["vllm:num_requests_waiting"] == 5.0
    assert got["vllm:kv_cache_usage_perc"] == 0.25
    assert got["vllm:generation_tokens_total"] == 1200.0  # the counter's sample name
    assert TOKENS.worker_metric == "vllm:generation_tokens_total"
    assert signal_for("tokensPerSecond", "prefill").worker_metric == "vllm:prompt_tokens_total"


def test_gauge_per_replica_counts_replicas_not_yet_reporting_as_idle():
    samples = {"a": {WAITING.worker_metric: 6.0}, "b": {WAITING.worker_metric: 2.0}}
    assert per_replica(WAITING, samples, replicas=2, now=0.0, previous={}) == 4.0
    assert per_replica(WAITING, samples, replicas=4, now=0.0, previous={}) == 2.0
    assert per_replica(WAITING, {}, replicas=2, now=0.0, previous={}) is None
    assert per_replica(WAITING, {"a": {"other": 1.0}}, 2, 0.0, {}) is None


def test_rates_need_two_scrapes_and_survive_a_counter_reset():
    first = {"a": {TOKENS.worker_metric: 1000.0}, "b": {TOKENS.worker_metric: 500.0}}
    assert per_replica(TOKENS, first, 2, 10.0, {}) is None  # no previous scrape yet
    prev = counters(TOKENS, first, 10.0)
    assert prev == {"a": (10.0, 1000.0), "b": (10.0, 500.0)}
    second = {"a": {TOKENS.worker_metric: 1300.0}, "b": {TOKENS.worker_metric: 100.0}}
    # a: 300 tokens / 10 s; b restarted: 100 tokens since (a reset) / 10 s
    assert per_replica(TOKENS, second, 2, 20.0, prev) == pytest.approx((30.0 + 10.0) / 2)
    assert counters(WAITING, second, 20.0) == {}  # gauges keep nothing


class Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = TEXT.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def worker() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def endpoint_slice(name: str, service: str, port: int,
                   endpoints: list[tuple[str, bool | None]]) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "ml",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [a], "conditions": {} if r is None else {"ready": r}}
                          for a, r in endpoints],
            "ports": [{"name": "grpc", "port": 50051}, {"name": "http", "port": port}]}


def test_http_source_scrapes_the_ready_endpoints_of_the_pool(tmp_path, worker):
    """Only `demo-decode`'s slices, only ready addresses, only the `http` port; an address
    whose scrape fails is left out (the signal then counts it as idle)."""
    cluster = FakeCluster({"discovery.k8s.io/v1/endpointslices": {
        "kind": "EndpointSlice", "namespaced": True, "verbs": {"list", "create"}}}, tmp_path)
    try:
        client = ApiClient(Configuration(host=cluster.url))
        api = DiscoveryV1Api(client)
        api.create_namespaced_endpoint_slice("ml", endpoint_slice(
            "demo-decode-a", "demo-decode", worker, [("127.0.0.1", True), ("10.9.9.9", False)]))
        dead = free_port()
        api.create_namespaced_endpoint_slice("ml", endpoint_slice(
            "demo-decode-b", "demo-decode", dead, [("127.0.0.2", None)]))
        api.create_namespaced_endpoint_slice("ml", endpoint_slice(
            "demo-prefill-a", "demo-prefill", worker, [("127.0.0.3", True)]))
        source = HttpMetricsSource(client, timeout_s=2.0)
        assert sorted(source.endpoints("ml", "demo-decode")) == [
            f"http://127.0.0.1:{worker}/metrics", f"http://127.0.0.2:{dead}/metrics"]
        got = source.scrape("ml", "demo-decode")
        assert list(got) == [f"127.0.0.1:{worker}"]
        assert got[f"127.0.0.1:{worker}"]["vllm:num_requests_waiting"] == 5.0
        assert per_replica(WAITING, got, replicas=2, now=0.0, previous={}) == 2.5
        assert source.scrape("ml", "nothing-here") == {}
    finally:
        cluster.stop()
