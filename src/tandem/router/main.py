"""`tandem router`: arguments, the optional YAML config, tokenizers, the HTTP server.

    tandem router --port 8000 --workers http://w1:8000,http://w2:8000 \\
        [--policy cache-aware|cost|round-robin|random|least-loaded] [--config router.yaml] \\
        [--tokenizer PATH | --tokenizer MODEL=PATH ...] [--api-keys FILE] [--pd-threshold N] \\
        [--http-server lean|uvicorn]
    tandem router --discovery kubernetes [--namespace NS] [--inference-service NAME[,NAME]] \\
        [--router-group GROUP] [--label-selector SELECTOR] [--worker-port-name http] ...

Workers come from `--workers` (`--discovery static`, the default) or, with `--discovery
kubernetes`, from the EndpointSlices of the worker Services in `--namespace` (default: the
pod's own) matching `--label-selector` (default `app.kubernetes.io/component=worker`, plus
`tandem.dev/inference-service=NAME` with `--inference-service`, `... in (A,B)` for several,
and `tandem.dev/router-group=GROUP` with `--router-group`): each address on the port
named `--worker-port-name` is a worker, with the role of its slice's `tandem.dev/role` label.
Workers join, leave and turn unready as the slices change.

Prefill/decode disaggregation (`pd.py`) needs no switch: with prefill workers (role
`prefill`) for a model, a request whose decode worker lacks at least `--pd-threshold` prompt
tokens (default 16) has its prefill run on one of them (with `--pd-decision cost`, only
when that is estimated to beat prefilling it where it decodes); without, every request is
aggregated.

`router.yaml` may set any of: `workers` (list), `discovery`, `namespace`, `label_selector`,
`inference_service`, `router_group`, `worker_port_name`, `policy`, `weights` (scorer ->
weight, over the defaults: a scorer left out keeps its default, 0 switches it off),
`saturation_queue`, `saturation_kv`, `speculative_ttl_s`, `churn_half_life_s`, `pd_threshold`,
`pd_max_prefill_queue`, `pd_max_local_prefill`, `pd_decision`, `pd_itl_weight`,
`pd_stall_budget`, `peer_pull`,
`retries`, `max_migrations`,
`max_prompt_tokens`,
`max_tokens_cap`, `max_body_bytes`, `tokenizers` (model -> path), `processes`,
`redis` (URL or env:VAR), `index` (URL or env:VAR), `redis_key_prefix`, `drain_seconds`,
`debug_headers`, `metrics_port`, `metrics_auth`, `openapi`, `send_timeout_seconds`,
`max_connections`, `ext_proc_port`, `ext_proc_host`, `ext_proc_fallbacks` (endpoints listed
after the pick; default 0), `ext_proc_tls_client_ca`, `ext_proc_allowed_clients` (list),
`objectives` (InferenceObjective name -> priority),
`inference_pool` (the InferencePool whose InferenceObjectives are watched),
`priority: {default: {min, max, default}, tenants: {NAME: {...}}}` (each
tenant's priority range, `router/priority.py`) and `rate_limits: {default: {requests_per_s,
burst_requests, tokens_per_min}, tenants: {NAME: {...}}}`, `flow_control: {enabled,
fairness, ordering, ttl_s, saturation: {waiting, kv}, bands: {N|default: {max_requests,
max_bytes}}, tenant_weights: {NAME: w}, shared}` (`flowcontrol/`; `--flow-control` turns it
on with defaults), `served_models: [{name, start_timeout_s}]` and `guardrails: {input,
output, policies, audit}` (`guardrails/config.py`); flags win over the file. An
unknown key (at any level) or a value of the wrong type or range stops start-up with one
line naming it (`config.py`; `tandem router` reports it as a usage error, exit 2).

The front door (`add_front_door_args`): answers name no worker unless `--debug-headers`;
`/metrics` needs a key on `--port` when `--api-keys` is set, or moves to `--metrics-port`;
`/openapi.json` only with `--openapi`; a client that takes no bytes for
`--send-timeout-seconds` is cut; at most `--max-connections` connections per process.

The gateway's endpoint picker (`extproc`): with `--ext-proc-port N` the same process also
serves Envoy's External Processing gRPC service there (on `--ext-proc-host`, default
`--host`), as a Gateway API Inference Extension endpoint picker over the same routing core;
TLS with `--ext-proc-tls-cert` and `--ext-proc-tls-key`, plaintext without; mutual TLS with
`--ext-proc-tls-client-ca`, only the named clients with `--ext-proc-allowed-client`. It runs
in one process: with `--processes` above 1 it is a usage error (exit 2); scale it with replicas.

Tokenizers: the router hashes prompts exactly as a worker does only with the worker's
tokenizer (a path, or a Hugging Face repository id `ORG/NAME[@REVISION]` whose tokenizer
files come through the hub cache, `protocol/hub.py`). By default the bundled model's served
name maps to the bundled GGUF; other models without a configured tokenizer are routed on
text hashes (approximate mode).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.protocol.cli_args import busy_message, busy_ports, port_number
from tandem.protocol.signing import add_worker_auth_arg, load_worker_key
from tandem.protocol.tls import add_tls_arg, tls_from_args
from tandem.protocol.watched import DEFAULT_INTERVAL_S as API_KEYS_RELOAD_S
from tandem.router.discovery import (
    DISCOVERY,
    Discovery,
    DiscoveryConfig,
    make_discovery,
    pod_namespace,
    worker_selector,
)

if TYPE_CHECKING:
    from tandem.protocol.tokenizer import Tokenizer
    from tandem.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
POLICIES = ("cache-aware", "cost", "round-robin", "random", "least-loaded")
DEFAULT_POLICY = "cost"  # at least as good as cache-aware in bench/routing.py (bench/results)
MAX_APPROXIMATE_MODELS = 64  # model names logged / labelled as approximate (client-chosen)
DRAIN_SECONDS = 25.0  # the operator renders terminationGracePeriodSeconds around it
CHILD_EXIT_SLACK_S = 5.0  # --processes: a child's shutdown after its drain, before SIGKILL
SEND_TIMEOUT_S = 30.0  # a client that takes no bytes this long is cut
MAX_CONNECTIONS = 4096  # per router process


@dataclass(frozen=True)
class FrontDoor:
    """The front door's settings (`add_front_door_args`)."""

    debug_headers: bool = False
    metrics_port: int | None = None
    metrics_auth: bool | None = None
    openapi: bool = False
    send_timeout_s: float = SEND_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--workers", default="", help="comma-separated worker base URLs")
    p.add_argument("--discovery", default=None, choices=sorted(DISCOVERY),
                   help="where workers come from: static (--workers; the default) or "
                        "kubernetes (worker EndpointSlices)")
    p.add_argument("--namespace", default=None,
                   help="kubernetes: the workers' namespace (default: this pod's)")
    p.add_argument("--label-selector", default=None,
                   help=f"kubernetes: which EndpointSlices (default: {worker_selector()}, "
                        "plus the --inference-service label)")
    p.add_argument("--inference-service", default=None,
                   help="kubernetes: only the workers of this InferenceService (several: "
                        "comma-separated names)")
    p.add_argument("--router-group", default=None,
                   help="kubernetes: only the workers of InferenceServices whose worker "
                        "Services carry the label tandem.dev/router-group=NAME")
    p.add_argument("--worker-port-name", default=None,
                   help="kubernetes: the name of the workers' HTTP port (default: http)")
    p.add_argument("--policy", default=None, choices=POLICIES,
                   help=f"how a worker is picked (default: {DEFAULT_POLICY})")
    p.add_argument("--config", default=None, help="router.yaml")
    p.add_argument("--tokenizer", action="append", default=[],
                   help="PATH for every model, or MODEL=PATH (repeatable); PATH may be a "
                        "Hugging Face repository id, ORG/NAME[@REVISION] (its tokenizer "
                        "files, through the hub cache)")
    p.add_argument("--tokenizer-process", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="tokenize a long new prompt text in a helper process (no GIL shared "
                        "with the event loop); with --no-tokenizer-process, on a worker "
                        "thread")
    p.add_argument("--api-keys", default=None,
                   help="file of 'KEY TENANT' lines; re-read every "
                        f"{API_KEYS_RELOAD_S:g} s, so a removed key stops working within "
                        f"{API_KEYS_RELOAD_S:g} s of the file changing (a mounted Secret: "
                        "kubelet takes up to ~1 min + its sync period to update it); a "
                        "malformed rewrite keeps the last good keys. Needs "
                        "--worker-auth-key-file")
    p.add_argument("--admin-api-keys", default=None,
                   help="file of 'KEY NAME' lines (as --api-keys) whose keys may call "
                        "/v1/load_lora_adapter and /v1/unload_lora_adapter while --api-keys "
                        "is on (without --api-keys those are open)")
    p.add_argument("--retries", type=int, default=None)
    p.add_argument("--max-migrations", type=int, default=None, metavar="N",
                   help="workers a completions or chat request whose worker breaks mid-way "
                        "may move to, resumed by token replay (default 3; 0: off; needs "
                        "--worker-auth-key-file)")
    p.add_argument("--pd-threshold", type=int, default=None, metavar="TOKENS",
                   help="prefill on a prefill worker when the decode worker lacks at least "
                        "this many prompt tokens (default 16; only with prefill workers)")
    p.add_argument("--pd-max-prefill-queue", type=int, default=None, metavar="REQUESTS",
                   help="serve aggregated when the best prefill worker already has this many "
                        "requests running or waiting (default 0: no bound)")
    p.add_argument("--pd-max-local-prefill", type=int, default=None, metavar="TOKENS",
                   help="with --pd-max-prefill-queue: a prompt lacking more than this many "
                        "tokens still queues on a prefill worker rather than prefilling on "
                        "the decode worker (default 1024; 0: no cap)")
    p.add_argument("--peer-pull", action=argparse.BooleanOptionalAction, default=None,
                   help="name a KV peer holding more of the prompt than the chosen worker "
                        "when pulling it is faster than computing it (default on; acts only "
                        "with --worker-auth-key-file: the peer header is signed)")
    p.add_argument("--pd-decision", choices=("cost", "threshold"), default=None,
                   help="cost (default): disaggregate when the prefill worker's backlog, "
                        "prefill and page transfer beat prefilling on the decode worker plus "
                        "the stall that costs its running streams (measured rates; the "
                        "threshold rule until a prefill worker has measured its rate); "
                        "threshold: whenever --pd-threshold tokens are missing")
    p.add_argument("--pd-itl-weight", type=float, default=None, metavar="W",
                   help="with --pd-decision cost: seconds of TTFT a local prefill may save "
                        "per second it stalls each running stream on the decode worker "
                        "(default 1; 0: TTFT alone)")
    p.add_argument("--pd-stall-budget", type=float, default=None, metavar="SHARE",
                   help="with --pd-decision cost: the most a decode worker's steps that its "
                        "local prefills may stall while it has running streams, as a share "
                        "in [0, 1) over the last 30 s; past it, prompts go to a prefill "
                        "worker (protects the inter-token latency percentiles above 1 - "
                        "SHARE; default 0.005; 0: no budget)")
    p.add_argument("--redis", default=None,
                   help="redis://host:port/db shared by router replicas for rate limits "
                        "(env:VAR: the URL from environment variable VAR)")
    p.add_argument("--index", default=None, metavar="redis://HOST:PORT/DB",
                   help="keep the prefix index in Redis too, shared by router replicas "
                        "(a new replica is warm at once; Redis down = in-memory index; "
                        "env:VAR: the URL from environment variable VAR)")
    p.add_argument("--redis-key-prefix", default=None, metavar="PREFIX",
                   help="every Redis key (rate limits PREFIXrl:, shared index PREFIXkv:) "
                        "starts with this (default tandem:; the operator sets "
                        "tandem:NAMESPACE:INFERENCESERVICE:)")
    add_tls_arg(p)  # the workers' gRPC: KV events and load
    add_worker_auth_arg(p)  # signs every request forwarded to a worker
    p.add_argument("--flow-control", action="store_true", default=False,
                   help="queue requests while every worker of their model is saturated "
                        "(fair between tenants, by priority band; router.yaml flow_control "
                        "sets its policies; default off)")
    p.add_argument("--seed", type=int, default=None, help="seed tie-breaking (tests)")
    p.add_argument("--processes", type=int, default=None,
                   help="router processes sharing the port (SO_REUSEPORT; default 1)")
    p.add_argument("--http-server", default="lean", choices=("lean", "uvicorn"),
                   help="front-door HTTP server: lean (protocol.http_server, ~0.2 ms less "
                        "CPU per request) or uvicorn")
    p.add_argument("--drain-seconds", type=_drain_seconds, default=None, metavar="S",
                   help="on SIGTERM, in-flight requests and streams get up to S seconds to "
                        f"finish (default {DRAIN_SECONDS:g}; router.yaml drain_seconds)")
    add_front_door_args(p)
    add_ext_proc_args(p)


