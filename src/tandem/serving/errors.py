"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Anything a client can send maps to a 4xx here; a 500 means a bug in Tandem.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.errors import InvalidRequestError, QueueFullError
from tandem.protocol.chat_template import ChatTemplateError
from tandem.protocol.openai_api import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.type = type_ or _TYPES.get(status, "server_error")


def error_body(status: int, message: str, param: str | None = None,
               type_: str | None = None) -> dict:
    detail = ErrorDetail(message=message, type=type_ or _TYPES.get(status, "server_error"),
                         param=param, code=status)
    return ErrorResponse(error=detail).model_dump()


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.type),
                        status_code=err.status, headers=err.headers)


def from_engine_error(exc: Exception, retry_after_s: int = 1) -> APIError:
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, ChatTemplateError):
        return APIError(400, f"chat template: {exc}", "messages")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), headers={"Retry-After": str(retry_after_s)})
    raise exc


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return error_response(APIError(400, f"{param}: {msg}" if param else msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail),
                                       headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                       type_="server_error"))
