"""A worker told to stop (SIGTERM: a rollout, a scale-down) loses no request.

`Drain` runs the stop, in this order:

1. At once: readiness fails (`/ready` 503 `draining`, `Load.draining` true), so routers and
   the kubelet stop sending; a new request is answered 503 with the OpenAI error code
   `protocol.web.DRAINING_CODE` and `Retry-After` (`draining_error`), which a router retries
   on another worker at once; a new KV-transfer `Prefill` call is refused (UNAVAILABLE).
2. At once: requests admitted but still queued in the engine (waiting, no token generated)
   are ended the same way (non-streamed: that 503; streamed: an SSE error event with that
   code, then `[DONE]`) rather than started here.
3. Running requests finish, and KV pages a prefill worker sent under a lease stay pinned and
   served until their decode worker releases them or the lease expires (`busy`), for up to
   the drain timeout (`--drain-timeout`).
4. At the timeout, every request still running ends with `DRAINING_CODE` (a stream: the
   error event after the tokens it sent, which the router turns into a migration by token
   replay); then the process exits.

A request is cut through its engine output streams (`OutputStream.fail` with
`WorkerDraining`); the reader ends it as above and aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

from tandem.engine.async_engine import AsyncLLMEngine, OutputStream
from tandem.protocol.web import DRAINING_CODE, APIError, error_body

logger = logging.getLogger("tandem.serving.api_server")
POLL_S = 0.05  # how often the drain looks at what is left
CUT_GRACE_S = 2.0  # after the timeout: the cut requests' time to send their error answers
DRAINING_MESSAGE = "the worker is draining; retry on another replica"


class WorkerDraining(Exception):
    """A request this worker stopped before finishing it (the drain)."""


def draining_error(retry_after_s: int, message: str = DRAINING_MESSAGE) -> APIError:
    """The 503 a draining worker answers: `code` `DRAINING_CODE`, with `Retry-After`."""
    return APIError(503, message, headers={"Retry-After": str(retry_after_s)},
                    code=DRAINING_CODE)


def draining_event(message: str) -> str:
    """The SSE error event a stream ends with when the drain cuts it (then `[DONE]`)."""
    body = error_body(503, message, code=DRAINING_CODE)
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class Drain:
    """The requests in flight (their engine output streams, by engine request id) and the
    stop sequence (module doc). One per app; `active` once the stop began."""

    def __init__(self) -> None:
        self.active = False
        self.streams: dict[str, OutputStream] = {}
        self.cut_waiting = 0  # requests ended before they started (step 2)
        self.cut_running = 0  # requests ended at the timeout (step 4)

    def track(self, ids: Iterable[str], queues: Iterable[OutputStream]) -> None:
        for sub, q in zip(ids, queues, strict=True):
            self.streams[sub] = q

    def untrack(self, ids: Iterable[str]) -> None:
        for sub in ids:
            self.streams.pop(sub, None)

    def cut(self, ids: Iterable[str], why: str) -> int:
        """End these engine requests' (`{rid}-{i}`) readers with `WorkerDraining(why)`; how
        many HTTP requests (`rid`) that ends."""
        cut = set()
        for sub in list(ids):
            q = self.streams.pop(sub, None)
            if q is not None:
                q.fail(WorkerDraining(why))
                cut.add(sub.rsplit("-", 1)[0])
        return len(cut)

    async def guard(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's SSE chunks; a cut ends them with `draining_event` and `[DONE]`."""
        try:
            async for chunk in chunks:
                yield chunk
        except WorkerDraining as exc:
            yield draining_event(str(exc))
            yield "data: [DONE]\n\n"

    async def run(self, engine: AsyncLLMEngine | None, timeout_s: float,
                  in_flight: Callable[[], int], kv_busy: Callable[[], int]) -> None:
        """Steps 2-4 (step 1 is `active`, which this sets too); returns once nothing is left
        (`in_flight()`: HTTP requests being answered; `kv_busy()`: KV leases and Prefill
        calls held here), or once the timeout has passed and the cut requests answered."""
        self.active = True
        deadline = time.monotonic() + timeout_s
        if engine is not None and engine.alive:
            try:
                waiting = await engine.unstarted_request_ids()
            except Exception as exc:  # noqa: BLE001 - the engine died: the timeout still runs
                logger.warning("drain: the engine's queue could not be read (%s)", exc)
            else:
                self.cut_waiting = self.cut(waiting, "the worker is draining: this queued "
                                                     "request was not started; retry on "
                                                     "another replica")
                if self.cut_waiting:
                    logger.info("drain: %d queued requests handed back (%s)",
                                self.cut_waiting, DRAINING_CODE)
        while (in_flight() > 0 or kv_busy() > 0) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self.streams:
            self.cut_running = self.cut(list(self.streams), "the worker stopped (drain "
                                        f"timeout {timeout_s:g}s) before this request "
                                        "finished; retry on another replica")
            logger.warning("drain timeout (%gs): %d running requests ended with %s",
                           timeout_s, self.cut_running, DRAINING_CODE)
            end = time.monotonic() + CUT_GRACE_S
            while in_flight() > 0 and time.monotonic() < end:
                await asyncio.sleep(POLL_S)
        elif kv_busy() > 0:
            logger.warning("drain timeout (%gs): KV pages still leased; exiting", timeout_s)