def add_ext_proc_args(p: argparse.ArgumentParser) -> None:
    """The gateway's endpoint picker (`extproc`; router.yaml `ext_proc_port`, `ext_proc_host`,
    `objectives`)."""
    p.add_argument("--ext-proc-port", type=port_number, default=None, metavar="PORT",
                   help="also serve Envoy's External Processing (ext_proc) gRPC service on "
                        "this port: Tandem as a Gateway API Inference Extension endpoint "
                        "picker for an existing gateway (default: off)")
    p.add_argument("--ext-proc-host", default=None, metavar="HOST",
                   help="the endpoint picker's address (default: --host)")
    p.add_argument("--ext-proc-tls-cert", default=None, metavar="PEM",
                   help="serve the endpoint picker over TLS with this certificate (with "
                        "--ext-proc-tls-key; default: plaintext)")
    p.add_argument("--ext-proc-tls-key", default=None, metavar="PEM",
                   help="the private key of --ext-proc-tls-cert")
    p.add_argument("--ext-proc-tls-client-ca", default=None, metavar="PEM",
                   help="mutual TLS: every client of the endpoint picker's port (ext_proc and "
                        "its gRPC health services) must present a certificate this CA issued "
                        "(needs --ext-proc-tls-cert; router.yaml ext_proc_tls_client_ca)")
    p.add_argument("--ext-proc-allowed-client", action="append", default=None, metavar="NAME",
                   help="with --ext-proc-tls-client-ca: serve only client certificates naming "
                        "NAME (a SAN DNS name or URI, or the subject CN); others get "
                        "PERMISSION_DENIED. Repeatable (router.yaml ext_proc_allowed_clients; "
                        "default: any certificate of the CA)")
    p.add_argument("--inference-pool", default=None, metavar="NAME",
                   help="the InferencePool this endpoint picker serves: with --discovery "
                        "kubernetes, watch the namespace's InferenceObjectives whose poolRef "
                        "names it (their priorities win over router.yaml objectives; "
                        "default: none watched)")


