"""Forward one OpenAI request to a worker, retrying elsewhere only before the first byte.

* Retries (connect error, timeout before headers, 429, 503) go to the next-best worker,
  never one already tried, up to `retries` extra attempts with jittered exponential
  backoff. Once the worker's status line is in, the response is committed to it. Under P/D
  the attempt goes to the decode worker with the prefill worker in its headers
  (`pd.Route`); a retry picks a new decode worker and may keep the prefill worker.
* Streams (SSE) pass through chunk by chunk, unbuffered. If the worker dies mid-stream the
  client gets an SSE error event and `data: [DONE]`, not a hang; with `migration` (a
  completions or chat stream, signed) the stream is relayed event by event and goes on on
  another worker instead (`router.migration`). Non-streamed bodies are read whole first,
  so a worker failure becomes a clean 502, or, with `migration`, a retry elsewhere within
  both bounds (`retries`, `max_migrations`).
* A client disconnect closes the upstream connection, which aborts the request on the worker.
* Upstream HTTP is `upstream.UpstreamPool` (pooled keep-alive HTTP/1.1 on httptools):
  ~0.07 ms of CPU per forwarded request, against ~0.26 ms for aiohttp and 1.5-2.8 ms for
  httpx, measured on this path.
* Connect errors and 5xx feed the worker's circuit breaker; a 503 (loading or draining)
  also marks it unready until its next good readiness probe.
* With a worker key every attempt is signed (`protocol.signing`): the exact body sent and
  that attempt's prefill target, so a worker can tell the router's requests from others.
* Answers name no worker: a worker id is a pod address. Only with `debug_headers` does the
  client get `x-tandem-worker` (the worker that answered) and the worker's `server-timing`,
  and a 502's message the connect error; without, the error's kind only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse

from tandem.protocol.migration import TOKENS_HEADER, signed_target
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey, body_digest
from tandem.protocol.web import PEER_HEADER, PREFILL_HEADER, APIError, error_body, forward_target
from tandem.router.migration import Leg, Migration, Migrator
from tandem.router.pd import Route
from tandem.router.policy import Decision
from tandem.router.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamSettings,
    UpstreamTimeout,
)
from tandem.router.workers import Worker

logger = logging.getLogger(__name__)
RETRY_STATUSES = (429, 503)
PASS_HEADERS = ("content-type", "retry-after")  # worker headers a client gets
DEBUG_PASS_HEADERS = (*PASS_HEADERS, "server-timing")  # ... with `debug_headers`
WORKER_HEADER = "x-tandem-worker"  # the answering worker's id, with `debug_headers`


@dataclass
class ProxySettings:
    retries: int = 2  # extra attempts on other workers, before the first byte only
    backoff_s: float = 0.02  # base of the jittered exponential backoff
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    debug_headers: bool = False  # name the worker in answers (module doc); off: no pod address
    max_migrations: int = 3  # new workers a broken completions/chat request may move to; 0: off


@dataclass
class Attempt:
    route: Route
    status: int | None = None
    error: str | None = None  # for logs: may name the worker's address
    failure: str | None = None  # what went wrong, naming no address ("timeout", ...)
    final: bool = False  # the attempt whose response the client gets

    @property
    def decision(self) -> Decision:
        return self.route.decision


def upstream_session(settings: ProxySettings) -> UpstreamPool:
    """The pooled client for forwarding (create and close it on the router's loop)."""
    return UpstreamPool(UpstreamSettings(connect_timeout_s=settings.connect_timeout_s,
                                         read_timeout_s=settings.read_timeout_s))


async def forward(http: UpstreamPool, path: str, body: bytes, rid: str,
                  pick: Callable[[set[str]], Route | None], stream: bool,
                  settings: ProxySettings, on_attempt: Callable[[Attempt], None],
                  signer: WorkerKey | None = None,
                  migration: Migration | None = None) -> Response:
    """Send `body` to `path` on the worker `pick(tried)` chooses; see the module doc.
    `migration`: a completions or chat request, migrated if its worker breaks
    (`router.migration`; needs `signer`)."""
    tried: set[str] = set()
    if migration is not None and (migration.max_migrations <= 0 or signer is None):
        migration = None
    digest = body_digest(body) if signer is not None else None
    last: Attempt | None = None
    for n in range(settings.retries + 1):
        route = pick(tried)
        if route is None:
            break
        w = route.worker
        tried.add(w.id)
        attempt = Attempt(route)
        w.breaker.on_attempt(time.monotonic())
        w.local_in_flight += 1
        released = False

        def release(w: Worker = w) -> None:
            nonlocal released
            if not released:
                released = True
                w.local_in_flight -= 1

        try:
            headers = {"Content-Type": "application/json", "X-Request-Id": rid,
                       **route.headers()}
            if migration is not None and stream:
                headers[TOKENS_HEADER] = "1"  # the stream's token ids, to resume it
            if signer is not None:
                target = signed_target(forward_target(headers.get(PREFILL_HEADER),
                                                      headers.get(PEER_HEADER)), headers)
                headers[SIGNATURE_HEADER] = signer.sign(body, target, digest)
            resp = await http.post(w.id, path, body, headers)
        except UpstreamError as exc:
            release()
            w.breaker.on_failure(time.monotonic())
            attempt.error = f"{type(exc).__name__}: {exc}"
            attempt.failure = ("timeout" if isinstance(exc, UpstreamTimeout)
                               else "connection failed")
            logger.warning("[%s] %s failed before the first byte: %s", rid, w.id, attempt.error)
        else:
            attempt.status = resp.status
            if resp.status in RETRY_STATUSES and n < settings.retries:
                resp.close()
                release()
                if resp.status == 503:
                    w.ready = False
                    w.breaker.on_failure(time.monotonic())
                logger.info("[%s] %s answered %d; retrying elsewhere", rid, w.id, resp.status)
            else:
                if resp.status >= 500:
                    w.breaker.on_failure(time.monotonic())
                else:
                    w.breaker.on_success()
                attempt.final = True
                on_attempt(attempt)
                passed = DEBUG_PASS_HEADERS if settings.debug_headers else PASS_HEADERS
                headers = {k: v for k, v in resp.headers if k in passed}
                if settings.debug_headers:
                    headers[WORKER_HEADER] = w.id
                if stream and resp.status == 200:
                    if migration is not None:
                        assert signer is not None
                        relay = Migrator(http, path, body, rid, pick, tried, signer,
                                         migration).relay(Leg(resp, w, release))
                        return StreamingResponse(relay, status_code=200, headers=headers)
                    return StreamingResponse(_relay(resp, rid, w, release),
                                             status_code=200, headers=headers)
                done = False
                try:
                    content = await resp.read()
                    done = True
                except UpstreamError as exc:
                    w.breaker.on_failure(time.monotonic())
                    if migration is None or n >= min(settings.retries, migration.max_migrations):
                        raise APIError(502, "worker failed mid-response: "
                                       f"{type(exc).__name__}", type_="server_error") from exc
                    # nothing reached the client yet: the whole request goes elsewhere
                    migration.on_result("retried", "connection")
                    logger.warning("[%s] %s failed mid-response; retrying elsewhere", rid, w.id)
                finally:
                    _finish(resp, done)
                    release()
                if done:
                    return Response(content, status_code=resp.status, headers=headers)
                attempt.failure = attempt.error = "the worker failed mid-response"
                last = attempt
                await asyncio.sleep(settings.backoff_s * (2 ** n) * (0.5 + random.random()))
                continue
        on_attempt(attempt)
        last = attempt
        if n < settings.retries:
            await asyncio.sleep(settings.backoff_s * (2 ** n) * (0.5 + random.random()))
    if last is None:
        raise APIError(503, "no ready worker serves this model; retry later",
                       headers={"Retry-After": "1"})
    if last.status in RETRY_STATUSES:
        raise APIError(last.status, f"every worker tried was busy (last: HTTP {last.status})",
                       headers={"Retry-After": "1"})
    detail = last.error if settings.debug_headers else last.failure
    raise APIError(502, f"no worker could be reached ({detail})", type_="server_error")


async def _relay(resp: UpstreamResponse, rid: str, w: Worker,
                 release: Callable[[], None]) -> AsyncIterator[bytes]:
    done = False
    try:
        async for chunk in resp.chunks():
            yield chunk
        done = True
    except UpstreamError as exc:
        w.breaker.on_failure(time.monotonic())
        logger.warning("[%s] %s failed mid-stream: %s", rid, w.id, exc)
        payload = error_body(502, f"the worker failed mid-stream ({type(exc).__name__})")
        # blank lines first: end any event the failure cut short, then a well-formed one
        yield f"\n\ndata: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()
    finally:
        _finish(resp, done)
        release()


def _finish(resp: UpstreamResponse, complete: bool) -> None:
    """A fully read response returns its connection to the pool; anything else (an error,
    the client gone) closes it, which aborts the request on the worker."""
    if complete:
        resp.release()
    else:
        resp.close()
