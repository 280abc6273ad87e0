"""ASGI middleware of the worker: a body-size limit (413) and an in-flight request count."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tandem.serving.errors import error_body


class _TooLarge(Exception):
    pass


class BodyLimit:
    """413 with an OpenAI error body for request bodies above `limit` bytes, whether the
    size is declared (Content-Length) or only seen while streaming in."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        seen = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(scope, receive, send)

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        response = JSONResponse(error_body(413, f"request body exceeds {self.limit} bytes"),
                                status_code=413)
        await response(scope, receive, send)


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