def ext_proc_settings(args: argparse.Namespace, cfg: dict[str, Any]):  # noqa: ANN201
    """The endpoint picker's settings (`ExtProcSettings`), or None when it is off; SystemExit
    naming a bad combination."""
    from tandem.router.extproc.settings import ExtProcSettings

    port = getattr(args, "ext_proc_port", None) or cfg.get("ext_proc_port")
    cert, key = getattr(args, "ext_proc_tls_cert", None), getattr(args, "ext_proc_tls_key", None)
    pool = getattr(args, "inference_pool", None) or cfg.get("inference_pool")
    client_ca = getattr(args, "ext_proc_tls_client_ca", None) or cfg.get("ext_proc_tls_client_ca")
    allowed = tuple(getattr(args, "ext_proc_allowed_client", None)
                    or cfg.get("ext_proc_allowed_clients") or ())
    if port is None:
        if cert or key or client_ca or allowed or getattr(args, "ext_proc_host", None) or pool:
            raise SystemExit("--ext-proc-host / --ext-proc-tls-* / --inference-pool: need "
                             "--ext-proc-port")
        return None
    if port == args.port or port == (args.metrics_port or cfg.get("metrics_port")):
        raise SystemExit("ext_proc_port: must differ from --port and --metrics-port")
    for flag, path in (("--ext-proc-tls-cert", cert), ("--ext-proc-tls-key", key),
                       ("--ext-proc-tls-client-ca", client_ca)):
        if path is not None and not os.access(path, os.R_OK):
            raise SystemExit(f"{flag}: cannot read {path}")
    try:
        return ExtProcSettings(
            port=port, host=getattr(args, "ext_proc_host", None) or cfg.get("ext_proc_host")
            or args.host, tls_cert=cert, tls_key=key, tls_client_ca=client_ca,
            allowed_clients=allowed, objectives=cfg.get("objectives") or {},
            fallbacks=int(cfg.get("ext_proc_fallbacks", 0)), grace_s=drain_seconds(args, cfg),
            inference_pool=pool, watch=objective_watch(args, cfg, pool))
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def objective_watch(args: argparse.Namespace, cfg: dict[str, Any], pool: str | None):  # noqa: ANN201
    """The InferenceObjective watch of `pool` (`ObjectiveWatch`; None without a pool);
    SystemExit for a pool name that is no Kubernetes name or without Kubernetes discovery."""
    if pool is None:
        return None
    from tandem.router.discovery.objectives import ObjectiveWatch, valid_pool_name

    if (args.discovery or cfg.get("discovery", "static")) != "kubernetes":
        raise SystemExit("--inference-pool: needs --discovery kubernetes (the "
                         "InferenceObjectives are read from the cluster)")
    if not valid_pool_name(pool):
        raise SystemExit(f"--inference-pool: {pool!r} is not a Kubernetes object name "
                         "(at most 253 lower-case letters, digits, '-' or '.')")
    return ObjectiveWatch(args.namespace or cfg.get("namespace") or pod_namespace(), pool)


