"""The router's upstream HTTP/1.1 client: pooled keep-alive connections to workers.

Why not aiohttp: measured on this router's forwarding path (a ~1 KB JSON POST, a small JSON
answer, keep-alive, uvloop), aiohttp's client costs ~260 us of CPU per request and this one
~70 us. The router's budget is 1 ms of added latency per request, so the difference is a
quarter of it. Parsing is `httptools` (llhttp, the parser uvicorn uses): status line,
headers, Content-Length and chunked bodies, keep-alive; this module only frames requests,
pools connections and hands body bytes to the consumer.

Contract:
* `post(url, path, body, headers)` returns once the status line and headers are in
  (`UpstreamResponse`), or raises `UpstreamError` (connect failure, connection lost, bad
  HTTP) / `UpstreamTimeout` (connect or header wait over its limit).
* The body is then read whole (`read()`) or chunk by chunk as it arrives (`chunks()`); a gap
  longer than `read_timeout_s` between bytes raises `UpstreamTimeout`; a caller's `stalled`
  check (a frozen worker: silent, and failing its probes) raises `UpstreamStalled` sooner.
* `release()` returns a fully read keep-alive connection to the pool; `close()` (or release
  of an unfinished response) closes it, which is how a client disconnect aborts the request
  on the worker. Idle connections older than `max_idle_s` are not reused (a server may have
  closed them: uvicorn's default keep-alive timeout is 5 s).
* Reading pauses while more than `HIGH_WATER` body bytes wait for the consumer.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 1 << 20  # buffered body bytes at which reading pauses
LOW_WATER = 1 << 18  # ... and resumes
WATCH_S = 0.5  # how often a watched body wait asks whether its worker is stalled


class UpstreamError(Exception):
    """The worker could not be reached, or it broke the connection or the protocol."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """Connect, headers or the next body bytes took longer than allowed."""


class UpstreamStalled(UpstreamError):
    """No body bytes for a while, and the caller's check says the worker is frozen."""


@dataclass
class UpstreamSettings:
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # to the headers, and between body bytes
    max_idle_s: float = 3.0  # idle connections older than this are closed, not reused
    max_idle_per_host: int = 256


