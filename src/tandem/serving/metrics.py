"""Prometheus metrics under vLLM's names (`vllm:*`, label `model_name`) plus `tandem_*`.

Gauges and engine counters are read from the engine's last-step snapshot at scrape time;
latency histograms are observed by the HTTP layer as requests progress. Buckets follow
vLLM's so existing dashboards and KEDA triggers work unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.engine.llm_engine import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


_TIER_SERIES = (  # (name, kind, field, help) of each tandem_kv_tier_* series, label tier
    ("tandem_kv_tier_capacity_bytes", "gauge", "capacity_bytes", "Bytes the KV tier may hold."),
    ("tandem_kv_tier_used_bytes", "gauge", "used_bytes", "Bytes the KV tier holds."),
    ("tandem_kv_tier_stores", "counter", "stores", "KV blocks the tier stored."),
    ("tandem_kv_tier_loads", "counter", "loads", "KV blocks loaded from the tier into the "
     "device pool instead of computed."),
    ("tandem_kv_tier_hits", "counter", "hits", "Lookups that found the block in the tier."),
    ("tandem_kv_tier_evictions", "counter", "evictions", "KV blocks the tier pushed out (to "
     "the next tier, or dropped)."),
    ("tandem_kv_tier_validation_failures", "counter", "validation_failures", "KV records "
     "that failed verification (hash, digest, layout, dtype or adapter): dropped and "
     "recomputed, never served."),
)


def _tiers(s: EngineStats, model_name: str) -> Iterator:
    """The KV offload tiers' series (engine/kv_tiers), one sample per tier."""
    for name, kind, attr, doc in _TIER_SERIES:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            name, doc, labels=["model_name", "tier"])
        for c in s.kv_tiers:
            family.add_metric([model_name, c.tier], getattr(c, attr))
        yield family


