"""The router's HTTP front door (FastAPI): OpenAI routes in, the chosen worker behind.

Per request: authenticate (tenant) -> bound and parse the body -> tokenize and hash the
prompt as the worker will -> pick a worker (`core.Router`), and a prefill worker when the
prompt's uncached part is long (`pd.plan`) -> forward (`proxy.forward`, retries before the
first byte). `/v1/models` lists what the ready workers serve; `/health`
is the process, `/ready` means at least one worker is routable (both open: kubelet probes).

`/metrics` (Prometheus; its labels name workers, i.e. pod addresses) is served on the main
port, or with `metrics_port` only on a port of its own (`metrics_app`). It needs a key when
`metrics_auth` is on: by default on the main port whenever API keys are configured, off on
the metrics port (reach it through a NetworkPolicy). The key is an admin key when admin keys
are configured, else any API key. FastAPI's `/docs` and `/redoc` are never served;
`/openapi.json` only with `openapi` (behind the API keys when configured).

Logging: each routed request gets one INFO line (`[id] -> worker (...)`); the workers'
probes (`GET /ready`, `/health`, `/v1/models`, `/metrics`, every `probe_interval_s`) are
logged at DEBUG only (`ProbeLogFilter` on httpx's request log).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from tandem.protocol.signing import WorkerKey
from tandem.protocol.web import (
    APIError,
    BodyLimit,
    FastPaths,
    bad_body,
    cancel_on_disconnect,
    install_error_handlers,
    plain_request_id,
    require_json,
)
from tandem.router import prompt as prompts
from tandem.router import usage
from tandem.router.auth import ApiKeys, tenant_cache_salt
from tandem.router.core import Router
from tandem.router.discovery import Discovery, StaticDiscovery, WorkerEndpoint
from tandem.router.index_store import RedisIndexStore
from tandem.router.lora_admin import check_admin, install_lora_admin
from tandem.router.metrics import RouterMetrics
from tandem.router.monitor import MonitorSettings, WorkerMonitor
from tandem.router.pd import plan
from tandem.router.priority import PriorityPolicy
from tandem.router.proxy import Attempt, ProxySettings, forward, upstream_session
from tandem.router.ratelimit import RateLimiter, retry_after_header
from tandem.router.startup import DEFAULT_WINDOW_S, StartupState
from tandem.router.workers import HashGroup, Worker

logger = logging.getLogger(__name__)
THREAD_TOKENIZE_BYTES = 32 << 10  # bodies above this are tokenized off the event loop


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


def build_app(router: Router, settings: RouterServerSettings) -> FastPaths:
    """The ASGI app: the two OpenAI POST routes on `FastPaths`, the rest on FastAPI.
    ValueError when API keys are configured without a worker key (workers would refuse
    every tenant's salt)."""
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
    monitors: dict[str, WorkerMonitor] = {}
    state: dict = {}
    startup = StartupState(settings.startup_window_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(settings.proxy.read_timeout_s,
                                connect=settings.proxy.connect_timeout_s)
        state["http"] = http = httpx.AsyncClient(limits=limits, timeout=timeout)  # probes
        state["upstream"] = upstream_session(settings.proxy)  # forwarding
        startup.started_at = time.monotonic()
        if settings.preload_tokenizers is not None:  # ~0.4 s each: now, not on a request
            await asyncio.to_thread(settings.preload_tokenizers)
        discovery = settings.discovery or StaticDiscovery(settings.worker_urls)
        watcher = asyncio.create_task(discovery.run(on_discovery))
        await asyncio.sleep(0)  # it starts: a discovery that cannot work fails start-up here
        if watcher.done():
            watcher.result()
        janitor = asyncio.create_task(expire_speculative())
        if settings.index_store is not None:
            settings.index_store.start(
                lambda wid: monitors[wid].index_view() if wid in monitors else None)
        yield
        janitor.cancel()
        for task in (watcher, *syncing):
            task.cancel()
        await asyncio.gather(watcher, *syncing, return_exceptions=True)
        await asyncio.gather(*(m.stop() for m in monitors.values()))
        await http.aclose()
        await state["upstream"].close()
        if settings.rate_limiter is not None:
            await settings.rate_limiter.close()
        if settings.index_store is not None:
            await settings.index_store.close()

    async def expire_speculative() -> None:
        """Free speculative index entries once their TTL is over (matching skips them)."""
        while True:
            await asyncio.sleep(max(router.settings.speculative_ttl_s, 0.5))
            router.index.expire(time.monotonic())

    def add_worker(url: str, role: str = "both", monitored: bool = True) -> None:
        w = Worker(id=url.rstrip("/"), role=role)
        router.add_worker(w)
        if monitored:
            monitors[w.id] = m = WorkerMonitor(w, router.index, state["http"],
                                                settings.monitor, settings.index_store,
                                                settings.worker_key)
            m.start()

    async def remove_worker(worker_id: str) -> None:
        """Out of routing at once, then its monitor stops (its index entries go with both)."""
        router.remove_worker(worker_id)
        m = monitors.pop(worker_id, None)
        if m is not None:
            await m.stop()

    membership = asyncio.Lock()  # discovery's sets apply one at a time, in order
    syncing: set[asyncio.Task] = set()

    def on_discovery(endpoints: dict[str, WorkerEndpoint]) -> None:
        """Discovery's complete set: a worker reported not ready leaves routing at once, the
        rest is reconciled in order by `sync_workers`."""
        for ep in endpoints.values():
            w = router.workers.get(ep.url.rstrip("/"))
            if w is not None and not ep.ready:
                w.ready = False
        task = asyncio.create_task(sync_workers(endpoints))
        syncing.add(task)
        task.add_done_callback(syncing.discard)

    async def sync_workers(endpoints: dict[str, WorkerEndpoint]) -> None:
        """Add new workers (role from discovery, probed only once ready), remove vanished
        ones. While discovery says not ready a worker is kept but not probed (its probe must
        not bring it back); ready again, it rejoins as a fresh worker."""
        want = {ep.url.rstrip("/"): ep for ep in endpoints.values()}
        async with membership:
            startup.observe(router.workers.values())  # models served before, kept
            for wid in [wid for wid in router.workers if wid not in want]:
                await remove_worker(wid)
            for wid, ep in want.items():
                w = router.workers.get(wid)
                if w is not None and ep.ready and wid not in monitors:
                    await remove_worker(wid)
                    w = None
                if w is None:
                    add_worker(wid, ep.role, monitored=ep.ready)
                elif not ep.ready and wid in monitors:
                    await monitors.pop(wid).stop()
                    w.ready = False  # a probe may have answered meanwhile
            startup.synced = True

    app = FastAPI(title="Tandem router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router
    app.state.monitors = monitors
    app.state.metrics = metrics
    app.state.startup = startup
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        now = time.monotonic()
        n = sum(1 for w in router.workers.values() if w.routable(now))
        return JSONResponse({"status": "ready" if n else "no_workers", "ready_workers": n},
                            status_code=200 if n else 503)

    def check_metrics_key(request: Request) -> None:
        """401/403 (OpenAI errors) unless the caller may read /metrics (module doc)."""
        authorization = request.headers.get("authorization")
        if settings.admin_keys is not None and settings.admin_keys.configured:
            check_admin(settings.api_keys, settings.admin_keys, authorization)
        else:
            settings.api_keys.tenant(authorization)

    def metrics_route(target: FastAPI, auth: bool) -> None:
        @target.get("/metrics")
        async def prometheus(request: Request) -> PlainTextResponse:
            if auth:
                check_metrics_key(request)
            return exposition()

    def exposition() -> PlainTextResponse:
        now = time.monotonic()
        for w in router.workers.values():
            metrics.worker_ready.labels(w.id).set(1 if w.routable(now) else 0)
            metrics.worker_indexed_blocks.labels(w.id).set(router.index.num_blocks(w.id))
            metrics.worker_events_connected.labels(w.id).set(1 if w.events_connected else 0)
        metrics.reload_errors.labels("api_keys").set(settings.api_keys.reload_errors)
        if settings.worker_key is not None:
            metrics.reload_errors.labels("worker_auth_key").set(
                settings.worker_key.reload_errors)
        return PlainTextResponse(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    if settings.metrics_port is None:
        metrics_route(app, settings.api_keys.configured if settings.metrics_auth is None
                      else settings.metrics_auth)
    else:
        side = FastAPI(title="Tandem router metrics", docs_url=None, redoc_url=None,
                       openapi_url=None)
        install_error_handlers(side)
        metrics_route(side, bool(settings.metrics_auth))
        app.state.metrics_app = FastPaths(side, {}, settings.max_body_bytes)
    if settings.openapi:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> JSONResponse:
            settings.api_keys.tenant(request.headers.get("authorization"))
            return JSONResponse(app.openapi())

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        settings.api_keys.tenant(request.headers.get("authorization"))
        served = router.models()
        if not served:  # none ready: 503 while workers may be starting, else an empty list
            err = startup.models_unavailable(router.workers.values(), time.monotonic())
            if err is not None:
                raise err
        return {"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "tandem",
             **({"max_model_len": n} if (n := router.max_model_len(m)) else {}),
             **({"parent": base[0]} if (base := router.base_model(m))[1] else {})}
            for m in served]}

    async def handle(kind: str, path: str, request: Request) -> Response:
        rid = request_id(request.headers.get("x-request-id"))
        try:
            tenant = settings.api_keys.tenant(request.headers.get("authorization"))
        except APIError:
            metrics.child(metrics.rejected, "401").inc()
            raise
        t0 = time.perf_counter()
        body = await request.body()
        try:
            require_json(request)  # 400 for a body not sent as JSON, as at the worker
            data = json.loads(body)
            if not isinstance(data, dict):
                raise ValueError("the body must be a JSON object")
            salt = tenant_cache_salt(tenant, data.get("cache_salt"), None if tenant is None
                                     or settings.worker_key is None
                                     else settings.worker_key.signing_key())
            changed = salt is not None or not data.get("model")
            if salt is not None:
                data["cache_salt"] = salt
            changed |= settings.priority.apply(tenant, data)  # 400 outside its range
            check_bounds(data)
            model = data.get("model") or default_model()
            tokenizer = router.tokenizer_for(router.base_model(model)[0])
            if len(body) > THREAD_TOKENIZE_BYTES:  # long prompts: keep the loop responsive
                parsed = await asyncio.to_thread(prompts.parse, kind, data, tokenizer)
            else:
                parsed = prompts.parse(kind, data, tokenizer)
        except (ValueError, ValidationError, RecursionError) as exc:
            metrics.child(metrics.rejected, "400").inc()
            raise bad_body(exc) from exc
        except APIError as exc:  # a bad cache_salt or priority
            metrics.child(metrics.rejected, str(exc.status)).inc()
            raise
        if parsed.token_ids is not None and len(parsed.token_ids) > settings.max_prompt_tokens:
            metrics.child(metrics.rejected, "400").inc()
            raise APIError(400, f"prompt has {len(parsed.token_ids)} tokens; the limit is "
                                f"{settings.max_prompt_tokens}", "prompt")
        unavailable = startup.check(model, router.workers.values(), time.monotonic())
        if unavailable is not None:  # 503 while its workers may be starting, else 404
            metrics.child(metrics.rejected, str(unavailable.status)).inc()
            raise unavailable
        limiter = settings.rate_limiter
        bill: usage.Settlement | None = None
        strip_usage = False
        if limiter is not None:
            prompt_tokens = (len(parsed.token_ids) if parsed.token_ids is not None
                             else len(parsed.text.encode()) + 2)  # an upper bound
            worst, prompt_share = usage.worst_case(kind, data, prompt_tokens,
                                                   router.max_model_len(model))
            verdict = await limiter.acquire(tenant or "anonymous", worst)
            if not verdict.allowed:
                metrics.child(metrics.rejected, "429").inc()
                if verdict.reason == "too_large":
                    raise APIError(429, f"the request may use up to {worst} tokens (prompt + "
                                        "max_tokens, or the context left when max_tokens is "
                                        "unset, times n), more than this tenant's tokens per "
                                        "minute; lower max_tokens or n", "max_tokens")
                raise APIError(429, f"rate limit exceeded ({verdict.reason}); retry later",
                               headers={"Retry-After": retry_after_header(verdict)})
            if verdict.charged:
                bill = usage.Settlement(limiter, tenant or "anonymous", verdict, prompt_share)
                if parsed.stream:  # the worker's usage chunk settles the charge
                    opts = data.get("stream_options")
                    opts = dict(opts) if isinstance(opts, dict) else {}
                    strip_usage = not opts.get("include_usage")
                    data["stream_options"] = {**opts, "include_usage": True}
                    changed = True
        data["model"] = model
        payload = json.dumps(data).encode() if changed else body  # as sent, when unchanged
        hashes, external = await shared_matches(parsed, model)
        first = True
        prefill = None  # a retry may keep the first attempt's prefill worker

        def pick(tried: set[str]):  # noqa: ANN202 - pd.Route | None
            nonlocal first, prefill
            route, ctx = plan(router, parsed, model, time.monotonic(), exclude=tried,
                              keep_prefill=prefill, hashes=hashes, external=external,
                              signed=settings.worker_key is not None)
            if first:
                metrics.routing_seconds.observe(time.perf_counter() - t0)
                first = False
            if route is not None:
                decision = route.decision
                prefill = route.prefill or prefill
                metrics.child(metrics.decisions, router.settings.policy, decision.reason).inc()
                metrics.prompt_tokens.inc(ctx.prompt_tokens)
                metrics.matched_tokens.inc(decision.matched_tokens)
                if logger.isEnabledFor(logging.INFO):  # prefix: the first block's hash
                    chain = ctx.chain(decision.worker) or [b""]
                    logger.info("[%s] -> %s (%s, %d of %d tokens cached, prefix %s)%s", rid,
                                decision.worker.id, decision.reason, decision.matched_tokens,
                                ctx.prompt_tokens, chain[0][:4].hex() or "-",
                                f", prefill on {route.prefill.worker.id}" if route.prefill
                                else "")
            return route

        attempts = 0

        def on_attempt(a: Attempt) -> None:
            nonlocal attempts
            attempts += 1
            if not a.final:  # it never reached the worker: the retry routes without it
                router.retract(a.decision, time.monotonic())
            if attempts > 1:
                metrics.child(metrics.retries, str(a.status or "connect")).inc()
            metrics.child(metrics.requests, a.decision.worker.id,
                          str(a.status or "error")).inc()
            if a.final and a.route.prefill is not None:
                metrics.child(metrics.disaggregated,
                              a.route.worker.kv_transfer_backend or "unknown").inc()
            elif a.final:
                metrics.child(metrics.aggregated, a.route.reason).inc()

        work = forward(state["upstream"], path, payload, rid, pick, parsed.stream,
                       settings.proxy, on_attempt, settings.worker_key)
        if bill is not None:
            return await settled(request, work, bill, parsed.stream, strip_usage)
        if parsed.stream:
            return await work
        completed, response = await cancel_on_disconnect(request, work)
        return response if completed else Response(status_code=499)

    async def settled(request: Request, work: Awaitable[Response], bill: usage.Settlement,
                      stream: bool, strip_usage: bool) -> Response:
        """`work`'s answer, its token charge settled from the usage it reports."""
        try:
            if stream:
                response = await work
            else:
                completed, response = await cancel_on_disconnect(request, work)
                if not completed:
                    bill.keep()  # abandoned: what it used is unknown
                    return Response(status_code=499)
        except asyncio.CancelledError:
            bill.keep()  # the client left: what the worker did is unknown
            raise
        except Exception:
            bill.settle()  # no answer: nothing was generated
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = bill.tap(response.body_iterator, strip_usage)
        elif 200 <= response.status_code < 300:
            bill.settle(*usage.answer_usage(bytes(response.body)))
        else:
            bill.settle()
        return response

    async def shared_matches(parsed: prompts.ParsedPrompt, model: str):  # noqa: ANN202
        """(hash chains per hash group, matches from the shared index store) or (None, None)
        without a store; a store that has no answer in time leaves matching to memory."""
        store = settings.index_store
        if store is None or parsed.token_ids is None:
            return None, None
        hashes = router.hashes(parsed, model)
        lora = router.base_model(model)[1]
        external: dict[HashGroup, dict[str, int]] = {}
        for group, chain in hashes.items():
            ids = [w.id for w in router.workers.values()  # with or without our own stream
                   if w.serves(model) and w.hash_group(lora) == group]
            got = await store.match(chain, ids)
            metrics.child(metrics.index_store_lookups,
                          "ok" if got is not None else "fallback").inc()
            if got is None:
                return hashes, None
            external[group] = got
        return hashes, external

    def default_model() -> str:
        """The one model served; "" when none is (yet: `startup.check` answers)."""
        served = router.models()
        if len(served) <= 1:
            return served[0] if served else ""
        raise ValueError("the request must name a model (this router serves several)")

    def check_bounds(data: dict) -> None:
        cap = settings.max_tokens_cap
        for key in ("max_tokens", "max_completion_tokens"):
            v = data.get(key)
            if cap is not None and isinstance(v, int) and v > cap:
                raise ValueError(f"{key}: at most {cap}")

    install_lora_admin(app, router, settings.api_keys, settings.admin_keys,
                       settings.worker_key, lambda: state["http"])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completions", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle("chat", "/v1/chat/completions", request)

    return FastPaths(app, {"/v1/completions": completions, "/v1/chat/completions": chat},
                     settings.max_body_bytes)


_ID_PREFIX = f"rt-{uuid.uuid4().hex[:8]}-"  # per process, so replicas' ids do not collide
_ID_COUNTER = itertools.count(1)


def request_id(supplied: str | None) -> str:
    """The client's X-Request-Id when it is short and plain (it goes into logs and the
    worker request's headers), else a fresh one."""
    return plain_request_id(supplied) or f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


def metrics_app(app: FastPaths) -> FastPaths | None:
    """The app for the metrics port (only `/metrics`), when `metrics_port` is set."""
    return getattr(app.state, "metrics_app", None)
