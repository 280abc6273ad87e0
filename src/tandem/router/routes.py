"""The router's routes and what they share: one `RouterApp` per app (`app.build_app`).

Routes: `GET /health` (the process), `GET /ready` (200 while a worker is routable, else
503), `GET /v1/models` (what the ready workers serve, less what the caller's guardrail
policy forbids; 503 while they may be starting),
`GET /metrics` (Prometheus, behind a key when `metrics_auth`), `GET /openapi.json` (when
`openapi`), and the three OpenAI POSTs (completions, chat, responses), served stage by
stage by `stages.handle`, and `GET` / `DELETE /v1/responses/{id}` (relayed to the worker
holding it, `responses`). Route methods carry no docstring: FastAPI would publish it in
/openapi.json. With `ext_proc` set, `lifespan` also serves the gateway's endpoint picker
(`extproc`) on the same loop, over this `RouterApp`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.router import responses, stages
from tandem.router.core import Router
from tandem.router.discovery import StaticDiscovery
from tandem.router.flowcontrol.scaling import scaling_signal
from tandem.router.lora_admin import check_admin
from tandem.router.membership import Membership
from tandem.router.metrics import RouterMetrics
from tandem.router.probe import UpstreamProbe
from tandem.router.proxy import upstream_session
from tandem.router.responses import ResponseLocations
from tandem.router.startup import StartupState
from tandem.router.upstream import UpstreamPool
from tandem.router.usage import drain_refunds

if TYPE_CHECKING:
    from tandem.router.app import RouterServerSettings


@dataclass
class RouterApp:
    """What the router's routes share: the routing core, the server settings, the metrics,
    the start-up state and the worker membership; `metrics_auth`: /metrics needs a key
    (resolved from the settings). `http` (LoRA admin and Responses calls) and `upstream`
    (forwarding) exist between the app's start and stop (`lifespan`)."""

    router: Router
    settings: RouterServerSettings
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    metrics_auth: bool = False
    startup: StartupState = field(init=False)
    membership: Membership = field(init=False)
    http: httpx.AsyncClient | None = None
    upstream: UpstreamPool | None = None
    # which worker stored each Responses API response this router relayed
    locations: ResponseLocations = field(default_factory=ResponseLocations)
    epp: Any = None  # the endpoint picker's gRPC server while it runs (`extproc.server`)
    _openapi: dict | None = None  # /openapi.json, made on its first request

    def __post_init__(self) -> None:
        s = self.settings
        self.startup = StartupState(s.startup_window_s)
        self.membership = Membership(self.router, self.startup, s.monitor, self.prober,
                                     s.index_store, s.worker_key,
                                     s.flow_control.kick if s.flow_control else None)

    def client(self) -> httpx.AsyncClient:
        """The httpx client for LoRA admin and Responses calls (the app has started)."""
        assert self.http is not None, "the router app has not started"
        return self.http

    def prober(self) -> UpstreamProbe:
        """The readiness probes' client: GETs over the forwarding pool (the app has
        started)."""
        assert self.upstream is not None, "the router app has not started"
        return UpstreamProbe(self.upstream)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Start: the clients, tokenizers preloaded, discovery watched (one that cannot
        work fails start-up), the speculative-entry janitor, the shared index store, the
        endpoint picker's gRPC server (`ext_proc`). Stop: all of it, in reverse."""
        settings, monitors = self.settings, self.membership.monitors
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(settings.proxy.read_timeout_s,
                                connect=settings.proxy.connect_timeout_s)
        self.http = http = httpx.AsyncClient(limits=limits, timeout=timeout)  # admin calls
        self.upstream = upstream = upstream_session(settings.proxy)  # forwarding
        self.startup.started_at = time.monotonic()
        if settings.preload_tokenizers is not None:  # ~0.4 s each: now, not on a request
            await asyncio.to_thread(settings.preload_tokenizers)
        discovery = settings.discovery or StaticDiscovery(settings.worker_urls)
        watcher = asyncio.create_task(discovery.run(self.membership.on_discovery))
        await asyncio.sleep(0)  # it starts: a discovery that cannot work fails start-up here
        if watcher.done():
            watcher.result()
        janitor = asyncio.create_task(self.expire_speculative())
        if settings.index_store is not None:
            settings.index_store.start(
                lambda wid: monitors[wid].index_view() if wid in monitors else None)
        if settings.ext_proc is not None:  # the gateway's endpoint picker, same loop and core
            from tandem.router.extproc.server import start as start_epp

            self.epp = await start_epp(self, settings.ext_proc)
        yield
        if self.epp is not None:
            await self.epp.stop()
        janitor.cancel()
        await self.membership.stop(watcher)
        await http.aclose()
        await upstream.close()
        if settings.rate_limiter is not None:
            await drain_refunds()
            await settings.rate_limiter.close()
        if settings.index_store is not None:
            await settings.index_store.close()
        if settings.flow_control is not None:
            await settings.flow_control.close()
        if settings.guardrails is not None:
            await settings.guardrails.close()

    async def expire_speculative(self) -> None:
        """Free speculative index entries once their TTL is over (matching skips them)."""
        router = self.router
        while True:
            await asyncio.sleep(max(router.settings.speculative_ttl_s, 0.5))
            router.index.expire(time.monotonic())

    def check_metrics_key(self, request: Request) -> None:
        """401/403 (OpenAI errors) unless the caller may read /metrics: an admin key when
        admin keys are configured, else any API key."""
        settings = self.settings
        authorization = request.headers.get("authorization")
        if settings.admin_keys is not None and settings.admin_keys.configured:
            check_admin(settings.api_keys, settings.admin_keys, authorization)
        else:
            settings.api_keys.tenant(authorization)

    def exposition(self) -> PlainTextResponse:
        """The Prometheus text, with each worker's gauges and the reload errors current."""
        router, metrics, settings = self.router, self.metrics, self.settings
        now = time.monotonic()
        for w in router.workers.values():
            metrics.worker_ready.labels(w.id).set(1 if w.routable(now) else 0)
            metrics.worker_indexed_blocks.labels(w.id).set(router.index.num_blocks(w.id))
            metrics.worker_events_connected.labels(w.id).set(1 if w.events_connected else 0)
            metrics.worker_in_flight.labels(w.id).set(w.local_in_flight)
        if self.upstream is not None:
            active, idle = self.upstream.connections()
            metrics.upstream_connections.labels("active").set(active)
            metrics.upstream_connections.labels("idle").set(idle)
        metrics.reload_errors.labels("api_keys").set(settings.api_keys.reload_errors)
        if settings.worker_key is not None:
            metrics.reload_errors.labels("worker_auth_key").set(
                settings.worker_key.reload_errors)
        return PlainTextResponse(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # -- routes (`app.build_app` registers them) ------------------------------------------
    async def health(self) -> dict:
        return {"status": "ok"}

    async def ready(self) -> JSONResponse:
        now = time.monotonic()
        n = sum(1 for w in self.router.workers.values() if w.routable(now))
        return JSONResponse({"status": "ready" if n else "no_workers", "ready_workers": n},
                            status_code=200 if n else 503)

    async def models(self, request: Request) -> dict:
        router = self.router
        tenant = self.settings.api_keys.tenant(request.headers.get("authorization"))
        ready = router.models()
        # served_models are listed even with no worker (their requests wait: scale from zero)
        served = sorted({*ready, *router.settings.served_models})
        if not served:  # none ready: 503 while workers may be starting, else an empty list
            err = self.startup.models_unavailable(router.workers.values(), time.monotonic())
            if err is not None:
                raise err
        guard = self.settings.guardrails
        if guard is not None:  # only what the tenant's policy lets it ask for
            served = [m for m in served if guard.allows(tenant, m, router.base_model(m))]
        return {"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "tandem",
             **({"max_model_len": n} if (n := router.max_model_len(m)) else {}),
             **({"parent": base[0]} if (base := router.base_model(m))[1] else {})}
            for m in served]}

    async def prometheus(self, request: Request) -> PlainTextResponse:
        if self.metrics_auth:
            self.check_metrics_key(request)
        return self.exposition()

    async def scaling(self, request: Request, model: str | None = None,
                      role: str | None = None) -> dict:
        if self.metrics_auth:
            self.check_metrics_key(request)
        return scaling_signal(self, model, role, set(request.query_params))

    async def openapi(self, request: Request) -> JSONResponse:
        self.settings.api_keys.tenant(request.headers.get("authorization"))
        if self._openapi is None:
            from tandem.router.openapi import with_bodies

            self._openapi = with_bodies(request.app.openapi())
        return JSONResponse(self._openapi)

    async def completions(self, request: Request) -> Response:
        return await stages.handle(self, "completions", "/v1/completions", request)

    async def chat(self, request: Request) -> Response:
        return await stages.handle(self, "chat", "/v1/chat/completions", request)

    async def responses(self, request: Request) -> Response:
        return await stages.handle(self, "responses", "/v1/responses", request)

    async def get_response(self, response_id: str, request: Request) -> Response:
        return await responses.by_id(self, request, response_id, "GET")

    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await responses.by_id(self, request, response_id, "DELETE")
