"""Torch-free HTTP plumbing shared by the worker server and the router.

* OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right
  status; anything a client can send maps to a 4xx, a 500 means a bug. A body field the
  schema does not declare is 400 `<field> is not supported` (`schema_error`).
* ASGI middleware: a request-body size limit (413) and an in-flight request count.
* `FastPaths`: hot POST routes served straight from ASGI, in front of the FastAPI app.
* `cancel_on_disconnect`: run a coroutine, cancel it when the client goes away.
* `serve_route`: a hot route's handler with the endpoint contract (errors, 413, 500).
* `PREFILL_HEADER`: how the router tells a decode worker where its prefill runs (P/D);
  `PEER_HEADER`: a peer holding KV blocks to pull; `forward_target`: what the router signs.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.protocol.openai_api import NOT_SUPPORTED, ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)
# P/D: the router names the prefill worker (gRPC host:port) a decode worker fetches from;
# workers act on it only under the router's signature (`signing.SIGNATURE_HEADER`)
PREFILL_HEADER = "x-tandem-prefill"
# peer pull: the router names a worker (gRPC host:port) holding prompt blocks the chosen
# worker lacks; the chosen worker may pull them over KV transfer instead of recomputing
PEER_HEADER = "x-tandem-kv-peer"
# ... and how many leading prompt blocks the router believes that peer holds (a decimal count;
# a hint only: the holder's answer is what counts)
PEER_BLOCKS_HEADER = "x-tandem-kv-peer-blocks"

# the `code` of the error a worker ends a request or stream with when it stops before finishing
# it (a drain that ran out of time, an engine shutting down): the router resumes the request on
# another worker (token replay for a stream that already sent tokens)
DRAINING_CODE = "worker_draining"


def forward_target(prefill: str | None, peer: str | None) -> str | None:
    """The target a router signs a forwarded request for (`signing.sign`), binding the P/D
    prefill worker and the KV peer it names (None: neither)."""
    if peer is None:
        return prefill
    return f"{prefill or ''}|peer:{peer}"
_PLAIN_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def plain_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id if it is short and plain (safe in logs and headers), else
    None."""
    return value if value and _PLAIN_ID.fullmatch(value) else None


# ASGI scope extension: the server cancels the request's task when the client goes away
DISCONNECT_CANCELS = "tandem.disconnect_cancels"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """An OpenAI error answer; `code` is the body's `code` (default: the status, as a
    number; e.g. `DRAINING_CODE` names why a worker stopped)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.type = type_ or _TYPES.get(status, "server_error")
        self.code = code


def error_body(status: int, message: str, param: str | None = None,
               type_: str | None = None, code: str | None = None) -> dict:
    detail = ErrorDetail(message=message, type=type_ or _TYPES.get(status, "server_error"),
                         param=param, code=status if code is None else code)
    return ErrorResponse(error=detail).model_dump()


def schema_error(err: Mapping[str, Any]) -> tuple[str, str | None]:
    """One pydantic error as (message, param): `<field> is not supported` for a field the
    schema does not declare, a `NOT_SUPPORTED` error's own message, else `loc: msg`. The
    param is the dotted location (without FastAPI's leading `body`)."""
    loc = [str(p) for p in err.get("loc", ())]
    if loc[:1] == ["body"]:
        loc = loc[1:]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid")
    if param and err.get("type") == "extra_forbidden":
        return f"{param} is not supported", param
    if err.get("type") == NOT_SUPPORTED:
        return msg, param
    return (f"{param}: {msg}" if param else msg), param


def first_error(exc: Exception) -> str:
    """A client's bad body in one line: the first pydantic error (`schema_error`), or the
    JSON error's text."""
    if isinstance(exc, RecursionError):
        return "the JSON body is nested too deeply"
    if isinstance(exc, ValidationError):
        return schema_error(exc.errors()[0])[0]
    return str(exc)


def bad_body(exc: Exception) -> APIError:
    """The 400 for a body that is not JSON or not the schema: `first_error`'s message, the
    field as `param` when one is to blame."""
    param = schema_error(exc.errors()[0])[1] if isinstance(exc, ValidationError) else None
    return APIError(400, first_error(exc), param)


NOT_JSON = "the request body must be JSON, sent with Content-Type: application/json"


def require_json(request: Request) -> None:
    """APIError 400 (`NOT_JSON`) for a POST whose Content-Type is not JSON
    (`application/json` or `application/*+json`), or missing: such a body is never parsed
    as JSON, so a browser's cross-site form or text/plain POST cannot reach a model (as
    FastAPI's strict content type), and the client is told why."""
    if request.method == "POST":
        require_json_type(request.headers.get("content-type"))


def require_json_type(content_type: str | None) -> None:
    """`require_json` on a POST's Content-Type header value (None: absent), for front doors
    that are not an HTTP request (the gateway's ext_proc stream)."""
    media = (content_type or "").partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise APIError(400, NOT_JSON)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.type, err.code),
                        status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI JSON; an unhandled exception is a logged 500."""
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        message, param = schema_error(errs[0]) if errs else ("invalid request", None)
        return error_response(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail),
                                       headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                       type_="server_error"))


class _TooLarge(Exception):
    pass


def declared_too_large(scope: dict, limit: int) -> bool:
    """The request's Content-Length is above `limit` bytes."""
    for key, value in scope.get("headers") or ():
        if key == b"content-length":
            return value.isdigit() and int(value) > limit
    return False