def add_front_door_args(p: argparse.ArgumentParser) -> None:
    """What the router's answers reveal and what a client may hold (router.yaml: the same
    names with underscores)."""
    p.add_argument("--debug-headers", action="store_true", default=None,
                   help="name the answering worker (x-tandem-worker: a pod address) and pass "
                        "its server-timing in answers (default off)")
    p.add_argument("--metrics-port", type=port_number, default=None, metavar="PORT",
                   help="serve /metrics on this port only (not on --port); without it, "
                        "/metrics on --port needs a key when --api-keys is set")
    p.add_argument("--metrics-auth", action=argparse.BooleanOptionalAction, default=None,
                   help="/metrics needs a key (an admin key when --admin-api-keys is set, "
                        "else any API key); default: on for --port when --api-keys is set, "
                        "off for --metrics-port")
    p.add_argument("--openapi", action="store_true", default=None,
                   help="serve /openapi.json (behind the API keys when set; default off)")
    p.add_argument("--send-timeout-seconds", type=float, default=None, metavar="S",
                   help="cut a connection whose client takes no bytes of its answer or "
                        f"stream for S seconds (default {SEND_TIMEOUT_S:g}; lean server)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="concurrent client connections per router process; more are closed "
                        f"at accept (default {MAX_CONNECTIONS})")


