"""The router's Prometheus metrics (`tandem_router_*`), on a registry of its own.

Under `tandem router --processes N` (`PROMETHEUS_MULTIPROC_DIR` set by the supervisor) the
values live in prometheus_client's shared files and `exposition()` sums every process's
counters and histograms; the per-worker gauges, which the scraped process sets just before,
report their most recent value."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 1.0)
FLOW_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("tandem_router_decisions_total",
                                 "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.prompt_tokens = Counter("tandem_router_prompt_tokens_total",
                                     "Prompt tokens of routed requests", registry=r)
        self.matched_tokens = Counter("tandem_router_prefix_matched_tokens_total",
                                      "Prompt tokens already cached on the chosen worker",
                                      registry=r)
        self.routing_seconds = Histogram("tandem_router_routing_seconds",
                                         "Parse + tokenize + hash + pick, per request",
                                         buckets=ROUTING_BUCKETS, registry=r)
        self.retries = Counter("tandem_router_retries_total",
                               "Attempts beyond the first, by cause", ["cause"], registry=r)
        self.migrations = Counter("tandem_router_migrations_total",
                                  "Broken requests: moved to another worker (result resumed, "
                                  "retried) or not (limit, no_worker, not_replayable, failed), "
                                  "by what broke them (connection, stalled, draining, error)",
                                  ["result", "reason"], registry=r)
        self.guardrail_decisions = Counter(
            "tandem_router_guardrail_decisions_total",
            "Guardrail decisions, by guardrail, layer (input, output, policy) and verdict "
            "(pass, refuse, redact, stop, flag, error)", ["guardrail", "layer", "verdict"],
            registry=r)
        self.guardrail_seconds = Histogram(
            "tandem_router_guardrail_seconds",
            "Time the guardrails of one layer took on one request (input: policy and input "
            "guardrails, before routing; output: filtering the whole answer, streamed or "
            "not)", ["layer"], buckets=ROUTING_BUCKETS, registry=r)
        self.rejected = Counter("tandem_router_rejected_total",
                                "Requests answered by the router itself, by status",
                                ["status"], registry=r)
        self.requests = Counter("tandem_router_requests_total",
                                "Requests forwarded, by worker and status",
                                ["worker", "status"], registry=r)
        self.disaggregated = Counter("tandem_router_disaggregated_requests_total",
                                     "Requests answered with their prefill on a prefill "
                                     "worker (P/D), by the decode worker's KV transfer "
                                     "backend", ["backend"], registry=r)
        self.aggregated = Counter("tandem_router_aggregated_requests_total",
                                  "Requests answered with prefill and decode on one worker, "
                                  "by reason (below_threshold, prompt_logprobs, "
                                  "decode_not_capable, unsigned, no_prefill_worker, "
                                  "prefill_busy, prefill_backlog, local_faster)", ["reason"],
                                  registry=r)
        self.pd_overruled = Counter("tandem_router_pd_stall_budget_overrules_total",
                                    "Requests disaggregated although the cost decision found "
                                    "a local prefill cheaper, because the decode worker's "
                                    "stall budget was spent", registry=r)
        self.peer_pulls = Counter("tandem_router_peer_pulls_total",
                                  "Requests answered by a worker told to pull the prompt's "
                                  "prefix from a KV peer, by the slowest medium the peer "
                                  "holds the pulled blocks in (device, host, disk)",
                                  ["medium"], registry=r)
        self.worker_ready = Gauge("tandem_router_worker_ready",
                                  "1 if the worker passes readiness and its breaker is closed",
                                  ["worker"], registry=r, multiprocess_mode="mostrecent")
        self.worker_indexed_blocks = Gauge("tandem_router_worker_indexed_blocks",
                                           "Blocks the index holds for the worker",
                                           ["worker"], registry=r, multiprocess_mode="mostrecent")
        self.worker_in_flight = Gauge("tandem_router_worker_requests_in_flight",
                                      "Requests this router has open on the worker (sent, "
                                      "response not finished)", ["worker"], registry=r,
                                      multiprocess_mode="mostrecent")
        self.upstream_connections = Gauge("tandem_router_upstream_connections",
                                          "Open HTTP connections to workers, by state: active "
                                          "(carrying a request) or idle (kept alive)",
                                          ["state"], registry=r, multiprocess_mode="mostrecent")
        self.worker_events_connected = Gauge("tandem_router_worker_kv_events_connected",
                                             "1 while the worker's KV event stream is live",
                                             ["worker"], registry=r, multiprocess_mode="mostrecent")
        self.reload_errors = Gauge("tandem_router_file_reload_errors",
                                   "Failed re-reads of a watched file (api_keys, "
                                   "worker_auth_key) that kept the last good content",
                                   ["file"], registry=r, multiprocess_mode="max")
        self.index_store_lookups = Counter("tandem_router_index_store_lookups_total",
                                           "Shared index store lookups: ok, or fallback to "
                                           "the in-memory index (Redis down or slow)",
                                           ["result"], registry=r)

        self.approximate_routing = Gauge("tandem_router_approximate_routing",
                                         "1 for a model routed on text hashes, without its "
                                         "tokenizer (no cache-aware prefix scoring, no shared "
                                         "index); model \"*\": no default tokenizer",
                                         ["model"], registry=r, multiprocess_mode="max")

        # flow control (`flowcontrol`): labels are the priority band and the tenant
        self.flow_queued = Gauge("tandem_router_flow_queued",
                                 "Requests waiting in flow control's queue, by band and tenant",
                                 ["band", "tenant"], registry=r, multiprocess_mode="livesum")
        self.flow_dispatched = Counter("tandem_router_flow_dispatched_total",
                                       "Requests flow control let through to routing, by band "
                                       "and tenant", ["band", "tenant"], registry=r)
        self.flow_shed = Counter("tandem_router_flow_shed_total",
                                 "Requests flow control answered itself or lost, by band, "
                                 "tenant and reason (band-full, ttl, deadline, no-endpoint, "
                                 "start-timeout, closing, cancelled)",
                                 ["band", "tenant", "reason"], registry=r)
        self.flow_wait = Histogram("tandem_router_flow_wait_seconds",
                                   "Time a request waited in flow control before routing, "
                                   "by band", ["band"], buckets=FLOW_WAIT_BUCKETS, registry=r)
        self.flow_shared = Gauge("tandem_router_flow_shared",
                                 "1 while flow control shares its queue state through Redis, "
                                 "0 while this replica decides alone (Redis unavailable)",
                                 registry=r, multiprocess_mode="min")
        # the gateway's endpoint picker (`extproc`, `--ext-proc-port`)
        self.extproc_streams = Counter("tandem_router_extproc_streams_total",
                                       "ext_proc streams (one per request through the "
                                       "gateway)", registry=r)
        self.extproc_picks = Counter("tandem_router_extproc_picks_total",
                                     "Endpoint picker outcomes: routed, no_endpoint (503), "
                                     "shed (429 from flow control), rejected (another "
                                     "error answer), models (GET /v1/models answered)",
                                     ["outcome"], registry=r)
        self.extproc_immediate = Counter("tandem_router_extproc_immediate_responses_total",
                                         "Answers the endpoint picker gave itself "
                                         "(ImmediateResponse), by HTTP status", ["status"],
                                         registry=r)
        self.extproc_served = Counter("tandem_router_extproc_served_total",
                                      "The endpoint that served a picked request, as the "
                                      "gateway reports it: pick, fallback, other (not in the "
                                      "list), unreported", ["outcome"], registry=r)
        self.extproc_objectives = Gauge("tandem_router_extproc_objectives",
                                        "InferenceObjectives of the endpoint picker's "
                                        "InferencePool known from the cluster (watched)",
                                        registry=r, multiprocess_mode="max")

    def child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: the per-request path skips the library's
        label validation and lock (bounded: label values are policies, reasons, statuses
        and worker URLs)."""
        key = (metric._name, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def exposition(self) -> bytes:
        """The text format of every metric (of all router processes, under `--processes`)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
