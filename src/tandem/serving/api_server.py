"""The worker's OpenAI-compatible HTTP API (FastAPI on uvicorn).

`build_app(settings, load_engine)` returns the app. The engine loads in a thread at start-up:
`/health` answers at once, `/ready` and the API say 503 until it is up. Routes:
`/v1/completions`, `/v1/chat/completions` (both with SSE streaming), `/v1/models`,
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
one engine command, so they all join the same step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.engine.async_engine import AddRequest, AsyncLLMEngine, OutputStream
from tandem.engine.llm_engine import EngineStats
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import TokenizedPrompt
from tandem.kvtransfer.client import Imported, RemotePrefill, RemotePrefillSettings
from tandem.kvtransfer.service import KVTransferService
from tandem.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelList,
    TokenizeRequest,
    new_id,
    now,
)
from tandem.protocol.signing import WorkerKey
from tandem.protocol.tls import TLSFiles
from tandem.protocol.web import (
    BodyLimit,
    InFlight,
    cancel_on_disconnect,
    install_error_handlers,
    plain_request_id,
    require_json,
)
from tandem.serving.convert import completion_prompts
from tandem.serving.errors import APIError, from_engine_error
from tandem.serving.grpc_server import WorkerService, start_grpc_server
from tandem.serving.lora_api import (
    LOAD_PATH,
    UNLOAD_PATH,
    install_lora_routes,
    model_cards,
    resolve,
)
from tandem.serving.metrics import ServerMetrics
from tandem.serving.pd import PrefillImports
from tandem.serving.responses import ChatResponder, CompletionResponder, Responder, sse_error
from tandem.serving.sse import SSEResponse
from tandem.serving.stats_logger import DEFAULT_INTERVAL_S, kv_label, log_stats_forever
from tandem.serving.worker_auth import ApiKeyAuth, check_signature

logger = logging.getLogger(__name__)
DEATH_POLL_S = 0.25  # how often a loaded engine is checked for having stopped


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


# the routes that check the router's signature: a signed request may come without an API key
SIGNED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                 LOAD_PATH, UNLOAD_PATH)


class _EngineHolder:
    def __init__(self) -> None:
        self.engine: AsyncLLMEngine | None = None
        self.error: BaseException | None = None
        self.remote: RemotePrefill | None = None  # decode side of P/D, once loaded

    def get(self) -> AsyncLLMEngine:
        if self.engine is None:
            msg = "the model failed to load" if self.error else "the model is loading"
            raise APIError(503, f"{msg}; retry later", headers={"Retry-After": "5"})
        return self.engine

    def snapshot(self) -> EngineStats | None:
        return None if self.engine is None else self.engine.snapshot

    def status(self) -> str:
        """"failed" (the load raised), "loading", "dead" (the engine loop died) or "ready"."""
        if self.error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        return "ready" if self.engine.alive else "dead"


def build_app(settings: ServerSettings, load_engine: Callable[[], AsyncLLMEngine],
              on_load_failure: Callable[[BaseException], None] | None = None,
              on_engine_death: Callable[[str], None] | None = None) -> FastAPI:
    """`load_engine` runs in a thread at start-up; its engine is shut down at exit. If it
    raises, `on_load_failure` gets the exception (in the server's loop). Once loaded, an
    engine that stops (its loop crashed, a tensor-parallel rank died) is noticed within
    `DEATH_POLL_S` and `on_engine_death` gets the reason (readiness is down by then)."""
    holder = _EngineHolder()
    tokenizer_pool = ThreadPoolExecutor(max_workers=max(1, settings.tokenizer_threads),
                                        thread_name_prefix="tandem-tokenize")
    # a slot per job queued or running in the pool, freed when the job ends (not when its
    # caller stops waiting: a cancelled caller's job may still run)
    tokenize_slots = threading.Semaphore(max(1, settings.max_pending_tokenize))
    metrics = ServerMetrics(settings.served_model_name, holder.snapshot)
    pd = PrefillImports(lambda: holder.remote, settings.kv_transfer, metrics,
                        settings.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(asyncio.to_thread(load_engine))

        def loaded(t: asyncio.Future) -> None:
            if t.cancelled():
                return
            if t.exception() is not None:
                holder.error = t.exception()
                logger.error("engine failed to load: %r", holder.error)
                if on_load_failure is not None:
                    on_load_failure(holder.error)
                return
            holder.engine = t.result()
            state = holder.engine.state
            spec = holder.engine.config.speculative_config
            metrics.attach(state.block_size, state.num_kv_blocks,
                           getattr(state, "model_memory_bytes", None),
                           spec.num_speculative_tokens if spec is not None else 0)
            holder.remote = RemotePrefill(
                holder.engine, settings.served_model_name, settings.kv_transfer,
                settings.tls, settings.auth_key)
            logger.info("engine ready: serving %s", settings.served_model_name)
            if on_engine_death is not None:
                watchers.append(asyncio.ensure_future(watch(holder.engine)))
            if settings.log_stats_interval_s is not None:
                engine = holder.engine
                watchers.append(asyncio.ensure_future(log_stats_forever(
                    lambda: engine.snapshot, kv_label(engine.device.type),
                    settings.log_stats_interval_s)))

        async def watch(engine: AsyncLLMEngine) -> None:
            while engine.alive:
                await asyncio.sleep(DEATH_POLL_S)
            why = str(engine.dead or engine.executor_dead() or "the engine stopped")
            logger.error("engine stopped (%s): readiness down, exiting", why)
            on_engine_death(why)

        watchers: list[asyncio.Future] = []
        task.add_done_callback(loaded)
        grpc_server = kv_service = None
        if settings.grpc_port is not None:
            service = WorkerService(lambda: holder.engine, settings.worker_id,
                                    settings.served_model_name, settings.role,
                                    settings.auth_key, settings.max_kv_event_subscribers,
                                    refused)
            kv_service = KVTransferService(lambda: holder.engine, settings.served_model_name,
                                           settings.role, settings.kv_stream_layers,
                                           settings.auth_key, refused)
            grpc_server = await start_grpc_server(
                service, settings.grpc_host, settings.grpc_port, kv_service,
                settings.tls)
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
                await kv_service.close()  # type: ignore[union-attr]
            if holder.remote is not None:
                await holder.remote.close()
            task.cancel()
            for w in watchers:
                w.cancel()
            if holder.engine is not None:
                holder.engine.shutdown()
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # a POST body must be sent as JSON (400 `NOT_JSON` otherwise), as at the router
    app = FastAPI(title="Tandem worker", version="0.1.0", lifespan=lifespan,
                  dependencies=[Depends(require_json)])
    install_error_handlers(app)
    app.state.in_flight = [0]
    app.state.draining = False
    app.state.holder = holder
    app.state.metrics = metrics
    app.add_middleware(InFlight, counter=app.state.in_flight)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.api_keys:  # outermost: a caller without a key is refused before anything
        app.add_middleware(ApiKeyAuth, keys=settings.api_keys, signed_paths=SIGNED_ROUTES,
                           accept_signed=settings.auth_key is not None)
    created = now()

    def check_model(name: str | None) -> None:
        """The base model or a loaded adapter (same tokenizer); 404 otherwise."""
        resolve(name, settings.served_model_name, holder.get(), settings.served_model_aliases)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 200 while loading or serving; 503 once the model failed to load or the
        engine loop died (as vLLM's), so a kubelet restarts the container."""
        status = holder.status()
        if status in ("failed", "dead"):
            return JSONResponse({"status": status}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        engine = holder.engine
        status = "draining" if app.state.draining else holder.status()
        body = {"status": status, "role": settings.role, "model": settings.served_model_name,
                "models": [settings.served_model_name, *settings.served_model_aliases],
                "grpc_port": settings.grpc_port,
                "kv_transfer_backend": settings.kv_transfer.backend}
        if engine is not None:  # what a router needs to hash prompts as this worker does
            body.update(block_size=engine.state.block_size,
                        max_model_len=engine.state.max_model_len,
                        kv_cache_dtype=engine.config.kv_cache_dtype,
                        quantization=engine.config.quantization)
            lora = engine.lora
            if lora is not None:  # the router's LoRA affinity learns residency from here
                state = lora.state  # one consistent version (digests: how to hash prompts)
                body.update(max_loras=lora.num_slots, lora_adapters=state.names(),
                            lora=state.to_json())
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = model_cards(settings.served_model_name, holder.get(), created,
                            settings.served_model_aliases)
        return ModelList(data=cards).model_dump()

    install_lora_routes(app, settings.served_model_name, holder.get, settings.auth_key,
                        lambda reason: refused(reason), settings.served_model_aliases)

    async def off_thread(fn: Callable[[], Any]) -> Any:
        """Run `fn` in the tokenizer pool; engine errors become API errors. With
        `max_pending_tokenize` jobs already queued or running: 429 + Retry-After."""
        if not tokenize_slots.acquire(blocking=False):
            raise APIError(429, "too many prompts are waiting to be tokenized; retry later",
                           headers={"Retry-After": str(settings.retry_after_s)})
        try:
            job = tokenizer_pool.submit(fn)
        except BaseException:
            tokenize_slots.release()
            raise
        job.add_done_callback(lambda _: tokenize_slots.release())
        try:
            return await asyncio.wrap_future(job)
        except ValueError as exc:  # InvalidRequestError, a template's error
            raise from_engine_error(exc) from exc

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, request: Request) -> dict:
        await check_signature(request, settings.auth_key, None, refused,
                              required=settings.require_signed)
        check_model(req.model)
        engine = holder.get().engine
        tok = engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")

        def run() -> list[int]:
            if req.messages is None:
                return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            text = tok.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in req.messages],
                add_generation_prompt=req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=False)

        ids = await off_thread(run)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
        await check_signature(request, settings.auth_key, None, refused,
                              required=settings.require_signed)
        check_model(req.model)
        engine = holder.get().engine
        vocab = engine.state.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        tok = engine.tokenizer  # up to MAX_PROMPT_TOKENS ids: decoded off the event loop
        return {"prompt": await off_thread(lambda: tok.decode(req.tokens,
                                                              skip_special_tokens=False))}

    async def serve(request: Request, engine: AsyncLLMEngine, responder: Responder,
                    prompts: list[TokenizedPrompt]) -> Any:
        if app.state.draining:
            raise APIError(503, "the worker is draining; retry on another replica")
        if not engine.alive:
            raise APIError(503, "the engine is not running")
        rid = responder.request_id
        arrival = time.monotonic()
        # prompt logprobs need every prompt position's logits: imported pages would go unused
        imported = [] if responder.params.prompt_logprobs is not None else await pd.fetch(
            request.headers, engine, rid, [p.token_ids for p in prompts],
            responder.cache_salt or "", responder.lora_name)
        try:
            return await admit_and_run(request, engine, responder, prompts, rid, arrival,
                                       imported)
        except BaseException:
            pd.unpin(imported)
            raise

    async def admit_and_run(request: Request, engine: AsyncLLMEngine, responder: Responder,
                            prompts: list[TokenizedPrompt], rid: str, arrival: float,
                            imported: list[Imported]) -> Any:
        adds = [AddRequest(f"{rid}-{i}", prompt, responder.params, responder.priority,
                           responder.cache_salt, lora_name=responder.lora_name, delta=True)
                for i, prompt in enumerate(prompts)]
        try:
            queues = [q for _, q in await engine.add_many(adds)]
        except Exception as exc:
            raise from_engine_error(exc, settings.retry_after_s) from exc
        via = plain_request_id(request.headers.get("x-request-id"))  # the router's id
        logger.info("[%s] admitted %d prompt(s), stream=%s%s", rid, len(prompts),
                    responder.stream, f", x-request-id {via}" if via else "")
        timing = _Timing()
        stream = _merge(engine, rid, queues, metrics, arrival, timing,
                        on_end=lambda: pd.unpin(imported))
        deadline = arrival + settings.request_timeout_s
        if responder.stream:
            return SSEResponse(responder.sse(stream), deadline=deadline,
                               send_timeout_s=settings.stream_send_timeout_s, request_id=rid,
                               on_timeout=[sse_error(504, "request timed out"),
                                           "data: [DONE]\n\n"])

        async def collect() -> dict:
            async with asyncio.timeout(deadline - time.monotonic()):
                return await responder.collect(stream)

        try:
            completed, body = await cancel_on_disconnect(request, collect())
        except TimeoutError as exc:
            raise APIError(504, f"request timed out after {settings.request_timeout_s}s") \
                from exc
        finally:
            pd.unpin(imported)
        if not completed:
            logger.info("[%s] client disconnected; aborted", rid)
            return JSONResponse({}, status_code=499)
        total_ms = (time.monotonic() - arrival) * 1e3
        return JSONResponse(body, headers={
            "server-timing": f"engine;dur={timing.engine_s * 1e3:.3f}, total;dur={total_ms:.3f}"})

    def refused(reason: str) -> None:
        metrics.auth_rejected.labels(settings.served_model_name, reason).inc()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        await check_signature(request, settings.auth_key, req.cache_salt, refused,
                              req.priority, settings.require_signed)
        engine = holder.get()
        lora = resolve(req.model, settings.served_model_name, engine,
                       settings.served_model_aliases)
        try:
            responder = CompletionResponder(req, engine.tokenizer, settings,
                                            new_id("cmpl"), lora)
            prompts = completion_prompts(req)
        except ValueError as exc:
            raise from_engine_error(exc) from exc
        tokenized = await off_thread(lambda: [engine.process_prompt(p) for p in prompts])
        return await serve(request, engine, responder, tokenized)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        await check_signature(request, settings.auth_key, req.cache_salt, refused,
                              req.priority, settings.require_signed)
        engine = holder.get()
        lora = resolve(req.model, settings.served_model_name, engine,
                       settings.served_model_aliases)
        tok = engine.tokenizer
        try:
            responder = ChatResponder(req, tok, settings, new_id("chatcmpl"), lora)
        except ValueError as exc:
            raise from_engine_error(exc) from exc
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]

        def render() -> TokenizedPrompt:
            text = tok.apply_chat_template(messages,
                                           add_generation_prompt=req.add_generation_prompt)
            return engine.process_prompt(tok.encode(text, add_special_tokens=False))

        return await serve(request, engine, responder, [await off_thread(render)])

    return app


