"""A server-sent-events response that owns its send loop, so a client cannot hold a request
(its engine work, its KV blocks, its pending output) longer than the server allows.

uvicorn's `send` waits while the connection's write buffer is above its high-water mark,
that is while the client does not read. `SSEResponse` bounds every send by `send_timeout_s`
and the whole response (from the request's admission to its last byte) by a deadline; a
client that closes the connection ends the response at once. In every case the chunk
source is closed at once, so its `finally` aborts the engine requests behind it. A stalled
or timed-out reader gets its connection closed (the response is left incomplete, which
uvicorn answers by closing the transport); a deadline that passes while the reader keeps up
ends the stream with the `on_timeout` chunks instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import StreamingResponse

logger = logging.getLogger(__name__)
TAIL_GRACE_S = 1.0  # the most a timed-out stream waits to hand over its closing chunks


class _Stalled(Exception):
    """A send did not complete in time: the client stopped reading."""


class SSEResponse(StreamingResponse):
    """ASGI response streaming `chunks` as `text/event-stream`.

    `deadline` is in `time.monotonic()` seconds (the request's admission + its timeout);
    `on_timeout`: the chunks sent when it passes while the client keeps up (an error event,
    `[DONE]`). `outcome` says how the response ended: "complete", "timeout" (closing chunks
    sent), "stalled" (connection closed) or "disconnected"."""

    def __init__(self, chunks: AsyncIterator[str], *, deadline: float, send_timeout_s: float,
                 request_id: str, on_timeout: Sequence[str] = ()) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.chunks = chunks
        self.deadline = deadline
        self.send_timeout_s = send_timeout_s
        self.request_id = request_id
        self.on_timeout = list(on_timeout)
        self.outcome: str | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.deadline - time.monotonic())  # in the loop's clock
        it = self.chunks.__aiter__()
        whole = asyncio.timeout_at(deadline)
        state = {"open": True, "gone": False}

        def on_gone(w: asyncio.Future) -> None:
            if w.cancelled() or w.exception() is not None:
                return
            state["gone"] = True
            if state["open"]:
                whole.reschedule(loop.time())  # ends the response at the next await

        watcher = asyncio.ensure_future(_until_disconnected(receive))
        watcher.add_done_callback(on_gone)
        rid = self.request_id
        try:
            try:
                async with whole:
                    await self._send(send, {"type": "http.response.start",
                                            "status": self.status_code,
                                            "headers": self.raw_headers})
                    async for chunk in it:
                        await self._send(send, _body(chunk, more=True))
                    state["open"] = False  # the last send completes the response
                    await self._send(send, _body("", more=False))
                    self.outcome = "complete"
                    return
            except TimeoutError:
                if state["gone"]:
                    self.outcome = "disconnected"
                    logger.info("[%s] client disconnected; aborted", rid)
                    return
            state["open"] = False
            await it.aclose()  # abort now, not after the closing chunks
            logger.warning("[%s] stream timed out; aborted", rid)
            async with asyncio.timeout(min(self.send_timeout_s, TAIL_GRACE_S)):
                for chunk in self.on_timeout:
                    await send(_body(chunk, more=True))
                await send(_body("", more=False))
            self.outcome = "timeout"
        except (_Stalled, TimeoutError):
            self.outcome = "stalled"
            logger.warning("[%s] the client stopped reading; aborted, connection closed", rid)
        finally:
            state["open"] = False
            watcher.cancel()
            await it.aclose()  # aborts what is left at once (a no-op once finished)

    async def _send(self, send: Any, message: dict) -> None:
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await send(message)
        except TimeoutError as exc:
            raise _Stalled from exc


def _body(chunk: str, more: bool) -> dict:
    return {"type": "http.response.body", "body": chunk.encode(), "more_body": more}


async def _until_disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