class _Connection(asyncio.Protocol):
    """One TCP connection; carries one request at a time."""

    def __init__(self, key: tuple[str, int], open_set: set[_Connection]) -> None:
        self.key = key
        self._open = open_set  # the pool's open connections: left when lost or closed
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.lost = False
        self.idle_since = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response._fail(UpstreamError(f"bad HTTP from the worker: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._open.discard(self)
        r = self.response
        if r is None or r.complete:
            return
        if exc is None and r.status and r._delimited_by_close():  # the body ends at EOF
            r.complete = True
            r._wake()
            return
        r._fail(UpstreamError(
            f"connection lost{f': {exc}' if exc else ''} before the response ended"))

    # -- httptools callbacks ---------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response._headers.append((name.lower(), value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        r = self.response
        r.status = self.parser.get_status_code()  # type: ignore[union-attr]
        r._wake()  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        r = self.response
        r.complete = True  # type: ignore[union-attr]
        r.keep_alive = self.parser.should_keep_alive()  # type: ignore[union-attr]
        r._wake()  # type: ignore[union-attr]

    # ---------------------------------------------------------------------------------------
    def usable(self, now: float, max_idle_s: float) -> bool:
        return (not self.lost and self.transport is not None
                and not self.transport.is_closing() and now - self.idle_since <= max_idle_s)

    def close(self) -> None:
        self.lost = True
        self._open.discard(self)
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """Status and headers of a worker's answer; the body arrives through `read`/`chunks`."""

    def __init__(self, conn: _Connection, pool: UpstreamPool) -> None:
        self._conn = conn
        self._pool = pool
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future | None = None
        self._error: Exception | None = None
        self._done = False  # released or closed
        self.status = 0
        self.complete = False
        self.keep_alive = False

    def _delimited_by_close(self) -> bool:
        """No Content-Length and not chunked: the body runs to the end of the connection."""
        return not any(k == b"content-length" or (k == b"transfer-encoding"
                                                   and b"chunked" in v.lower())
                       for k, v in self._headers)

    @property
    def headers(self) -> list[tuple[str, str]]:
        """(lower-case name, value) pairs, in order."""
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._headers]

    # -- fed by the connection -------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self, timeout_s: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = fut = loop.create_future()
        timer = loop.call_later(timeout_s, self._fail, UpstreamTimeout(
            f"no {what} from the worker within {timeout_s:g} s"))
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    # -- consumer side ---------------------------------------------------------------------
    async def _headers_in(self, timeout_s: float) -> None:
        while not self.status and self._error is None:
            await self._wait(timeout_s, "response headers")
        if not self.status:
            raise self._error  # type: ignore[misc]

    async def _wait_watched(self, timeout_s: float, stalled: Callable[[float], bool]) -> None:
        """`_wait` for body bytes, checking `stalled(seconds silent)` every `WATCH_S`: when
        it says so, the response fails with `UpstreamStalled`."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            silent = loop.time() - start
            if silent >= timeout_s:
                self._fail(UpstreamTimeout(f"no response bytes from the worker within "
                                           f"{timeout_s:g} s"))
                return
            self._waiter = fut = loop.create_future()
            timer = loop.call_later(min(WATCH_S, timeout_s - silent), self._wake)
            try:
                await fut
            finally:
                timer.cancel()
                self._waiter = None
            if self._chunks or self.complete or self._error is not None:
                return
            silent = loop.time() - start
            if stalled(silent):
                self._fail(UpstreamStalled(f"no response bytes for {silent:.1f} s and the "
                                           "worker stopped answering its probes"))
                return

    async def chunks(self, stalled: Callable[[float], bool] | None = None
                     ) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamError / UpstreamTimeout on failure.
        `stalled(seconds silent)`, checked every `WATCH_S` while no byte comes: True
        fails the response (`UpstreamStalled`) before the read timeout."""
        timeout_s = self._pool.settings.read_timeout_s
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered < LOW_WATER:
                    self._resume_reading()
                yield data
            elif self.complete:
                return
            elif self._error is not None:
                raise self._error
            elif stalled is not None:
                await self._wait_watched(timeout_s, stalled)
            else:
                await self._wait(timeout_s, "response bytes")

    def _resume_reading(self) -> None:
        if self._paused and self._conn.transport:
            self._paused = False
            self._conn.transport.resume_reading()

    async def read(self) -> bytes:
        """The whole body (waits for its end; no async generator on this per-request path)."""
        timeout_s = self._pool.settings.read_timeout_s
        while not self.complete:
            if self._error is not None:
                raise self._error
            self._resume_reading()  # the whole body is wanted anyway
            await self._wait(timeout_s, "response bytes")
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return body

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool if the body was read
        to the end and both sides keep it alive; otherwise it is closed."""
        if self._done:
            return
        self._done = True
        if self.complete and self.keep_alive and not self._chunks and self._error is None:
            self._pool._put_back(self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        """Close the connection (the worker sees the client go away)."""
        if not self._done:
            self._done = True
            self._conn.close()


class UpstreamPool:
    """Keep-alive connections per (host, port). Create, use and close on one event loop."""

    def __init__(self, settings: UpstreamSettings | None = None) -> None:
        self.settings = settings or UpstreamSettings()
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}  # base URL -> host, port, Host
        self.opened = 0  # connections opened so far (for tests and metrics)
        self._open: set[_Connection] = set()  # every connection not lost nor closed

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            if u.scheme != "http" or not u.hostname:
                raise UpstreamError(f"unsupported worker URL {base_url!r} (http://host:port)")
            port = u.port or 80
            t = self._targets[base_url] = (u.hostname, port, u.netloc.encode("ascii"))
        return t

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection((host, port), self._open)
        try:
            async with asyncio.timeout(self.settings.connect_timeout_s):
                await loop.create_connection(lambda: conn, host, port)
        except TimeoutError as exc:
            conn.close()
            raise UpstreamTimeout(f"connect to {host}:{port} took over "
                                  f"{self.settings.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {host}:{port}: {exc}") from exc
        self.opened += 1
        if not conn.lost:  # (a connection lost at once has left already)
            self._open.add(conn)
        return conn

    def connections(self) -> tuple[int, int]:
        """(in use, idle) connections now open: one in use carries a request whose response
        is not finished; once every request has ended, a pool leaks none when in use is 0."""
        idle = sum(not c.lost for v in self._idle.values() for c in v)  # lost: pruned on use
        return len(self._open) - idle, idle

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # most recently used first
            if conn.usable(now, self.settings.max_idle_s):
                return conn
            conn.close()
        return None

    def _put_back(self, conn: _Connection) -> None:
        conn.response = None
        conn.parser = httptools.HttpResponseParser(conn)
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.settings.max_idle_per_host:
            conn.close()
        else:
            idle.append(conn)

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: Mapping[str, str], method: bytes = b"POST") -> UpstreamResponse:
        """POST `body` to `base_url + path` (`method` GET for a probe, with an empty body);
        see the module doc. Header values must be single-line (the caller sanitizes anything
        a client sent)."""
        host, port, host_header = self._target(base_url)
        conn = self._take_idle((host, port)) or await self._connect(host, port)
        resp = conn.response = UpstreamResponse(conn, self)
        head = [method, b" ", path.encode("ascii"), b" HTTP/1.1\r\nHost: ", host_header,
                b"\r\nContent-Length: ", str(len(body)).encode("ascii"), b"\r\n"]
        for k, v in headers.items():
            head += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        try:
            conn.transport.writelines([b"".join(head), body])  # type: ignore[union-attr]
            await resp._headers_in(self.settings.read_timeout_s)
        except BaseException:
            resp.close()
            raise
        return resp

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
