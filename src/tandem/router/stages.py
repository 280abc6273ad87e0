"""The router's OpenAI POST (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`) in
named stages.

`handle` runs them in order, each raising `APIError` (an OpenAI error answer) to stop:
`authenticate` (API key -> tenant; 401) -> `parse_body` (JSON object, tenant cache salt,
priority range, max_tokens cap, model, prompt tokenized as the worker will; 400) -> `admit`
(prompt length; 503 while the model's workers may be starting, else 404) -> `charge`
(the tenant's rate limit at the worst case; 429) -> `shared_matches` (the shared prefix
index) -> `forward` with a `Routing` (pick a worker, and a prefill worker for P/D; count
each attempt) -> `relay` (the answer; a token charge settled from the usage it reports).
Every stop counts in `tandem_router_rejected_total` with its status. A Responses API
request is tokenized and hashed as the chat completion that serves it; one continuing a
stored response (`previous_response_id`) goes to the worker holding it (`responses`), and
the worker each answer came from is remembered. A request's `x-session-token` favours the
worker it names (`scorers.session`); a 2xx answer carries the token of the worker that
served it.

With flow control on, `hold` runs between `charge` and `shared_matches`: the request waits
while every worker of its model is saturated (429 / 503 when shed, `flowcontrol`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tandem.protocol.web import (
    APIError,
    bad_body,
    cancel_on_disconnect,
    plain_request_id,
    require_json_type,
)
from tandem.router import prompt as prompts
from tandem.router import responses, usage
from tandem.router.auth import tenant_cache_salt
from tandem.router.flowcontrol import front as flow_front
from tandem.router.flowcontrol.base import FlowTicket
from tandem.router.guardrails.output import OutputFilter, stop_error
from tandem.router.guardrails.relay import relay_filtered
from tandem.router.migration import Migration
from tandem.router.pd import Route, plan
from tandem.router.proxy import Attempt, forward
from tandem.router.ratelimit import retry_after_header
from tandem.router.scorers.session import SESSION_HEADER, SessionTokens, tokens_for
from tandem.router.workers import HashGroup

if TYPE_CHECKING:
    from tandem.router.routes import RouterApp

logger = logging.getLogger("tandem.router.app")  # the routing lines keep their logger
THREAD_TOKENIZE_BYTES = 32 << 10  # bodies above this are rendered off the event loop
_ID_PREFIX = f"rt-{uuid.uuid4().hex[:8]}-"  # per process, so replicas' ids do not collide
_ID_COUNTER = itertools.count(1)


@dataclass
class Body:
    """A request past `parse_body`: `data` is the JSON object as it will be forwarded once
    `changed` (else `raw` goes as sent), `model` the model it names (or the one served)."""

    tenant: str | None
    raw: bytes
    data: dict[str, Any]
    parsed: prompts.ParsedPrompt
    model: str
    changed: bool
    usage_asked: bool = False  # the worker was asked for a stream's usage chunk (`ask_usage`)
    strip_usage: bool = False  # ... by the router only: the client does not get it
    output: OutputFilter | None = None  # the output guardrails the answer goes through


@dataclass
class Charge:
    """A rate-limit charge to settle from the answer's usage (`usage.Settlement`);
    `strip_usage`: the usage chunk was asked for by the router only, so the client's
    stream loses it."""

    bill: usage.Settlement
    strip_usage: bool = False


def session_tokens(ra: RouterApp) -> SessionTokens:
    """The session-token codec (`scorers.session`), keyed by the worker auth key if set."""
    key = ra.settings.worker_key
    return tokens_for(None if key is None else key.signing_key())


def request_id(supplied: str | None) -> str:
    """The client's X-Request-Id when it is short and plain (it goes into logs and the
    worker request's headers), else a fresh one."""
    return plain_request_id(supplied) or f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


def authenticate(ra: RouterApp, authorization: str | None) -> str | None:
    """The caller's tenant from its Authorization header value (None: auth is off); 401
    without a valid API key."""
    try:
        return ra.settings.api_keys.tenant(authorization)
    except APIError:
        ra.metrics.child(ra.metrics.rejected, "401").inc()
        raise