@dataclass
class _Timing:
    """For the `Server-Timing` header: the longest engine time (from the engine taking a
    sub-request to its last output) over a request's prompts, in seconds."""

    engine_s: float = 0.0


async def _merge(engine: AsyncLLMEngine, rid: str, queues: list[OutputStream],
                 metrics: ServerMetrics, arrival: float, timing: _Timing,
                 on_end: Callable[[], None] = lambda: None
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from every sub-request until all finish; abort what is
    left if the consumer stops early (disconnect, timeout). `on_end` runs at the first
    output (the requests hold their own block references by then) or at the end."""
    tokens = _TokenClock(metrics, arrival)
    unfinished = set(range(len(queues)))
    ended = False
    try:
        if len(queues) == 1:  # the common case: no futures, one await per engine step
            while unfinished:
                out: RequestOutput = await queues[0].get()
                if not ended:
                    ended = True
                    on_end()
                if tokens.record(out, timing):
                    unfinished.clear()
                yield 0, out
        else:
            pending = {i: asyncio.ensure_future(q.get()) for i, q in enumerate(queues)}
            try:
                while pending:
                    done, _ = await asyncio.wait(pending.values(),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    for i in [i for i, f in pending.items() if f in done]:
                        out = pending.pop(i).result()
                        if tokens.record(out, timing):
                            unfinished.discard(i)
                        else:
                            pending[i] = asyncio.ensure_future(queues[i].get())
                        yield i, out
            finally:
                for f in pending.values():
                    f.cancel()
        metrics.e2e.observe(time.monotonic() - arrival)
    finally:
        on_end()
        for i in unfinished:
            engine.abort(f"{rid}-{i}")


@dataclass
class _TokenClock:
    """TTFT / queue-time / inter-token-latency observations of one HTTP request."""

    metrics: ServerMetrics
    arrival: float
    first_token: float | None = None
    last_token: float | None = None

    def record(self, out: RequestOutput, timing: _Timing) -> bool:
        """Observe one output; True when it is its sub-request's last."""
        t = time.monotonic()
        if any(c.token_ids for c in out.outputs):
            if self.first_token is None:
                self.first_token = t
                self.metrics.ttft.observe(t - self.arrival)
                if out.queue_time is not None:
                    self.metrics.queue.observe(out.queue_time)
            elif self.last_token is not None:
                self.metrics.itl.observe(t - self.last_token)
            self.last_token = t
        timing.engine_s = max(timing.engine_s, out.engine_time)
        if out.finished:
            for c in out.outputs:
                self.metrics.finished(c.finish_reason or "abort")
        return out.finished

