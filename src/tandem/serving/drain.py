"""A worker told to stop (SIGTERM: a rollout, a scale-down) loses no request.

`Drain` runs the stop, in this order:

1. At once: readiness fails (`/ready` 503 `draining`, `Load.draining` true), so routers and
   the kubelet stop sending; a new request is answered 503 with the OpenAI error code
   `protocol.web.DRAINING_CODE` and `Retry-After` (`draining_error`), which a router retries
   on another worker at once; a new KV-transfer `Prefill` call is refused (UNAVAILABLE).
2. At once: requests admitted but still queued in the engine (no prompt of theirs has a
   token yet; one partly started runs on as in step 3) are ended the same way
   (non-streamed: that 503; streamed: an SSE error event with that code, then `[DONE]`)
   rather than started here.
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
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

from tandem.engine.async_engine import AsyncLLMEngine, OutputStream
from tandem.protocol.web import DRAINING_CODE, APIError
from tandem.serving.responses import sse_error

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


class Drain:
    """The requests in flight (each HTTP request's engine output streams, by its id `rid`:
    the engine requests `{rid}-{i}`) and the stop sequence (module doc). One per app."""

    def __init__(self) -> None:
        self.requests: dict[str, list[OutputStream]] = {}

    def track(self, rid: str, queues: list[OutputStream]) -> None:
        self.requests[rid] = queues

    def untrack(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def unstarted(self, waiting: set[str]) -> list[str]:
        """The requests whose every engine request is in `waiting` (none started)."""
        return [rid for rid, queues in self.requests.items()
                if all(f"{rid}-{i}" in waiting for i in range(len(queues)))]

    def cut(self, rids: Iterable[str], why: str) -> int:
        """End these requests' readers with `WorkerDraining(why)` (each once); how many."""
        cut = 0
        for rid in list(rids):
            queues = self.requests.pop(rid, None)
            if queues is not None:
                for q in queues:
                    q.fail(WorkerDraining(why))
                cut += 1
        return cut

    async def guard(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's SSE chunks; a cut ends them with an error event of code
        `DRAINING_CODE` and `[DONE]`."""
        try:
            async for chunk in chunks:
                yield chunk
        except WorkerDraining as exc:
            yield sse_error(503, str(exc), DRAINING_CODE)
            yield "data: [DONE]\n\n"

    async def run(self, engine: AsyncLLMEngine | None, timeout_s: float,
                  in_flight: Callable[[], int], kv_busy: Callable[[], int]) -> None:
        """Steps 2-4 (step 1, the app's `draining` flag, is set before); returns once nothing
        is left (`in_flight()`: HTTP requests being answered; `kv_busy()`: KV leases and
        Prefill calls held here), or once the timeout has passed and the cut requests
        answered."""
        deadline = time.monotonic() + timeout_s
        if engine is not None and engine.alive:
            try:
                waiting = await engine.unstarted_request_ids()
            except Exception as exc:  # noqa: BLE001 - the engine died: the timeout still runs
                logger.warning("drain: the engine's queue could not be read (%s)", exc)
            else:
                handed_back = self.cut(self.unstarted(waiting), "the worker is draining: "
                                       "this queued request was not started; retry on "
                                       "another replica")
                if handed_back:
                    logger.info("drain: %d queued requests handed back (%s)", handed_back,
                                DRAINING_CODE)
        while (in_flight() > 0 or kv_busy() > 0) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self.requests:
            cut = self.cut(list(self.requests), "the worker stopped (drain timeout "
                           f"{timeout_s:g}s) before this request finished; retry on "
                           "another replica")
            logger.warning("drain timeout (%gs): %d running requests ended with %s",
                           timeout_s, cut, DRAINING_CODE)
            end = time.monotonic() + CUT_GRACE_S
            while in_flight() > 0 and time.monotonic() < end:
                await asyncio.sleep(POLL_S)
        elif kv_busy() > 0:
            logger.warning("drain timeout (%gs): KV pages still leased; exiting", timeout_s)