def front_door(args: argparse.Namespace, cfg: dict[str, Any]) -> FrontDoor:
    """The front-door settings: flags win over router.yaml; SystemExit naming a bad one."""
    def flag(key: str, what: str, default: Any) -> Any:
        value = getattr(args, key)
        value = cfg.get(key, default) if value is None else value
        ok = {"a boolean": lambda v: isinstance(v, bool),
              "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
        if value is not None and not ok[what](value):
            raise SystemExit(f"{key}: {what}, not {value!r}")
        return value

    door = FrontDoor(debug_headers=flag("debug_headers", "a boolean", False),
                     metrics_port=flag("metrics_port", "an integer", None),
                     metrics_auth=flag("metrics_auth", "a boolean", None),
                     openapi=flag("openapi", "a boolean", False),
                     send_timeout_s=float(flag("send_timeout_seconds", "a number",
                                               SEND_TIMEOUT_S)),
                     max_connections=flag("max_connections", "an integer", MAX_CONNECTIONS))
    if door.metrics_port is not None and not 1 <= door.metrics_port <= 65535:
        raise SystemExit(f"metrics_port: a port in 1-65535, not {door.metrics_port}")
    if door.metrics_port is not None and door.metrics_port == args.port:
        raise SystemExit("metrics_port: must differ from --port")
    if not 0 < door.send_timeout_s <= 86400:
        raise SystemExit(f"send_timeout_seconds: in (0, 86400], not {door.send_timeout_s:g}")
    if door.max_connections < 1:
        raise SystemExit(f"max_connections: at least 1, not {door.max_connections}")
    return door


def _drain_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def drain_seconds(args: argparse.Namespace, cfg: dict[str, Any]) -> float:
    """`--drain-seconds`, else router.yaml `drain_seconds`, else `DRAIN_SECONDS`."""
    if args.drain_seconds is not None:
        return args.drain_seconds
    value = cfg.get("drain_seconds", DRAIN_SECONDS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise SystemExit(f"drain_seconds: a number of seconds >= 0, not {value!r}")
    return float(value)


def redis_urls(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[str | None, str | None]:
    """(rate-limit Redis URL, index Redis URL): flags win over router.yaml; `env:VAR` read."""
    from tandem.router.redis_url import resolve

    try:
        return (resolve(args.redis or cfg.get("redis"), "--redis / redis"),
                resolve(args.index or cfg.get("index"), "--index / index"))
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def _load_yaml(path: str | None) -> dict[str, Any]:
    """router.yaml's keys that are set, checked (`config.load_config`: RouterConfigError)."""
    from tandem.router.config import load_config

    return load_config(path)


class TokenizerResolver:
    """model name -> Tokenizer | None (`__call__`), each file loaded once."""

    def __init__(self, specs: list[str], from_file: dict[str, str],
                 helper_process: bool = False) -> None:
        """A repository id among the paths is resolved here, at start-up (its tokenizer
        files through the hub cache; `protocol.hub.ModelSourceError`), never on a request's
        path. `helper_process`: each tokenizer encodes long texts in a helper process
        (`Tokenizer.start_helper`)."""
        self.helper_process = helper_process
        from tandem.protocol.bundled import BUNDLED_NAME, find_bundled_gguf
        from tandem.protocol.hub import resolve_model

        self.per_model: dict[str, str] = dict(from_file)
        self.default: str | None = None
        for spec in specs:
            name, sep, path = spec.partition("=")
            if sep:
                self.per_model[name] = path
            else:
                self.default = spec
        local = {p: str(resolve_model(p, tokenizer_only=True))
                 for p in dict.fromkeys([*self.per_model.values(), self.default]) if p}
        self.per_model = {name: local[p] if p else p for name, p in self.per_model.items()}
        self.default = self.default and local[self.default]
        self.configured = bool(self.per_model) or self.default is not None
        bundled = find_bundled_gguf()
        if bundled is not None:
            self.per_model.setdefault(BUNDLED_NAME, str(bundled))
        self._loaded: dict[str, Tokenizer] = {}
        self.approximate: set[str] = set()  # models seen without a tokenizer (bounded)
        self._metrics: RouterMetrics | None = None

    def _load(self, path: str) -> Tokenizer:
        tok = self._loaded.get(path)
        if tok is None:
            from tandem.protocol.tokenizer import Tokenizer

            tok = self._loaded[path] = Tokenizer.load(path)  # local (resolved at start-up)
            if self.helper_process:
                tok.start_helper()
        return tok

    def __call__(self, model: str) -> Tokenizer | None:
        path = self.per_model.get(model, self.default)
        if path:
            return self._load(path)
        if model not in self.approximate and len(self.approximate) < MAX_APPROXIMATE_MODELS:
            self.approximate.add(model)
            logger.warning("model %r has no tokenizer: routed approximately on text hashes "
                           "(no cache-aware prefix scoring, no shared index)", model)
            if self._metrics is not None:
                self._metrics.child(self._metrics.approximate_routing, model).set(1)
        return None

    def bind_metrics(self, metrics: RouterMetrics) -> None:
        """At start-up: say (log line, `tandem_router_approximate_routing`) which models
        will be routed approximately; model "*" when no tokenizer is configured at all."""
        self._metrics = metrics
        if self.default is None:
            logger.warning("approximate routing for every model but %s: no tokenizer for "
                           "them (--tokenizer PATH or router.yaml tokenizers)",
                           sorted(self.per_model) or "none")
        if not self.configured:
            metrics.child(metrics.approximate_routing, "*").set(1)
        for model in self.approximate:
            metrics.child(metrics.approximate_routing, model).set(1)

    def preload(self) -> None:
        """Load every configured tokenizer now, not on some request's critical path."""
        for path in {*self.per_model.values(), *([self.default] if self.default else [])}:
            self._load(path)


def fetch_tokenizers(specs: list[str], from_file: dict[str, str]) -> None:
    """Before the router starts: every tokenizer named by a repository id (`--tokenizer`,
    router.yaml `tokenizers`) downloaded, or found in the hub cache offline, so a bad or
    missing one is an error now (`protocol.hub.ModelSourceError`), not at the first request."""
    TokenizerResolver(specs, from_file)


def discovery_from(args: argparse.Namespace, cfg: dict[str, Any],
                   workers: list[str]) -> Discovery:
    """The worker discovery that the flags (first) and router.yaml ask for."""
    kind = args.discovery or cfg.get("discovery", "static")
    if kind != "static" and workers:
        raise SystemExit(f"worker URLs are for --discovery static, not {kind}")
    try:
        return make_discovery(kind, DiscoveryConfig(
            urls=tuple(workers),
            namespace=args.namespace or cfg.get("namespace") or pod_namespace(),
            label_selector=args.label_selector or cfg.get("label_selector"),
            inference_service=args.inference_service or cfg.get("inference_service"),
            router_group=args.router_group or cfg.get("router_group"),
            port_name=args.worker_port_name or cfg.get("worker_port_name") or "http"))
    except ValueError as exc:  # a name that is no label value
        raise SystemExit(f"--inference-service / --router-group: {exc}") from None


def _count(args: argparse.Namespace, cfg: dict[str, Any], key: str, default: int,
           what: str, least: int = 0) -> int:
    """An integer setting of at least `least`: the flag, else router.yaml, else `default`."""
    flag = getattr(args, key, None)
    value = flag if flag is not None else cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SystemExit(f"{key}: {what} >= {least}, not {value!r}")
    return value


def _weight(flag: float | None, value: float) -> float:
    """--pd-itl-weight (else router.yaml's): a finite number in [0, 1000]."""
    value = flag if flag is not None else value
    if not 0 <= value <= 1000:  # NaN fails too
        raise SystemExit(f"pd_itl_weight: a number in [0, 1000], not {value!r}")
    return float(value)


def _share(flag: float | None, value: float) -> float:
    """--pd-stall-budget (else router.yaml's): a number in [0, 1)."""
    value = flag if flag is not None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SystemExit(f"pd_stall_budget: a share in [0, 1), not {value!r}")
    return float(value)


def _seconds(cfg: dict[str, Any], key: str, default: float) -> float:
    """A positive number of seconds from router.yaml, else `default`."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SystemExit(f"{key}: a number of seconds > 0, not {value!r}")
    return float(value)


def build(args: argparse.Namespace,  # noqa: ANN201 - (FastAPI app, Router, settings)
          cfg: dict[str, Any] | None = None):
    """The router app from parsed arguments and the YAML config (read from `--config` unless
    the caller has it already)."""
    from tandem.router.app import RouterServerSettings, build_app
    from tandem.router.auth import ApiKeys
    from tandem.router.config import check_config, merged_weights
    from tandem.router.core import Router, RouterSettings
    from tandem.router.monitor import MonitorSettings
    from tandem.router.proxy import ProxySettings
    from tandem.router.ratelimit import Limits, RateLimiter
    from tandem.router.redis_url import key_prefix as redis_key_prefix
    from tandem.router.redis_url import masked

    cfg = _load_yaml(args.config) if cfg is None else check_config(cfg)
    workers = [u for u in (args.workers.split(",") if args.workers else cfg.get("workers", []))
               if u]
    discovery = discovery_from(args, cfg, workers)
    settings = RouterSettings(
        policy=args.policy or cfg.get("policy", DEFAULT_POLICY),
        weights=merged_weights(cfg.get("weights")),
        saturation_queue=int(cfg.get("saturation_queue", 8)),
        saturation_kv=float(cfg.get("saturation_kv", 0.9)),
        speculative_ttl_s=float(cfg.get("speculative_ttl_s", 2.0)),
        churn_half_life_s=_seconds(cfg, "churn_half_life_s", 30.0), seed=args.seed,
        pd_threshold=_count(args, cfg, "pd_threshold", 16, "a token count"),
        pd_max_prefill_queue=_count(args, cfg, "pd_max_prefill_queue", 0, "a request count"),
        pd_max_local_prefill=_count(args, cfg, "pd_max_local_prefill", 1024, "a token count"),
        pd_decision=getattr(args, "pd_decision", None) or cfg.get("pd_decision", "cost"),
        pd_itl_weight=_weight(getattr(args, "pd_itl_weight", None),
                              cfg.get("pd_itl_weight", 1.0)),
        pd_stall_budget=_share(getattr(args, "pd_stall_budget", None),
                               cfg.get("pd_stall_budget", 0.005)),
        peer_pull=(args.peer_pull if args.peer_pull is not None
                   else cfg.get("peer_pull", True)))
    from tandem.router.flowcontrol.settings import FlowSettings

    try:
        flow = FlowSettings.from_config(cfg.get("flow_control"), cfg.get("served_models"),
                                        bool(getattr(args, "flow_control", False)))
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    settings.flow_saturation_waiting = flow.saturation_waiting
    settings.flow_saturation_kv = flow.saturation_kv
    settings.served_models = dict(flow.served_models)
    tokenizers = TokenizerResolver(args.tokenizer, cfg.get("tokenizers", {}),
                                   helper_process=args.tokenizer_process)
    router = Router(settings, tokenizers)
    rl = cfg.get("rate_limits") or {}
    limiter = None
    redis_url, index_url = redis_urls(args, cfg)
    try:
        key_prefix = redis_key_prefix(cfg.get("redis_key_prefix") if args.redis_key_prefix
                                      is None else args.redis_key_prefix)
    except ValueError as exc:
        raise SystemExit(f"--redis-key-prefix / redis_key_prefix: {exc}") from exc
    if rl:
        try:
            tenants = {t: Limits.from_dict(v) for t, v in (rl.get("tenants") or {}).items()}
            limiter = RateLimiter(Limits.from_dict(rl.get("default") or {}), tenants,
                                  redis_url=redis_url, prefix=f"{key_prefix}rl")
        except ValueError as exc:  # bad limits or a malformed Redis URL
            raise SystemExit(f"rate_limits / --redis: {exc}") from exc
        if redis_url:
            logger.info("rate limits shared through Redis at %s", masked(redis_url))
    elif redis_url and not (flow.enabled and flow.shared):
        logger.warning("--redis is for shared rate limits, and router.yaml sets none; unused "
                       "(the shared prefix index takes --index)")
    store = None
    if index_url:
        from tandem.router.index_store import RedisIndexStore

        try:
            store = RedisIndexStore(index_url, prefix=f"{key_prefix}kv:")
        except ValueError as exc:  # a malformed URL; an unreachable Redis only falls back
            raise SystemExit(f"--index: {exc}") from exc
        logger.info("prefix index shared through Redis at %s", masked(index_url))
    tls = tls_from_args(args.grpc_tls_dir, args.grpc_tls_server_name)
    worker_key = load_worker_key(args.worker_auth_key_file)
    # a worker acts on a KV peer only under the router's signature
    settings.peer_pull = settings.peer_pull and worker_key is not None
    if args.api_keys and worker_key is None:
        raise SystemExit("--api-keys needs --worker-auth-key-file: workers refuse tenant "
                         "cache salts that the router has not signed")
    try:
        api_keys = ApiKeys.from_file(args.api_keys) if args.api_keys else ApiKeys({})
    except ValueError as exc:
        raise SystemExit(f"--api-keys: {exc}") from exc
    try:
        admin_keys = ApiKeys.from_file(args.admin_api_keys) if args.admin_api_keys else None
    except ValueError as exc:
        raise SystemExit(f"--admin-api-keys: {exc}") from exc
    door = front_door(args, cfg)
    if door.metrics_auth and not args.api_keys:
        raise SystemExit("--metrics-auth needs --api-keys (the keys it checks)")
    from tandem.router.guardrails import Guardrails
    from tandem.router.priority import PriorityPolicy

    priority = PriorityPolicy.from_dict(cfg.get("priority"))  # checked by check_config
    from tandem.router.flowcontrol import make_flow_control

    try:
        flow_control = make_flow_control(flow, router, redis_url=redis_url,
                                         prefix=key_prefix)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc

    server = RouterServerSettings(
        priority=priority,
        preload_tokenizers=tokenizers.preload,
        on_metrics=tokenizers.bind_metrics,
        flow_control=flow_control,
        worker_urls=workers,
        discovery=discovery,
        max_body_bytes=int(cfg.get("max_body_bytes", 8 << 20)),
        max_prompt_tokens=int(cfg.get("max_prompt_tokens", 131072)),
        max_tokens_cap=cfg.get("max_tokens_cap"),
        api_keys=api_keys,
        admin_keys=admin_keys,
        worker_key=worker_key,
        rate_limiter=limiter,
        index_store=store,
        proxy=ProxySettings(retries=args.retries if args.retries is not None
                            else int(cfg.get("retries", 2)), debug_headers=door.debug_headers,
                            max_migrations=_count(args, cfg, "max_migrations", 3,
                                                  "a number of migrations")),
        monitor=MonitorSettings(tls=tls),
        metrics_port=door.metrics_port,
        metrics_auth=door.metrics_auth,
        openapi=door.openapi,
        ext_proc=ext_proc_settings(args, cfg),
        guardrails=Guardrails.from_config(cfg.get("guardrails")))  # checked by check_config
    return build_app(router, server), router, server



def run(args: argparse.Namespace) -> int:
    from tandem.router import processes

    cfg = _load_yaml(args.config)
    n = _count(args, cfg, "processes", 1, "a process count", least=1)
    door = front_door(args, cfg)
    if door.metrics_port is not None and args.http_server != "lean":
        raise SystemExit("--metrics-port needs the lean HTTP server")
    try:
        epp = ext_proc_settings(args, cfg)
    except SystemExit as exc:  # a bad endpoint-picker flag: a usage error
        print(f"tandem router: error: {exc}", file=sys.stderr)
        return 2
    if epp is not None and n > 1:  # a gateway's few long-lived streams would not spread
        print("tandem router: error: --ext-proc-port runs in one router process, not with "
              f"--processes {n} (run router replicas instead)", file=sys.stderr)
        return 2
    busy = [] if processes.is_child() else busy_ports(  # a child's siblings share the port
        args.host, [("--port", args.port), ("--metrics-port", door.metrics_port)])
    if epp is not None and not busy:
        busy = busy_ports(epp.host, [("--ext-proc-port", epp.port)])
    if busy:  # one line, before the tokenizers load, not a bind traceback
        print(busy_message("tandem router", busy), file=sys.stderr)
        return 1
    if n > 1 and not processes.is_child():
        if args.http_server != "lean":
            raise SystemExit("--processes > 1 needs the lean HTTP server (SO_REUSEPORT)")
        return processes.supervise(n, sys.argv[1:],
                                   grace_s=drain_seconds(args, cfg) + CHILD_EXIT_SLACK_S)
    app, router, server = build(args, cfg)
    from tandem.router import gcpolicy

    gcpolicy.settle()  # startup's objects leave the collector's walks
    limiter = server.rate_limiter
    if processes.is_child() and limiter is not None and not limiter.shared:
        logger.warning("rate limits without --redis: each of the %d router processes enforces "
                       "them on its own connections", n)
    logger.info("router (%s) on http://%s:%d, workers by %s discovery, %s HTTP server",
                router.settings.policy, args.host, args.port, server.discovery.name,
                args.http_server)
    drain = drain_seconds(args, cfg)
    if args.http_server == "lean":
        from tandem.protocol import http_server
        from tandem.router.app import metrics_app

        side = metrics_app(app)
        limits = http_server.ServerLimits(graceful_s=drain, send_timeout_s=door.send_timeout_s,
                                          max_connections=door.max_connections)
        http_server.run(app, args.host, args.port, limits, reuse_port=processes.is_child(),
                        side=[(side, door.metrics_port)] if side is not None else None)
    else:  # uvicorn closes its listener at once on SIGTERM (no draining /ready answer), and
        import uvicorn  # has no send timeout; past the limit it answers 503

        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    access_log=False, timeout_graceful_shutdown=drain,
                    limit_concurrency=door.max_connections)
    return 0