def limited_receive(receive: Any, limit: int) -> Any:
    """`receive` that raises `_TooLarge` once the streamed body passes `limit` bytes."""
    seen = 0

    async def wrapped() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge
        return message

    return wrapped


def too_large(limit: int) -> JSONResponse:
    return error_response(APIError(413, f"request body exceeds {limit} bytes"))


class BodyLimit:
    """413 with an OpenAI error body for request bodies above `limit` bytes, whether the
    size is declared (Content-Length) or only seen while streaming in."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if declared_too_large(scope, self.limit):
            return await too_large(self.limit)(scope, receive, send)
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive(receive, self.limit), tracking_send)
        except _TooLarge:
            if not started:
                await too_large(self.limit)(scope, receive, send)


Handler = Callable[[Request], Awaitable[Response]]


class FastPaths:
    """An ASGI front for the hot routes: a POST to a path in `routes` goes straight to its
    handler, skipping FastAPI's middleware stack, routing and dependency solving (measured on
    the router: ~0.3 ms of CPU a request). Everything else, lifespan included, goes to `app`,
    where the same handlers stay registered, so /openapi.json still documents them.

    The contract is an endpoint's: the handler gets a Starlette `Request` and returns a
    `Response` or raises `APIError`; any other exception is a logged 500 in OpenAI JSON.
    Bodies over `max_body_bytes` (declared or streamed) are a 413. `state` is the app's."""

    def __init__(self, app: FastAPI, routes: Mapping[str, Handler], max_body_bytes: int) -> None:
        self.app = app
        self.routes = dict(routes)
        self.limit = max_body_bytes

    @property
    def state(self) -> Any:
        return self.app.state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        handler = (self.routes.get(scope["path"])
                   if scope["type"] == "http" and scope["method"] == "POST" else None)
        if handler is None:
            return await self.app(scope, receive, send)
        if declared_too_large(scope, self.limit):
            return await too_large(self.limit)(scope, receive, send)
        request = Request(scope, limited_receive(receive, self.limit))
        response = await serve_route(handler, request, self.limit)
        await response(scope, receive, send)


async def serve_route(handler: Handler, request: Request, limit: int = 0) -> Response:
    """`handler(request)` with the endpoint contract: `APIError` -> its OpenAI error, a body
    over `limit` (seen while reading) -> 413, anything else -> a logged 500."""
    try:
        return await handler(request)
    except _TooLarge:
        return too_large(limit)
    except APIError as exc:
        return error_response(exc)
    except Exception as exc:
        logger.exception("unhandled error on %s", request.scope["path"])
        return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                       type_="server_error"))


class InFlight:
    """Counts `/v1/*` requests being served (a stream counts until its last byte)."""

    def __init__(self, app: Any, counter: list[int]) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.counter[0] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter[0] -= 1


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` in the calling task; if the client goes away first, cancel it (its
    requests get aborted). Returns (completed, result). One watcher task per call, except
    under a server that cancels the request's task itself (`DISCONNECT_CANCELS`)."""
    if DISCONNECT_CANCELS in request.scope.get("extensions", ()):
        return True, await work
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(_until_disconnected(request))
    state = {"active": True, "gone": False}

    def on_gone(w: asyncio.Future) -> None:
        if state["active"] and not w.cancelled() and w.exception() is None:
            state["gone"] = True
            task.cancel()

    watcher.add_done_callback(on_gone)
    try:
        return True, await work
    except asyncio.CancelledError:
        if state["gone"] and task.uncancel() == 0:  # our cancel, not someone else's
            return False, None
        raise
    finally:
        state["active"] = False
        watcher.cancel()