async def parse_body(ra: RouterApp, kind: str, body: bytes, content_type: str | None,
                     tenant: str | None, rid: str = "-") -> Body:
    """The body (read and bounded by the front door) parsed (`kind`: "completions", "chat"
    or "responses"; `content_type`: its Content-Type header value): 400 for a body that is
    not a JSON object (sent as JSON), a max_tokens over the cap, no model while several are
    served, or a prompt the tokenizer refuses; a tenant's cache salt and priority are
    applied (400 / 403 outside their rules); with guardrails, the tenant's policy and the
    input guardrails (`guardrails.guard`: 400 / 403, code `guardrail` or `policy`), the
    body then tokenized as they left it. Transport-free: the HTTP router and the gateway's
    endpoint picker both call it."""
    settings, metrics, router = ra.settings, ra.metrics, ra.router
    guard = settings.guardrails
    try:
        require_json_type(content_type)  # 400 for a body not sent as JSON, as at the worker
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
        check_bounds(ra, data)
        model = data.get("model") or default_model(ra)
        base = router.base_model(model)
        tokenizer = router.tokenizer_for(base[0])
        if guard is not None:
            changed |= await guard.before_tokenize(rid, tenant, kind, data, model, base,
                                                   decoder(tokenizer))
        # a long new text tokenized off the loop; a long body rendered off it too
        parsed = await prompts.parse_async(kind, data, tokenizer,
                                           render_off_loop=len(body) > THREAD_TOKENIZE_BYTES)
        if guard is not None:
            changed |= guard.after_tokenize(rid, tenant, kind, data, model, None
                                            if parsed.token_ids is None
                                            else len(parsed.token_ids))
    except (ValueError, ValidationError, RecursionError) as exc:
        metrics.child(metrics.rejected, "400").inc()
        raise bad_body(exc) from exc
    except APIError as exc:  # a bad cache_salt or priority
        metrics.child(metrics.rejected, str(exc.status)).inc()
        raise
    return Body(tenant, body, data, parsed, model, changed,
                output=None if guard is None else guard.output_filter(tenant, kind))


def decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """Token ids -> text, special tokens kept, for the input guardrails (None: no
    tokenizer); ValueError for ids the tokenizer cannot decode."""
    if tokenizer is None:
        return None

    def decode(ids: list[int]) -> str:
        try:
            return tokenizer.decode(ids, skip_special_tokens=False)
        except Exception as exc:
            raise ValueError(f"prompt: token ids the tokenizer cannot decode ({exc})"[:300]
                             ) from None

    return decode


def check_bounds(ra: RouterApp, data: dict) -> None:
    """ValueError when max_tokens, max_completion_tokens or max_output_tokens exceeds
    `max_tokens_cap`."""
    cap = ra.settings.max_tokens_cap
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = data.get(key)
        if cap is not None and isinstance(v, int) and v > cap:
            raise ValueError(f"{key}: at most {cap}")


def default_model(ra: RouterApp) -> str:
    """The one model served; "" when none is (yet: `startup.check` answers)."""
    served = sorted({*ra.router.models(), *ra.router.settings.served_models})
    if len(served) <= 1:
        return served[0] if served else ""
    raise ValueError("the request must name a model (this router serves several)")


def admit(ra: RouterApp, req: Body) -> None:
    """400 for a prompt over `max_prompt_tokens`; 503 while the model's workers may be
    starting, else 404 for a model no worker serves (`startup.StartupState`)."""
    metrics, limit = ra.metrics, ra.settings.max_prompt_tokens
    token_ids = req.parsed.token_ids
    if token_ids is not None and len(token_ids) > limit:
        metrics.child(metrics.rejected, "400").inc()
        raise APIError(400, f"prompt has {len(token_ids)} tokens; the limit is {limit}",
                       "prompt")
    if ra.settings.flow_control is not None and req.model in ra.router.settings.served_models:
        return  # held in flow control's queue while its workers start (scale from zero)
    unavailable = ra.startup.check(req.model, ra.router.workers.values(), time.monotonic())
    if unavailable is not None:
        metrics.child(metrics.rejected, str(unavailable.status)).inc()
        raise unavailable


