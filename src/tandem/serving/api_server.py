"""The worker's OpenAI-compatible HTTP API (FastAPI on uvicorn).

`build_app(settings, load_engine)` returns the app. The engine loads in a thread at start-up:
`/health` answers at once, `/ready` and the API say 503 until it is up. Routes:
`/v1/completions`, `/v1/chat/completions`, `/v1/responses` (all with SSE streaming; stored
responses: `GET` / `DELETE /v1/responses/{id}`, `responses_api`), `/v1/models`,
`/tokenize`, `/detokenize`, `/health` (process alive), `/ready` (model loaded, engine loop
alive, not draining), `/metrics` (Prometheus). Every log line carries the request id. A POST
body without a JSON Content-Type is a 400 (`web.require_json`).
A completion naming a prefill worker or a tenant salt, or asking for a nonzero priority on
a worker with a key, must carry the router's signature, as must every completion and
(de)tokenize call with `--require-signed-requests` (`worker_auth.check_signature`: 403
otherwise, checked before anything else is done). With API keys (`--api-key`), every route
but `/health`, `/ready` and `/metrics` needs one of them as a bearer token, or the router's
signature (`worker_auth.ApiKeyAuth`). Under load, a status line is logged every
`log_stats_interval_s` (`stats_logger`).

Prompts are tokenized (and chat templates rendered) in a small thread pool, off both the
event loop and the engine thread, which gets token ids; a request's prompts are admitted in
one engine command, so they all join the same step. The routes, and a completion's stages,
are `routes.WorkerApp` methods (`app.state.worker_app`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.kvtransfer.client import RemotePrefillSettings
from tandem.protocol.signing import WorkerKey
from tandem.protocol.tls import TLSFiles
from tandem.protocol.web import BodyLimit, InFlight, install_error_handlers, require_json
from tandem.serving.lora_api import LOAD_PATH, UNLOAD_PATH, install_lora_routes
from tandem.serving.response_store import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S, ResponseStore
from tandem.serving.responses_api import ResponsesAPI
from tandem.serving.routes import DEATH_POLL_S, WorkerApp
from tandem.serving.stats_logger import DEFAULT_INTERVAL_S
from tandem.serving.tool_parsers.options import ChatParsing
from tandem.serving.worker_auth import ApiKeyAuth

__all__ = ["DEATH_POLL_S", "SIGNED_ROUTES", "ServerSettings", "WorkerApp", "build_app"]


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    # --served-model-name's other names: accepted in requests' `model`, listed by
    # /v1/models and /ready (answers and block hashes use `served_model_name`)
    served_model_aliases: tuple[str, ...] = ()
    role: str = "both"  # "both" | "prefill" | "decode"
    max_body_bytes: int = 8 << 20  # larger bodies get 413
    max_n: int = 16  # cap on `n`
    # admission to the last byte handed to the client: a request running longer is
    # aborted (504; a stream ends with an error event, or is cut if the client stalls)
    request_timeout_s: float = 600.0
    # a stream whose client reads nothing for this long is aborted and its connection closed
    stream_send_timeout_s: float = 30.0
    # prompts waiting for (or in) the tokenizer pool; more get 429 + Retry-After
    max_pending_tokenize: int = 256
    retry_after_s: int = 1  # Retry-After on 429
    grpc_host: str = "127.0.0.1"
    grpc_port: int | None = None  # the gRPC Worker service; None = off
    worker_id: str = ""  # reported in gRPC replies; defaults to host:port
    # decode side of P/D: how requests naming a prefill worker (x-tandem-prefill) fetch pages
    kv_transfer: RemotePrefillSettings = field(default_factory=RemotePrefillSettings)
    tls: TLSFiles | None = None  # mutual TLS on the gRPC links (server and client side)
    kv_stream_layers: bool = False  # prefill side: send each layer as soon as it is computed
    tokenizer_threads: int = 4  # the pool that tokenizes prompts and renders chat templates
    # the router's signing key (`--worker-auth-key-file`): P/D targets and tenant salts
    # are acted on only when signed with it (serving/worker_auth.py)
    auth_key: WorkerKey | None = None
    # --require-signed-requests: with `auth_key`, every request that runs the model or the
    # tokenizer on client input must be the router's (signed)
    require_signed: bool = False
    max_kv_event_subscribers: int = 16  # concurrent SubscribeKVEvents streams
    # --api-key: the API needs one of these as a bearer token (or the router's signature);
    # empty: no key needed
    api_keys: tuple[str, ...] = ()
    # the status line's period under load (stats_logger); None: --disable-log-stats
    log_stats_interval_s: float | None = DEFAULT_INTERVAL_S
    # the model's generation_config.json sampling defaults (--generation-config; see
    # `convert.sampling_params`): used where a request leaves a field unset
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser (chat outputs)
    chat_parsing: ChatParsing = field(default_factory=ChatParsing)
    # the Responses API's stored responses (--responses-store-max, --responses-store-ttl):
    # at most this many (0: none stored), each for at most this long
    responses_store_max: int = DEFAULT_MAX_ENTRIES
    responses_store_ttl_s: float = DEFAULT_TTL_S


# the routes that check the router's signature: a signed request may come without an API key
# (a path ending in "/": every path under it)
SIGNED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/responses/",
                 "/tokenize", "/detokenize", LOAD_PATH, UNLOAD_PATH)


def build_app(settings: ServerSettings, load_engine: Callable[[], AsyncLLMEngine],
              on_load_failure: Callable[[BaseException], None] | None = None,
              on_engine_death: Callable[[str], None] | None = None) -> FastAPI:
    """`load_engine` runs in a thread at start-up; its engine is shut down at exit. If it
    raises, `on_load_failure` gets the exception (in the server's loop). Once loaded, an
    engine that stops (its loop crashed, a tensor-parallel rank died) is noticed within
    `DEATH_POLL_S` and `on_engine_death` gets the reason (readiness is down by then). The
    routes are `WorkerApp` methods (`app.state.worker_app`)."""
    wa = WorkerApp(settings, load_engine, on_load_failure, on_engine_death)
    # a POST body must be sent as JSON (400 `NOT_JSON` otherwise), as at the router
    app = FastAPI(title="Tandem worker", version="0.1.0", lifespan=wa.lifespan,
                  dependencies=[Depends(require_json)])
    install_error_handlers(app)
    app.state.in_flight = [0]
    app.state.draining = False
    app.state.holder = wa.holder
    app.state.metrics = wa.metrics
    app.state.worker_app = wa
    wa.app_state = app.state
    app.add_middleware(InFlight, counter=app.state.in_flight)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.api_keys:  # outermost: a caller without a key is refused before anything
        app.add_middleware(ApiKeyAuth, keys=settings.api_keys, signed_paths=SIGNED_ROUTES,
                           accept_signed=settings.auth_key is not None)
    app.get("/health")(wa.health)
    app.get("/ready")(wa.ready)
    app.get("/metrics")(wa.prometheus)
    app.get("/v1/models")(wa.models)
    install_lora_routes(app, settings.served_model_name, wa.holder.get, settings.auth_key,
                        wa.refused, settings.served_model_aliases)
    app.post("/tokenize")(wa.tokenize)
    app.post("/detokenize")(wa.detokenize)
    app.post("/v1/completions")(wa.completions)
    app.post("/v1/chat/completions")(wa.chat)
    responses = ResponsesAPI(wa, ResponseStore(settings.responses_store_max,
                                               settings.responses_store_ttl_s))
    app.state.responses = responses
    app.post("/v1/responses")(responses.create)
    app.get("/v1/responses/{response_id}")(responses.retrieve)
    app.delete("/v1/responses/{response_id}")(responses.delete)
    return app
