"""The readiness probes' HTTP client: GETs over the router's own upstream pool.

`WorkerMonitor` probes every worker each `probe_interval_s` (`GET /ready`, or `/health` and
`/v1/models` for a stock vLLM server). Through httpx one probe cost the event loop ~1 ms of
CPU; through `upstream.UpstreamPool` (the forwarding path's keep-alive connections, llhttp
parsing) a small fraction of that, which adds up on a fleet: 64 workers are 64 probes a
second on the loop that routes.

Contract: `get(url, timeout)` returns a `ProbeAnswer` (status and the whole body) or raises
`UpstreamError` (connect failure, broken connection or HTTP, a body over `MAX_PROBE_BYTES`)
/ `UpstreamTimeout` (the whole exchange took over `timeout` seconds). A failed probe's
connection is closed, never reused. Each probe is logged at DEBUG (`tandem.router.probe`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tandem.router.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)

logger = logging.getLogger(__name__)
MAX_PROBE_BYTES = 4 << 20  # the longest probe answer read (a /v1/models of many adapters)


@dataclass(frozen=True)
class ProbeAnswer:
    """One probe's answer: HTTP status and body bytes."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return json.loads(self.content)


class UpstreamProbe:
    """`get` over `pool` (the pool and its connections belong to the router's loop)."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool

    async def get(self, url: str, timeout: float) -> ProbeAnswer:
        """GET `url` (http://host:port/path); see the module doc."""
        u = urlsplit(url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            async with asyncio.timeout(timeout):
                resp = await self.pool.post(f"{u.scheme}://{u.netloc}", path, b"", {},
                                            method=b"GET")
                try:
                    body = await _read(resp)
                except BaseException:
                    resp.close()  # a failed answer's connection is never reused
                    raise
                resp.release()  # back to the pool (read to its end)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"GET {url} took over {timeout:g} s") from exc
        if logger.isEnabledFor(logging.DEBUG):  # every probe, at DEBUG only
            logger.debug('HTTP Request: GET %s "HTTP/1.1 %d"', url, resp.status)
        return ProbeAnswer(resp.status, body)


async def _read(resp: UpstreamResponse) -> bytes:
    """The whole body, at most `MAX_PROBE_BYTES` (UpstreamError past it)."""
    chunks, size = [], 0
    async with contextlib.aclosing(resp.chunks()) as body:
        async for data in body:
            size += len(data)
            if size > MAX_PROBE_BYTES:
                raise UpstreamError(f"probe answer over {MAX_PROBE_BYTES} bytes")
            chunks.append(data)
    return b"".join(chunks)