async def charge(ra: RouterApp, kind: str, req: Body) -> Charge | None:
    """The tenant's rate limit, charged at the request's worst case (`usage.worst_case`):
    429 when over it (Retry-After) or larger than a minute's tokens. A charge to settle
    (None without a limiter, or when nothing was charged); a stream is made to report its
    usage (`stream_options.include_usage`) so that its last chunk settles it."""
    limiter = ra.settings.rate_limiter
    if limiter is None:
        return None
    parsed, data = req.parsed, req.data
    prompt_tokens = (len(parsed.token_ids) if parsed.token_ids is not None
                     else len(parsed.text.encode()) + 2)  # an upper bound
    worst, prompt_share = usage.worst_case(kind, data, prompt_tokens,
                                           ra.router.max_model_len(req.model))
    verdict = await limiter.acquire(req.tenant or "anonymous", worst)
    if not verdict.allowed:
        ra.metrics.child(ra.metrics.rejected, "429").inc()
        if verdict.reason == "too_large":
            raise APIError(429, f"the request may use up to {worst} tokens (prompt + "
                                "max_tokens, or the context left when max_tokens is "
                                "unset, times n), more than this tenant's tokens per "
                                "minute; lower max_tokens or n", "max_tokens")
        raise APIError(429, f"rate limit exceeded ({verdict.reason}); retry later",
                       headers={"Retry-After": retry_after_header(verdict)})
    if not verdict.charged:
        return None
    bill = Charge(usage.Settlement(limiter, req.tenant or "anonymous", verdict, prompt_share))
    if parsed.stream and kind != "responses":  # the worker's usage chunk settles the charge
        bill.strip_usage = ask_usage(req)
    return bill


def ask_usage(req: Body) -> bool:
    """Make a streamed chat/completions request report its usage in a last chunk
    (`stream_options.include_usage`; a Responses API stream always reports it, in
    `response.completed`); True when the client did not ask for it (the router strips it).
    Idempotent."""
    if not req.usage_asked:
        opts = req.data.get("stream_options")
        opts = dict(opts) if isinstance(opts, dict) else {}
        req.strip_usage = not opts.get("include_usage")
        req.data["stream_options"] = {**opts, "include_usage": True}
        req.changed = req.usage_asked = True
    return req.strip_usage


async def shared_matches(ra: RouterApp, parsed: prompts.ParsedPrompt, model: str
                         ) -> tuple[dict | None, dict[HashGroup, dict[str, int]] | None]:
    """(hash chains per hash group, matches from the shared index store) or (None, None)
    without a store; a store that has no answer in time leaves matching to memory."""
    store, router, metrics = ra.settings.index_store, ra.router, ra.metrics
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


