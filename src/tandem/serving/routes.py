"""The worker's routes and what they share: one `WorkerApp` per app (`api_server.build_app`).

Routes: `GET /health`, `/ready`, `/metrics`, `/v1/models`, `POST /tokenize`, `/detokenize`,
`/v1/completions` and `/v1/chat/completions` (LoRA's load / unload come from `lora_api`).
A completion runs in named stages: `authenticate` (the router's signature; 403) ->
`engine_for` (the engine, and the adapter the `model` names; 503 / 404; the body was bound
by `BodyLimit` and parsed by FastAPI before the route) -> the responder, which converts the
request to `SamplingParams` (`completion_responder` / `chat_responder`; 400) -> `off_thread`
(tokenize or render the chat template in the tokenizer pool; 429 when it is full) ->
`serve` (draining / dead engine: 503; a structured-output grammar compiled in the tokenizer
pool, 400 when it cannot be; pages of a prefill worker imported) -> `submit` (one
engine command for all prompts) -> `respond` (an SSE stream, or one JSON body; 504 on
timeout, 499 on a disconnect). Route methods carry no docstring (FastAPI would publish it
in /openapi.json), but for `/health`, whose docstring the document has always carried.
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
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.engine.async_engine import AddRequest, AsyncLLMEngine, OutputStream
from tandem.engine.errors import InvalidRequestError
from tandem.engine.llm_engine import EngineStats
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import TokenizedPrompt
from tandem.kvtransfer.client import Imported, RemotePrefill
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
from tandem.protocol.web import cancel_on_disconnect, plain_request_id
from tandem.serving import convert, migration
from tandem.serving.convert import completion_prompts
from tandem.serving.drain import Drain, WorkerDraining, draining_error
from tandem.serving.errors import APIError, from_engine_error
from tandem.serving.grpc_server import WorkerService, kv_block_bytes, start_grpc_server
from tandem.serving.lora_api import model_cards, resolve
from tandem.serving.metrics import ServerMetrics
from tandem.serving.pd import PrefillImports
from tandem.serving.responses import ChatResponder, CompletionResponder, Responder, sse_error
from tandem.serving.sse import SSEResponse
from tandem.serving.stats_logger import kv_label, log_stats_forever
from tandem.serving.worker_auth import check_signature

if TYPE_CHECKING:
    from tandem.serving.api_server import ServerSettings

logger = logging.getLogger("tandem.serving.api_server")  # the worker's lines keep their logger
DEATH_POLL_S = 0.25  # how often a loaded engine is checked for having stopped


class EngineHolder:
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


@dataclass
class WorkerApp:
    """What the worker's routes share: the settings, the engine (`holder`, loaded in a
    thread by `lifespan`), the metrics, the tokenizer pool and its slots, the P/D imports
    and the app's state (`draining`, set by the worker on SIGTERM)."""

    settings: ServerSettings
    load_engine: Callable[[], AsyncLLMEngine]
    on_load_failure: Callable[[BaseException], None] | None = None
    on_engine_death: Callable[[str], None] | None = None
    holder: EngineHolder = field(default_factory=EngineHolder)
    metrics: ServerMetrics = field(init=False)
    tokenizer_pool: ThreadPoolExecutor = field(init=False)
    # a slot per job queued or running in the pool, freed when the job ends (not when its
    # caller stops waiting: a cancelled caller's job may still run)
    tokenize_slots: threading.Semaphore = field(init=False)
    pd: PrefillImports = field(init=False)
    drain: Drain = field(default_factory=Drain)  # the requests in flight, the SIGTERM stop
    kv_service: KVTransferService | None = None  # the gRPC KVTransfer service, once started
    # bytes of one KV block of every layer as pages travel (`kv_block_bytes`), once loaded
    block_bytes: int = 0
    created: int = field(default_factory=now)
    app_state: Any = None  # the FastAPI app's `state` (`build_app` sets it)

    def __post_init__(self) -> None:
        s, holder = self.settings, self.holder
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=max(1, s.tokenizer_threads),
                                                 thread_name_prefix="tandem-tokenize")
        self.tokenize_slots = threading.Semaphore(max(1, s.max_pending_tokenize))
        self.metrics = ServerMetrics(s.served_model_name, holder.snapshot)
        self.pd = PrefillImports(lambda: holder.remote, s.kv_transfer, self.metrics,
                                 s.served_model_name)

    @property
    def draining(self) -> bool:
        return bool(self.app_state is not None and self.app_state.draining)

    # -- start and stop ------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """`load_engine` runs in a thread; the gRPC services start (when configured); at
        exit everything stops and the engine is shut down."""
        settings, holder = self.settings, self.holder
        task = asyncio.ensure_future(asyncio.to_thread(self.load_engine))
        watchers: list[asyncio.Future] = []
        task.add_done_callback(lambda t: self.loaded(t, watchers))
        grpc_server = kv_service = None
        if settings.grpc_port is not None:
            service = WorkerService(lambda: holder.engine, settings.worker_id,
                                    settings.served_model_name, settings.role,
                                    settings.auth_key, settings.max_kv_event_subscribers,
                                    self.refused, draining=lambda: self.draining)
            service.peer_pull_s_per_block = lambda: self.pd.peer.costs.s_per_block
            service.kv_block_bytes = lambda: self.block_bytes
            kv_service = KVTransferService(lambda: holder.engine, settings.served_model_name,
                                           settings.role, settings.kv_stream_layers,
                                           settings.auth_key, self.refused,
                                           draining=lambda: self.draining)
            self.kv_service = kv_service
            self.metrics.kv_sending = lambda: kv_service.calls  # type: ignore[union-attr]
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
            self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def loaded(self, t: asyncio.Future, watchers: list[asyncio.Future]) -> None:
        """The load finished: record the engine (or the error) and start its watchers."""
        settings, holder, metrics = self.settings, self.holder, self.metrics
        if t.cancelled():
            return
        if t.exception() is not None:
            holder.error = t.exception()
            logger.error("engine failed to load: %r", holder.error)
            if self.on_load_failure is not None:
                self.on_load_failure(holder.error)
            return
        holder.engine = t.result()
        metrics.open_streams = lambda engine=holder.engine: engine.open_streams
        self.block_bytes = kv_block_bytes(holder.engine, settings.served_model_name)
        state = holder.engine.state
        spec = holder.engine.config.speculative_config
        metrics.attach(state.block_size, state.num_usable_blocks,
                       getattr(state, "model_memory_bytes", None),
                       spec.num_speculative_tokens if spec is not None else 0)
        holder.remote = RemotePrefill(
            holder.engine, settings.served_model_name, settings.kv_transfer,
            settings.tls, settings.auth_key)
        logger.info("engine ready: serving %s", settings.served_model_name)
        if self.on_engine_death is not None:
            watchers.append(asyncio.ensure_future(self.watch(holder.engine)))
        if settings.log_stats_interval_s is not None:
            engine = holder.engine
            watchers.append(asyncio.ensure_future(log_stats_forever(
                lambda: engine.snapshot, kv_label(engine.device.type),
                settings.log_stats_interval_s)))

    async def watch(self, engine: AsyncLLMEngine) -> None:
        """Poll a loaded engine; once it stops, `on_engine_death` gets the reason."""
        while engine.alive:
            await asyncio.sleep(DEATH_POLL_S)
        why = str(engine.dead or engine.executor_dead() or "the engine stopped")
        logger.error("engine stopped (%s): readiness down, exiting", why)
        assert self.on_engine_death is not None
        self.on_engine_death(why)

    def refused(self, reason: str) -> None:
        """Count a request refused by the signature or key checks."""
        self.metrics.auth_rejected.labels(self.settings.served_model_name, reason).inc()

    # -- stages ----------------------------------------------------------------------------
    async def authenticate(self, request: Request, cache_salt: str | None = None,
                           priority: int = 0) -> None:
        """The router's signature, where the request needs it (403 otherwise)."""
        await check_signature(request, self.settings.auth_key, cache_salt, self.refused,
                              priority, self.settings.require_signed)

    def engine_for(self, model: str | None) -> tuple[AsyncLLMEngine, Any]:
        """The engine (503 until loaded) and the adapter `model` names (None: the base
        model; 404 for a model not served)."""
        s = self.settings
        engine = self.holder.get()
        return engine, resolve(model, s.served_model_name, engine, s.served_model_aliases)

    def completion_responder(self, req: CompletionRequest, engine: AsyncLLMEngine,
                             lora: Any) -> tuple[CompletionResponder, list]:
        """The responder (its `SamplingParams`) and the prompts, unencoded; 400."""
        try:
            _check_backend(req, engine)
            return (CompletionResponder(req, engine.tokenizer, self.settings, new_id("cmpl"),
                                        lora), completion_prompts(req))
        except ValueError as exc:
            raise from_engine_error(exc) from exc

    def chat_responder(self, req: ChatCompletionRequest, engine: AsyncLLMEngine,
                       lora: Any) -> ChatResponder:
        """The responder (its `SamplingParams`); 400."""
        try:
            _check_backend(req, engine)
            return ChatResponder(req, engine.tokenizer, self.settings, new_id("chatcmpl"),
                                 lora)
        except ValueError as exc:
            raise from_engine_error(exc) from exc

    async def off_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the tokenizer pool; engine errors become API errors. With
        `max_pending_tokenize` jobs already queued or running: 429 + Retry-After."""
        slots = self.tokenize_slots
        if not slots.acquire(blocking=False):
            raise APIError(429, "too many prompts are waiting to be tokenized; retry later",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        try:
            job = self.tokenizer_pool.submit(fn)
        except BaseException:
            slots.release()
            raise
        job.add_done_callback(lambda _: slots.release())
        try:
            return await asyncio.wrap_future(job)
        except ValueError as exc:  # InvalidRequestError, a template's error
            raise from_engine_error(exc) from exc

    async def serve(self, request: Request, engine: AsyncLLMEngine, responder: Responder,
                    prompts: list[TokenizedPrompt]) -> Any:
        """503 while draining or with the engine stopped; import a prefill worker's pages
        (P/D), then `submit` and `respond` (the imports unpinned however it ends)."""
        if self.draining:
            raise draining_error(self.settings.retry_after_s)
        if not engine.alive:
            raise APIError(503, "the engine is not running")
        responder.prepare(prompts)  # what depends on the prompts' tokens (reasoning)
        if responder.params.structured_outputs is not None:
            await self.off_thread(lambda: _compile(engine, responder))
        rid = responder.request_id
        arrival = time.monotonic()
        # prompt logprobs need every prompt position's logits: imported pages would go unused
        imported = [] if responder.params.prompt_logprobs is not None else await self.pd.fetch(
            request.headers, engine, rid, [p.token_ids for p in prompts],
            responder.cache_salt or "", responder.lora_name)
        try:
            if self.draining:  # it stopped while the pages came: this one is not started
                raise draining_error(self.settings.retry_after_s)
            queues = await self.submit(request, engine, responder, prompts)
            return await self.respond(request, engine, responder, queues, arrival, imported)
        except BaseException:
            self.pd.unpin(imported)
            raise

    async def submit(self, request: Request, engine: AsyncLLMEngine, responder: Responder,
                     prompts: list[TokenizedPrompt]) -> list[OutputStream]:
        """Admit every prompt in one engine command (`{rid}-{i}`); their output queues."""
        rid = responder.request_id
        adds = [AddRequest(f"{rid}-{i}", prompt, responder.params, responder.priority,
                           responder.cache_salt, lora_name=responder.lora_name, delta=True,
                           resume=responder.resume)
                for i, prompt in enumerate(prompts)]
        try:
            queues = [q for _, q in await engine.add_many(adds)]
        except Exception as exc:
            raise from_engine_error(exc, self.settings.retry_after_s) from exc
        via = plain_request_id(request.headers.get("x-request-id"))  # the router's id
        logger.info("[%s] admitted %d prompt(s), stream=%s%s", rid, len(prompts),
                    responder.stream, f", x-request-id {via}" if via else "")
        return queues

    async def respond(self, request: Request, engine: AsyncLLMEngine, responder: Responder,
                      queues: list[OutputStream], arrival: float,
                      imported: list[Imported]) -> Any:
        """An SSE stream, or the JSON body once every output is in (504 past the request
        timeout, 499 when the client went away), with a `server-timing` header."""
        settings, pd = self.settings, self.pd
        rid = responder.request_id
        timing = Timing()
        stream = merge(engine, rid, queues, self.metrics, arrival, timing,
                       on_end=lambda: pd.unpin(imported), drain=self.drain)
        deadline = arrival + settings.request_timeout_s
        if responder.stream:
            return SSEResponse(self.drain.guard(responder.sse(stream)), deadline=deadline,
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
        except WorkerDraining as exc:  # the drain cut it: the router retries it elsewhere
            raise draining_error(settings.retry_after_s, str(exc)) from exc
        finally:
            pd.unpin(imported)
        if not completed:
            logger.info("[%s] client disconnected; aborted", rid)
            return JSONResponse({}, status_code=499)
        total_ms = (time.monotonic() - arrival) * 1e3
        return JSONResponse(body, headers={
            "server-timing": f"engine;dur={timing.engine_s * 1e3:.3f}, total;dur={total_ms:.3f}"})

    # -- routes (`api_server.build_app` registers them) -----------------------------------
    async def health(self) -> JSONResponse:
        """Liveness: 200 while loading or serving; 503 once the model failed to load or the
        engine loop died (as vLLM's), so a kubelet restarts the container."""
        status = self.holder.status()
        if status in ("failed", "dead"):
            return JSONResponse({"status": status}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(self) -> JSONResponse:
        settings, holder = self.settings, self.holder
        engine = holder.engine
        status = "draining" if self.draining else holder.status()
        body = {"status": status, "role": settings.role, "model": settings.served_model_name,
                "models": [settings.served_model_name, *settings.served_model_aliases],
                "grpc_port": settings.grpc_port,
                "kv_transfer_backend": settings.kv_transfer.backend}
        if engine is not None:  # what a router needs to hash prompts as this worker does
            body.update(block_size=engine.state.block_size,
                        max_model_len=engine.state.max_model_len,
                        kv_cache_dtype=engine.config.kv_cache_dtype,
                        quantization=engine.config.quantization,
                        peer_pull_s_per_block=self.pd.peer.costs.s_per_block,
                        kv_block_bytes=self.block_bytes,
                        # how its scheduler shares steps (the router's P/D cost estimate)
                        long_prefill_token_threshold=engine.config.long_prefill_token_threshold,
                        max_num_batched_tokens=engine.config.max_num_batched_tokens)
            snap = engine.snapshot
            if snap.kv_tiers:  # measured KV tier load costs (as GetLoad's)
                body.update(host_load_s_per_block=snap.host_load_s_per_block,
                            disk_load_s_per_block=snap.disk_load_s_per_block)
            lora = engine.lora
            if lora is not None:  # the router's LoRA affinity learns residency from here
                state = lora.state  # one consistent version (digests: how to hash prompts)
                body.update(max_loras=lora.num_slots, lora_adapters=state.names(),
                            lora=state.to_json())
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    async def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(generate_latest(self.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        s = self.settings
        cards = model_cards(s.served_model_name, self.holder.get(), self.created,
                            s.served_model_aliases)
        return ModelList(data=cards).model_dump()

    async def tokenize(self, req: TokenizeRequest, request: Request) -> dict:
        await self.authenticate(request)
        engine, _ = self.engine_for(req.model)
        tok = engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")

        def run() -> list[int]:
            if req.messages is None:
                return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            text = tok.apply_chat_template(
                [m.template_dict() for m in req.messages],
                add_generation_prompt=req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=False)

        ids = await self.off_thread(run)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.state.max_model_len}

    async def detokenize(self, req: DetokenizeRequest, request: Request) -> dict:
        await self.authenticate(request)
        engine, _ = self.engine_for(req.model)
        vocab = engine.state.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        tok = engine.tokenizer  # up to MAX_PROMPT_TOKENS ids: decoded off the event loop
        return {"prompt": await self.off_thread(lambda: tok.decode(req.tokens,
                                                                   skip_special_tokens=False))}

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        await self.authenticate(request, req.cache_salt, req.priority)
        engine, lora = self.engine_for(req.model)
        responder, prompts = self.completion_responder(req, engine, lora)
        migration.apply(request, responder, len(prompts))
        tokenized = await self.off_thread(lambda: [engine.process_prompt(p) for p in prompts])
        return await self.serve(request, engine, responder, tokenized)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Any:
        await self.authenticate(request, req.cache_salt, req.priority)
        engine, lora = self.engine_for(req.model)
        responder = self.chat_responder(req, engine, lora)
        migration.apply(request, responder)
        return await self.serve(request, engine, responder,
                                [await self.off_thread(self.chat_prompt(req, engine))])

    def chat_prompt(self, req: ChatCompletionRequest,
                    engine: AsyncLLMEngine) -> Callable[[], TokenizedPrompt]:
        """The job (for `off_thread`) that renders `req`'s messages with the chat template
        and tokenizes them; the Responses API (`responses_api`) renders through it too."""
        tok = engine.tokenizer
        messages, extra = req.template_messages(), req.template_kwargs()

        def render() -> TokenizedPrompt:
            text = tok.apply_chat_template(messages,
                                           add_generation_prompt=req.add_generation_prompt,
                                           **extra)
            return engine.process_prompt(tok.encode(text, add_special_tokens=False))

        return render


def _check_backend(req: CompletionRequest | ChatCompletionRequest,
                   engine: AsyncLLMEngine) -> None:
    """`guided_decoding_backend` names the server's grammar backend (or "auto"); 400."""
    if req.guided_decoding_backend is not None:
        convert.check_backend(req, engine.config.structured_outputs_backend)


def _compile(engine: AsyncLLMEngine, responder: Responder) -> None:
    """Compile the request's grammar before admission (in the tokenizer pool; the engine's
    own compile is then a cache hit): one the grammar library cannot compile is a 400
    naming the field that gave it, never a failed request."""
    try:
        engine.check_structured_outputs(responder.params)
    except InvalidRequestError as exc:
        req = responder.req
        param = exc.param
        if isinstance(req, CompletionRequest | ChatCompletionRequest):
            param = convert.structured_outputs(req)[1] or param
        raise InvalidRequestError(f"{param}: {exc}", param) from None


@dataclass
class Timing:
    """For the `Server-Timing` header: the longest engine time (from the engine taking a
    sub-request to its last output) over a request's prompts, in seconds."""

    engine_s: float = 0.0


async def merge(engine: AsyncLLMEngine, rid: str, queues: list[OutputStream],
                 metrics: ServerMetrics, arrival: float, timing: Timing,
                 on_end: Callable[[], None] = lambda: None, drain: Drain | None = None
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from every sub-request until all finish; abort what is
    left if the consumer stops early (disconnect, timeout) or the drain cuts it (`drain`
    tracks the sub-requests meanwhile; its `WorkerDraining` is raised). `on_end` runs at
    the first output (the requests hold their own block references by then) or at the end."""
    tokens = TokenClock(metrics, arrival)
    if drain is not None:
        drain.track(rid, queues)
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
        if drain is not None:
            drain.untrack(rid)
        on_end()
        for i in unfinished:
            engine.abort(f"{rid}-{i}")


@dataclass
class TokenClock:
    """TTFT / queue-time / inter-token-latency observations of one HTTP request."""

    metrics: ServerMetrics
    arrival: float
    first_token: float | None = None
    last_token: float | None = None

    def record(self, out: RequestOutput, timing: Timing) -> bool:
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