class _EngineCollector(Collector):
    def __init__(self, model_name: str, snapshot: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot
        self.block_size = 0
        self.num_blocks = 0
        self.model_memory_bytes: int | None = None  # None: the engine does not report it
        self.num_speculative_tokens = 0  # k of speculative_config; 0: no spec_decode series

    def collect(self) -> Iterator:
        s = self.snapshot()
        if s is None:  # still loading: no engine series yet
            return
        lbl = ["model_name"]
        v = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(v, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(v, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
                    s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Preemptions (by recompute).", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield gauge("tandem_kv_free_blocks", "Free (or evictable) KV blocks.", s.num_free_blocks)
        yield gauge("tandem_kv_total_blocks", "KV blocks in the pool.", self.num_blocks)
        yield gauge("tandem_kv_block_size", "Tokens per KV block.", self.block_size)
        yield gauge("tandem_kv_leases_active", "KV page leases held for readers outside the "
                    "engine (P/D sends and peer pulls not yet acknowledged).", s.kv_leases_active)
        yield counter("tandem_kv_leases_released", "KV page leases ended by their reader's "
                      "release.", s.kv_leases_released)
        yield counter("tandem_kv_leases_expired", "KV page leases that expired unreleased "
                      "(a reader that never came back); their pages were unpinned.",
                      s.kv_leases_expired)
        yield counter("tandem_kv_connector_loaded_tokens", "Prompt tokens a KV connector "
                      "loaded instead of computing them.", s.kv_connector_loaded_tokens)
        yield counter("tandem_kv_window_freed_blocks", "KV blocks a sliding-window model "
                      "released once they left every query's window.", s.kv_window_freed_blocks)
        if s.kv_tiers:
            yield from _tiers(s, self.model_name)
        if self.model_memory_bytes is not None:
            yield gauge("tandem_model_memory_bytes", "Resident weight bytes (every tensor of "
                        "the model as stored: quantized codes, scales and float weights).",
                        self.model_memory_bytes)
        if self.num_speculative_tokens or s.spec_accepted_per_pos:
            yield from self._spec_decode(s, counter)
        if s.max_loras:
            yield self._lora_info(s)
        if s.step_paths:
            yield from self._step_paths(s)

    def _step_paths(self, s: EngineStats) -> Iterator[CounterMetricFamily]:
        """Forward steps replayed from the decode graphs vs run eagerly, by reason."""
        labels = ["model_name", "path", "reason"]
        steps = CounterMetricFamily(
            "tandem_engine_steps", "Forward steps by path: graph (decode graphs replayed) or "
            "eager, and why (disabled, mixed, lora, spec_verify, prompt_logprobs, "
            "layer_stream, hidden_states, too_large; decode for graph steps).", labels=labels)
        seconds = CounterMetricFamily(
            "tandem_engine_step_seconds", "Model runner wall seconds of those steps, by path "
            "and reason.", labels=labels)
        for p in s.step_paths:
            steps.add_metric([self.model_name, p.path, p.reason], p.steps)
            seconds.add_metric([self.model_name, p.path, p.reason], p.seconds)
        yield steps
        yield seconds

    @staticmethod
    def _lora_info(s: EngineStats) -> GaugeMetricFamily:
        """vLLM's `vllm:lora_requests_info`: one sample whose labels list the adapters of
        running and waiting requests (comma-separated) and `max_lora`; its value is the
        time of the reading (what llm-d's LoRA affinity scorer keys on)."""
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                              labels=["max_lora", "running_lora_adapters",
                                      "waiting_lora_adapters"])
        g.add_metric([str(s.max_loras), ",".join(s.lora_running), ",".join(s.lora_waiting)],
                     time.time())
        return g

    def _spec_decode(self, s: EngineStats, counter: Callable[..., CounterMetricFamily]
                     ) -> Iterator[CounterMetricFamily]:
        """vLLM's spec_decode counters; accepted tokens per draft position 0 .. k-1 (a
        position no draft reached yet reads 0)."""
        yield counter("vllm:spec_decode_num_drafts", "Verifications of drafts (requests x "
                      "steps that carried proposed tokens).", s.spec_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.",
                      s.spec_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                      s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens by their position in the draft.",
                                      labels=["model_name", "position"])
        counts = list(s.spec_accepted_per_pos)
        counts += [0] * (self.num_speculative_tokens - len(counts))
        for pos, n in enumerate(counts):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._engine = _EngineCollector(model_name, snapshot)
        self.registry.register(self._engine)
        lbl = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lbl,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", lbl,
                             buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             lbl, buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time spent waiting.", lbl,
                               buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self.kv_fetches = Counter("tandem_kvtransfer_fetches",
                                  "Remote prefills asked for by this (decode) worker, by result "
                                  "(ok, or the failure's reason) and backend",
                                  ["model_name", "result", "backend"], registry=reg)
        self.kv_fetched_bytes = Counter("tandem_kvtransfer_received_bytes",
                                        "KV page bytes received from prefill workers", lbl,
                                        registry=reg).labels(model_name)
        self.kv_fetch_seconds = Histogram("tandem_kvtransfer_fetch_seconds",
                                          "Remote prefill + transfer + import, per prompt", lbl,
                                          buckets=LATENCY_BUCKETS, registry=reg
                                          ).labels(model_name)
        self.kv_peer_pulls = Counter("tandem_kv_peer_pulls",
                                     "Peer pulls of prompt blocks another worker holds, by "
                                     "result (pulled: all missing blocks, or as many as the "
                                     "router's hint; partial: fewer; none_held, failed, "
                                     "timeout, no_room; ignored: the request also named a "
                                     "prefill worker)", ["model_name", "result"], registry=reg)
        self.kv_peer_pulled_blocks = Counter("tandem_kv_peer_pulled_blocks",
                                             "KV blocks (every layer) received by peer pulls",
                                             lbl, registry=reg).labels(model_name)
        self.kv_streams = Gauge("tandem_kvtransfer_streams_active",
                                "KV page transfers in progress, by direction: send (Prefill "
                                "calls this prefill worker is serving) or receive (remote "
                                "prefills this decode worker is fetching)",
                                ["model_name", "direction"], registry=reg)
        self.kv_streams.labels(model_name, "send").set_function(lambda: self.kv_sending())
        self.kv_receiving = self.kv_streams.labels(model_name, "receive")
        self.kv_sending: Callable[[], int] = lambda: 0  # the KV transfer service's count
        self.in_flight = Gauge("tandem_worker_requests_in_flight",
                               "Generation requests submitted to the engine whose outputs are "
                               "still being read (each ends when its answer or stream does)",
                               lbl, registry=reg)
        self.open_streams: Callable[[], int] = lambda: 0  # the engine's, once it is loaded
        self.in_flight.labels(model_name).set_function(lambda: self.open_streams())
        self.auth_rejected = Counter("tandem_worker_auth_rejected",
                                     "Requests and gRPC calls refused for want of a valid "
                                     "router signature, by reason (no_key, missing, "
                                     "malformed, bad, stale, replayed)", ["model_name", "reason"],
                                     registry=reg)

    def attach(self, block_size: int, num_blocks: int,
               model_memory_bytes: int | None = None, num_speculative_tokens: int = 0) -> None:
        """Record the loaded engine's KV geometry and resident weight bytes (None: not
        reported, and `tandem_model_memory_bytes` is not exported) and its speculative k
        (0: no speculative decoding, no `vllm:spec_decode_*` series)."""
        self._engine.block_size = block_size
        self._engine.num_blocks = num_blocks
        self._engine.model_memory_bytes = model_memory_bytes
        self._engine.num_speculative_tokens = num_speculative_tokens

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()