class Routing:
    """One request's routing across `forward`'s attempts: `pick` plans each attempt
    (`pd.plan`, excluding the workers tried; a retry keeps the first prefill worker) and
    logs the decision; `on_attempt` counts each attempt's outcome."""

    def __init__(self, ra: RouterApp, rid: str, req: Body, t0: float,
                 hashes: dict | None, external: dict | None) -> None:
        self.ra, self.rid, self.req, self.t0 = ra, rid, req, t0
        self.hashes, self.external = hashes, external
        self.first = True
        self.prefill = None  # a retry may keep the first attempt's prefill worker
        self.attempts = 0
        self.pinned: str | None = None  # the worker holding a previous response, if any
        self.answered: str | None = None  # the worker whose answer the client gets
        self.session: str | None = None  # the worker the request's session token names

    def pick(self, tried: set[str]) -> Route | None:
        """The next attempt's route (None: no worker left); the first observes routing
        latency since `t0`."""
        metrics, router = self.ra.metrics, self.ra.router
        route = ctx = None
        if self.pinned is not None and self.pinned not in tried:  # only there, if routable
            route, ctx = self.plan(tried | {w for w in router.workers if w != self.pinned})
        if route is None:
            route, ctx = self.plan(tried)
        if self.first:
            metrics.routing_seconds.observe(time.perf_counter() - self.t0)
            self.first = False
        if route is not None:
            decision = route.decision
            self.prefill = route.prefill or self.prefill
            metrics.child(metrics.decisions, router.settings.policy, decision.reason).inc()
            metrics.prompt_tokens.inc(ctx.prompt_tokens)
            metrics.matched_tokens.inc(decision.matched_tokens)
            if logger.isEnabledFor(logging.INFO):  # prefix: the first block's hash
                chain = ctx.chain(decision.worker) or [b""]
                tier = ctx.tier_hits.get(decision.worker.id)
                logger.info("[%s] -> %s (%s, %d of %d tokens cached%s, prefix %s)%s", self.rid,
                            decision.worker.id, decision.reason, decision.matched_tokens,
                            ctx.prompt_tokens, f"; then {tier.host} host + {tier.disk} disk "
                            "blocks" if tier else "", chain[0][:4].hex() or "-",
                            f", prefill on {route.prefill.worker.id}" if route.prefill
                            else f", pulling {route.peer.extra} blocks from "
                            f"{route.peer.holder.id} ({route.peer.pull_s:.4f}s < "
                            f"{route.peer.recompute_s:.4f}s to compute)" if route.peer
                            else "")
        return route

    def plan(self, exclude: set[str]) -> tuple[Route | None, Any]:
        """`pd.plan` for this request, `exclude` left out; with flow control on, the
        saturated workers too while another can take it (where flow control saw room)."""
        if self.ra.settings.flow_control is not None:
            full = self.ra.router.saturated(self.req.model)
            if full - exclude:
                route, ctx = self.plan_without(exclude | full)
                if route is not None:
                    return route, ctx
        return self.plan_without(exclude)

    def plan_without(self, exclude: set[str]) -> tuple[Route | None, Any]:
        """`pd.plan` for this request, `exclude` left out; the chains hashed for the first
        attempt serve the retries."""
        route, ctx = plan(self.ra.router, self.req.parsed, self.req.model, time.monotonic(),
                          exclude=exclude, keep_prefill=self.prefill, hashes=self.hashes,
                          external=self.external,
                          signed=self.ra.settings.worker_key is not None,
                          session=self.session)
        if ctx is not None and ctx.hashes:
            self.hashes = ctx.hashes
        if route is not None and route.prefill is None:  # P/D takes precedence over a pull
            route.peer = ctx.peers.get(route.worker.id)
        return route, ctx

    def on_attempt(self, a: Attempt) -> None:
        """Count one attempt; one that never reached its worker is retracted from the
        index, so the retry routes without it."""
        metrics = self.ra.metrics
        self.attempts += 1
        if not a.final:  # it never reached the worker: the retry routes without it
            self.ra.router.retract(a.decision, time.monotonic())
        if self.attempts > 1:
            metrics.child(metrics.retries, str(a.status or "connect")).inc()
        metrics.child(metrics.requests, a.decision.worker.id, str(a.status or "error")).inc()
        if a.final:
            self.answered = a.decision.worker.id
        if a.final and a.route.prefill is not None:
            metrics.child(metrics.disaggregated,
                          a.route.worker.kv_transfer_backend or "unknown").inc()
            if a.route.estimate is not None and a.route.estimate.over_budget:
                metrics.pd_overruled.inc()
        elif a.final:
            metrics.child(metrics.aggregated, a.route.reason).inc()
        if a.final and a.route.peer is not None:
            metrics.child(metrics.peer_pulls, a.route.peer.medium).inc()


def migration(ra: RouterApp, kind: str) -> Migration | None:
    """Completions and chat requests migrate when their worker breaks (`router.migration`);
    the Responses API does not."""
    if kind == "responses" or ra.settings.proxy.max_migrations <= 0:
        return None
    metrics = ra.metrics
    return Migration(ra.settings.proxy.max_migrations,
                     lambda result, reason: metrics.child(metrics.migrations, result,
                                                          reason).inc())


async def relay(request: Request, work: Awaitable[Response], stream: bool,
                bill: Charge | None) -> Response:
    """`work`'s answer; 499 when a non-streaming client left first. With `bill`, its charge
    is settled from the usage the answer reports (`settled`)."""
    if bill is not None:
        return await settled(request, work, bill.bill, stream, bill.strip_usage)
    if stream:
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


def guarded(ra: RouterApp, rid: str, req: Body, output: OutputFilter,
            answer: Response) -> Response:
    """`answer` through the output guardrails (`guardrails.output`): a stream filtered as it
    passes (a stop closes the worker's stream, aborting the request there), a whole answer
    rewritten, or, stopped, answered 400 (code `guardrail`)."""
    guard = ra.settings.guardrails
    assert guard is not None
    if isinstance(answer, StreamingResponse):
        answer.body_iterator = relay_filtered(answer.body_iterator, output,
                                              lambda: guard.output_done(rid, req.tenant,
                                                                        output))
        return answer
    body = output.body(bytes(answer.body))
    guard.output_done(rid, req.tenant, output)
    if output.stopped is not None:
        ra.metrics.child(ra.metrics.rejected, "400").inc()
        return JSONResponse(stop_error(output.stopped), status_code=400)
    if body is None:
        return answer
    headers = {k: v for k, v in answer.headers.items() if k.lower() != "content-length"}
    return Response(body, status_code=answer.status_code, headers=headers)


