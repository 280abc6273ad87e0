"""The router's HTTP front door (FastAPI): OpenAI routes in, the chosen worker behind.

Per request (`stages`): authenticate (tenant) -> bound and parse the body -> tokenize and
hash the prompt as the worker will -> pick a worker (`core.Router`), and a prefill worker
when the prompt's uncached part is long (`pd.plan`) -> forward (`proxy.forward`, retries
before the first byte). The routes are `routes.RouterApp` methods; the workers come and go
through `membership.Membership`. `/v1/models` lists what the ready workers serve; `/health`
is the process, `/ready` means at least one worker is routable (both open: kubelet probes).

`/metrics` (Prometheus; its labels name workers, i.e. pod addresses) is served on the main
port, or with `metrics_port` only on a port of its own (`metrics_app`). It needs a key when
`metrics_auth` is on: by default on the main port whenever API keys are configured, off on
the metrics port (reach it through a NetworkPolicy). The key is an admin key when admin keys
are configured, else any API key. FastAPI's `/docs` and `/redoc` are never served;
`/openapi.json` only with `openapi` (behind the API keys when configured).
`GET /scaling` (the demand an autoscaler reads, `flowcontrol.scaling`) is served where
/metrics is, behind the same key.

Logging: each routed request gets one INFO line (`[id] -> worker (...)`); the workers'
probes (`GET /ready`, `/health`, `/v1/models`, every `probe_interval_s`, over the router's
own upstream pool) are logged at DEBUG only (`tandem.router.probe`), and so are the GETs of
those paths the router still makes through httpx (`ProbeLogFilter` on httpx's request log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI

from tandem.protocol.signing import WorkerKey
from tandem.protocol.web import BodyLimit, FastPaths, install_error_handlers
from tandem.router.auth import ApiKeys
from tandem.router.core import Router
from tandem.router.discovery import Discovery
from tandem.router.extproc.settings import ExtProcSettings
from tandem.router.flowcontrol.base import FlowControl
from tandem.router.guardrails import Guardrails
from tandem.router.index_store import RedisIndexStore
from tandem.router.lora_admin import install_lora_admin
from tandem.router.metrics import RouterMetrics
from tandem.router.monitor import MonitorSettings
from tandem.router.priority import PriorityPolicy
from tandem.router.proxy import ProxySettings
from tandem.router.ratelimit import RateLimiter
from tandem.router.routes import RouterApp
from tandem.router.stages import THREAD_TOKENIZE_BYTES, request_id
from tandem.router.startup import DEFAULT_WINDOW_S

logger = logging.getLogger(__name__)
__all__ = ["THREAD_TOKENIZE_BYTES", "ProbeLogFilter", "RouterApp", "RouterServerSettings",
           "build_app", "metrics_app", "quiet_probe_logs", "request_id"]


class ProbeLogFilter(logging.Filter):
    """On the `httpx` logger: its INFO line for a probe (`GET` of one of `PROBE_PATHS`)
    becomes a DEBUG record, dropped unless `httpx` logs at DEBUG; other requests keep
    their INFO line."""

    PROBE_PATHS = frozenset({"/ready", "/health", "/v1/models", "/metrics"})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (record.levelno != logging.INFO or not isinstance(args, tuple) or len(args) < 2
                or args[0] != "GET" or getattr(args[1], "path", None) not in self.PROBE_PATHS):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_probe_logs() -> None:
    """Install `ProbeLogFilter` on the `httpx` logger (once)."""
    log = logging.getLogger("httpx")
    if not any(isinstance(f, ProbeLogFilter) for f in log.filters):
        log.addFilter(ProbeLogFilter())


@dataclass
class RouterServerSettings:
    worker_urls: list[str] = field(default_factory=list)
    discovery: Discovery | None = None  # where workers come from; None: `worker_urls`
    max_body_bytes: int = 8 << 20
    max_prompt_tokens: int = 131072  # longer prompts get 400 before any worker sees them
    max_tokens_cap: int | None = None  # bound on max_tokens / max_completion_tokens
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys({}))
    rate_limiter: RateLimiter | None = None
    index_store: RedisIndexStore | None = None  # shared prefix index (`--index redis://`)
    # the queue in front of saturated workers (`flowcontrol`); None: flow control is off,
    # every request is routed at once
    flow_control: FlowControl | None = None
    preload_tokenizers: Callable[[], None] | None = None  # run once at start-up
    on_metrics: Callable[[RouterMetrics], None] | None = None  # given the metrics at build
    proxy: ProxySettings = field(default_factory=ProxySettings)
    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    # unknown models get 503 "starting", not 404, this long while workers have not reported
    # their models (`startup.StartupState`)
    startup_window_s: float = DEFAULT_WINDOW_S
    # signs every forwarded request (`--worker-auth-key-file`); None: requests go unsigned,
    # so no P/D (aggregated, reason "unsigned") and no tenants (api_keys refused)
    worker_key: WorkerKey | None = None
    # each tenant's priority range (router.yaml `priority`; none: 0 only)
    priority: PriorityPolicy = field(default_factory=PriorityPolicy)
    # keys that may load and unload LoRA adapters when `api_keys` is on (`lora_admin`)
    admin_keys: ApiKeys | None = None
    metrics_port: int | None = None  # /metrics there (`metrics_app`), not on the main port
    metrics_auth: bool | None = None  # None: on the main port iff API keys are configured
    openapi: bool = False  # serve /openapi.json (behind the API keys when configured)
    # the gateway's endpoint picker (ext_proc gRPC, `extproc`) beside the HTTP front door;
    # None: not served (`--ext-proc-port`)
    ext_proc: ExtProcSettings | None = None
    # input, output and policy layers on every request, both front doors (router.yaml
    # `guardrails`); None: none configured
    guardrails: Guardrails | None = None


def build_app(router: Router, settings: RouterServerSettings) -> FastPaths:
    """The ASGI app: the three OpenAI POST routes on `FastPaths`, the rest on FastAPI, all of
    them `RouterApp` methods (`app.state.router_app`). ValueError when API keys are
    configured without a worker key (workers would refuse every tenant's salt)."""
    if settings.api_keys.configured and settings.worker_key is None:
        raise ValueError("API keys (tenants) need a worker auth key: workers refuse tenant "
                         "cache salts that the router has not signed")
    if settings.metrics_auth and not settings.api_keys.configured:
        raise ValueError("metrics auth needs API keys (--api-keys) to check against")
    if settings.worker_key is None:
        logger.warning("no worker auth key: requests to workers go unsigned, so every "
                       "request is served aggregated (reason \"unsigned\"), never P/D")
    quiet_probe_logs()  # the monitor's probes: DEBUG, not a line each at INFO
    metrics = RouterMetrics()
    if settings.on_metrics is not None:
        settings.on_metrics(metrics)
    if settings.flow_control is not None:
        settings.flow_control.bind_metrics(metrics)
    if settings.guardrails is not None:
        settings.guardrails.bind_metrics(metrics)
    if settings.metrics_port is None:
        auth = (settings.api_keys.configured if settings.metrics_auth is None
                else settings.metrics_auth)
    else:
        auth = bool(settings.metrics_auth)
    ra = RouterApp(router, settings, metrics, auth)
    app = FastAPI(title="Tandem router", lifespan=ra.lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router_app = ra
    app.state.router = router
    app.state.monitors = ra.membership.monitors
    app.state.metrics = metrics
    app.state.startup = ra.startup
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.get("/health")(ra.health)
    app.get("/ready")(ra.ready)
    if settings.metrics_port is None:
        app.get("/metrics")(ra.prometheus)
        app.get("/scaling")(ra.scaling)
    else:
        side = FastAPI(title="Tandem router metrics", docs_url=None, redoc_url=None,
                       openapi_url=None)
        install_error_handlers(side)
        side.get("/metrics")(ra.prometheus)
        side.get("/scaling")(ra.scaling)
        app.state.metrics_app = FastPaths(side, {}, settings.max_body_bytes)
    if settings.openapi:
        app.get("/openapi.json", include_in_schema=False)(ra.openapi)
    app.get("/v1/models")(ra.models)
    install_lora_admin(app, router, settings.api_keys, settings.admin_keys,
                       settings.worker_key, ra.client)
    app.post("/v1/completions")(ra.completions)
    app.post("/v1/chat/completions")(ra.chat)
    app.post("/v1/responses")(ra.responses)
    app.get("/v1/responses/{response_id}")(ra.get_response)
    app.delete("/v1/responses/{response_id}")(ra.delete_response)
    return FastPaths(app, {"/v1/completions": ra.completions,
                           "/v1/chat/completions": ra.chat, "/v1/responses": ra.responses},
                     settings.max_body_bytes)


def metrics_app(app: FastPaths) -> FastPaths | None:
    """The app for the metrics port (only `/metrics`), when `metrics_port` is set."""
    return getattr(app.state, "metrics_app", None)