def prompt_tokens(req: Body) -> int:
    """The prompt's tokens (an estimate, 4 bytes a token, for a prompt not tokenized)."""
    token_ids = req.parsed.token_ids
    return len(token_ids) if token_ids is not None else len(req.parsed.text.encode()) // 4


async def hold(ra: RouterApp, request: Request, rid: str, req: Body,
               bill: Charge | None) -> FlowTicket | None:
    """Flow control's ticket for `req` (`flowcontrol.front`: band, cost, deadline); None
    when the client left while it waited. A shed request (429 / 503) settles its charge."""
    flow = ra.settings.flow_control
    assert flow is not None
    try:
        deadline = flow_front.parse_deadline(request.headers.get(flow_front.DEADLINE_HEADER),
                                             time.monotonic())
        freq = flow_front.flow_request(rid, req.tenant, req.model, req.data,
                                       prompt_tokens(req), len(req.raw), deadline)
        completed, ticket = await cancel_on_disconnect(request, flow.acquire(freq))
    except APIError as exc:
        ra.metrics.child(ra.metrics.rejected, str(exc.status)).inc()
        if bill is not None:
            bill.bill.settle()
        raise
    if not completed and bill is not None:
        bill.bill.settle()  # nothing was generated
    return ticket if completed else None


async def handle(ra: RouterApp, kind: str, path: str, request: Request) -> Response:
    """One OpenAI POST (`kind` "completions", "chat" or "responses", forwarded to `path`),
    stage by stage (module doc)."""
    rid = request_id(request.headers.get("x-request-id"))
    tenant = authenticate(ra, request.headers.get("authorization"))
    t0 = time.perf_counter()
    req = await parse_body(ra, kind, await request.body(), request.headers.get("content-type"),
                           tenant, rid)
    admit(ra, req)
    bill = await charge(ra, kind, req)
    ticket = None
    if ra.settings.flow_control is not None:  # wait while every worker is saturated
        ticket = await hold(ra, request, rid, req, bill)
        if ticket is None:  # the client left while it waited
            return Response(status_code=499)
        if req.parsed.stream and kind != "responses":  # its usage chunk settles the ticket
            ask_usage(req)
            if bill is not None:
                bill.strip_usage = False  # the ticket's reader strips it (after the bill's)
    req.data["model"] = req.model
    payload = json.dumps(req.data).encode() if req.changed else req.raw  # as sent, if unchanged
    hashes, external = await shared_matches(ra, req.parsed, req.model)
    routing = Routing(ra, rid, req, t0, hashes, external)
    tokens = session_tokens(ra)
    routing.session = tokens.worker(request.headers.get(SESSION_HEADER), ra.router.workers)
    previous = req.data.get("previous_response_id") if kind == "responses" else None
    if isinstance(previous, str):
        holder = await responses.locate(ra, tenant, previous)
        routing.pinned = holder.id if holder is not None else None
    work = forward(ra.upstream, path, payload, rid, routing.pick, req.parsed.stream,
                   ra.settings.proxy, routing.on_attempt, ra.settings.worker_key,
                   migration(ra, kind))
    if ticket is not None:
        try:
            answer = flow_front.release_after(
                await relay(request, work, req.parsed.stream, bill), ticket,
                req.strip_usage, prompt_tokens(req))
        except BaseException:
            ticket.release(0)
            raise
    else:
        answer = await relay(request, work, req.parsed.stream, bill)
    if req.output is not None and 200 <= answer.status_code < 300:
        answer = guarded(ra, rid, req, req.output, answer)
    if routing.answered is not None and 200 <= answer.status_code < 300:
        answer.headers[SESSION_HEADER] = tokens.token(routing.answered)
    if kind == "responses" and req.data.get("store") is not False:
        return responses.track(ra, tenant, answer, lambda: routing.answered)
    return answer
