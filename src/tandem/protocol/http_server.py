"""A lean HTTP/1.1 server for a `FastPaths` app: the hot POST routes straight to their
handlers, every other route (and the lifespan) through a small ASGI bridge to the app.

Why not uvicorn for the router's front door: measured here at 500 requests/s, uvicorn with
httptools and uvloop spends ~0.28 ms of CPU per request on a bare ASGI callable, a plain
asyncio protocol ~0.11 ms; the router's budget is 1 ms of added latency in all. Parsing is
`httptools` (llhttp, what uvicorn uses); this module frames requests and responses.

Contract:
* HTTP/1.1 keep-alive and pipelining (answers in request order), HTTP/1.0; Content-Length
  and chunked request bodies. Responses are starlette `Response`s (Content-Length) or
  `StreamingResponse`s (chunked, or close-delimited for HTTP/1.0).
* Backpressure, so a client that sends and never reads holds bounded memory: after every
  write (an answer, a stream's chunk), while the transport's buffer is over its high-water
  mark, the connection waits (`pause_writing`/`resume_writing`) and starts no further
  pipelined request. At most `MAX_PIPELINED` parsed requests (`MAX_PIPELINED_BYTES` of them)
  wait behind the one in progress; then reading pauses, and what was read beyond them waits
  unparsed. So a connection buffers at most the high-water mark plus one answer (or chunk)
  for writing, and ~`MAX_PIPELINED_BYTES` + one request of input.
* Send timeout: a client that takes no bytes for `send_timeout_s` while a write waits is cut
  (the transport aborted, its buffer dropped, the request cancelled: a fast route's stream
  is closed at once, so the router's relay closes its upstream connection and the worker
  aborts the request; a stream over the ASGI bridge is left to starlette, which does not
  close its iterator: the collector finalizes it).
* At most `max_connections` connections: one beyond is closed as soon as it is accepted,
  before any byte is read or written (as Envoy's downstream connection limit does), and
  logged; the client retries, on another replica behind a Service.
* Limits: URL <= 8 KiB (414), <= `max_headers` headers and `max_header_bytes` of them (431),
  body <= the app's limit, declared or streamed (413). A malformed request is a 400. Each of
  these is an OpenAI error body, and the connection closes after it. An `Upgrade` request is
  answered as plain HTTP/1.1 (no WebSocket, no h2c), then the connection closes.
* A connection idle for `keep_alive_s` (no request in progress) is closed.
* The client going away cancels its request's task: `finally` blocks run, so the router
  aborts the worker's request. Handlers need no disconnect watcher (`DISCONNECT_CANCELS`).
* SIGTERM/SIGINT start the drain: idle connections close, busy ones read no further
  requests and close after their answers, in-flight requests (streams included) get up to
  `graceful_s` to finish, the rest are cancelled, then the listener closes and the lifespan
  shuts down. During the drain the listener stays open for the kubelet's probes only: a new
  request for `GET /ready` is answered 503 `{"status": "draining"}` (the pod leaves the
  Service's endpoints), `/health` and `/metrics` still reach the app (liveness holds while
  streams finish), and any other new request gets a 503 OpenAI error with `Retry-After: 1`
  and `connection: close` (it never reaches the app).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import signal
from collections.abc import Mapping
from typing import Any

import httptools
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem.protocol.asgi_lifespan import Lifespan
from tandem.protocol.http_wire import (
    DRAIN_OPEN_PATHS,
    MAX_URL_BYTES,
    STATUS_LINES,
    ParsedRequest,
    Reject,
    SendTimeout,
    ServerLimits,
    ServerStats,
    draining_answer,
    frame,
    status_line,
)
from tandem.protocol.web import DISCONNECT_CANCELS, FastPaths, Handler, error_body, serve_route

logger = logging.getLogger(__name__)
GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (default 700)
MAX_PIPELINED = 16  # parsed requests waiting behind the one in progress; then reading pauses
MAX_PIPELINED_BYTES = 1 << 20  # ... or this many bytes of them
FEED_BYTES = 4096  # input is parsed in slices of this, so reading can stop between requests
REFUSED_LOG_S = 10.0  # at most one log line this often about refused connections
_ASGI = {"version": "3.0", "spec_version": "2.3"}


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs them one at a time, in order."""

    def __init__(self, server: LeanServer) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.parsing: ParsedRequest | None = None
        self.last: ParsedRequest | None = None  # the last complete request parsed
        self.pending: collections.deque[ParsedRequest] = collections.deque()
        self.pending_bytes = 0
        self.backlog = b""  # read while the pipeline was full, parsed once it empties
        self.task: asyncio.Task | None = None
        self.gone: asyncio.Future | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.broken = False  # a parse error or a drain: read no more, close after the answers
        self.reading_paused = False
        self.write_waiter: asyncio.Future | None = None
        self.write_paused = False
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= self.limits.max_connections:
            self.broken = True  # never read, never registered
            self.server.refuse()
            transport.close()
            return
        self.client = transport.get_extra_info("peername")
        self.local = transport.get_extra_info("sockname")
        self.gone = self.server.loop.create_future()
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        if self.idle is not None:
            self.idle.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client is gone: abort its request
        self.pending.clear()
        self.pending_bytes = 0
        self.backlog = b""
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        if self._feed(data) and self.task is None and not self.pending:
            self._arm_idle()  # a partial request also counts as idle

    def _feed(self, data: bytes) -> bool:
        """Parse `data` slice by slice; once the pipeline is full, keep the rest unparsed
        (`backlog`) and pause reading. False when the input was bad or an upgrade."""
        try:
            if len(data) <= FEED_BYTES:
                self.parser.feed_data(data)
                return True
            for at in range(0, len(data), FEED_BYTES):
                if self._pipeline_full():
                    self.backlog = data[at:]
                    self._pause_reading()
                    return True
                self.parser.feed_data(data[at:at + FEED_BYTES])
        except httptools.HttpParserUpgrade:  # answered as plain HTTP/1.1, then closed: what
            self.broken = True  # follows the request is in the other protocol
            if self.last is not None:
                self.last.keep_alive = False
            if self.task is None and not self.pending:
                self.close()
            return False
        except httptools.HttpParserError as exc:
            ctx = exc.__context__
            self._broken(ctx if isinstance(ctx, Reject)
                         else Reject(400, "malformed HTTP request"))
            return False
        return True

    def _pipeline_full(self) -> bool:
        return len(self.pending) >= MAX_PIPELINED or self.pending_bytes >= MAX_PIPELINED_BYTES

    def _pause_reading(self) -> None:
        if self.transport is not None and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.parsing = ParsedRequest()

    def on_url(self, url: bytes) -> None:
        r = self.parsing
        r.url += url  # type: ignore[union-attr]
        if len(r.url) > MAX_URL_BYTES:  # type: ignore[union-attr]
            raise Reject(414, f"the URL exceeds {MAX_URL_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.parsing
        r.headers.append((name.lower(), value))  # type: ignore[union-attr]
        r.size += len(name) + len(value)  # type: ignore[union-attr]
        if (len(r.headers) > self.limits.max_headers  # type: ignore[union-attr]
                or r.size > self.limits.max_header_bytes):  # type: ignore[union-attr]
            raise Reject(431, "too many or too large request headers")

    def on_headers_complete(self) -> None:
        r = self.parsing
        p = self.parser
        r.method = p.get_method()  # type: ignore[union-attr]
        r.version = p.get_http_version()  # type: ignore[union-attr]
        r.keep_alive = p.should_keep_alive()  # type: ignore[union-attr]
        r.nbytes = len(r.url) + r.size  # type: ignore[union-attr]
        r.size = 0  # type: ignore[union-attr]
        limit = self.server.body_limit
        for k, v in r.headers:  # type: ignore[union-attr]
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                raise Reject(413, f"request body exceeds {limit} bytes")
            if k == b"expect" and v.lower() == b"100-continue" and self.transport:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        r = self.parsing
        r.size += len(body)  # type: ignore[union-attr]
        if r.size > self.server.body_limit:  # type: ignore[union-attr]
            raise Reject(413, f"request body exceeds {self.server.body_limit} bytes")
        r.parts.append(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        r = self.parsing
        r.nbytes += r.size  # type: ignore[union-attr]
        self.pending.append(r)  # type: ignore[arg-type]
        self.pending_bytes += r.nbytes  # type: ignore[union-attr]
        self.last, self.parsing = r, None
        if self.task is None:
            self._next()
        elif self._pipeline_full():
            self._pause_reading()

    # -- running requests -----------------------------------------------------------------
    def _broken(self, reject: Reject) -> None:
        self.broken = True
        r = ParsedRequest()
        r.reject, r.keep_alive = reject, False
        self.pending.append(r)
        if self.task is None:
            self._next()

    def _next(self) -> None:
        if self.transport is None:
            return
        if not self.pending:
            if self.broken:
                self.close()
                return
            if self.reading_paused:
                self.reading_paused = False
                self.transport.resume_reading()
                backlog, self.backlog = self.backlog, b""
                if backlog:  # may start the next request, or fill the pipeline again
                    self._feed(backlog)
                    if self.busy or self.transport is None or self.broken:
                        return
            self._arm_idle()
            return
        req = self.pending.popleft()
        self.pending_bytes -= req.nbytes
        self.task = self.server.loop.create_task(self._serve(req))
        self.task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task) -> None:
        self.task = None
        if task.cancelled():
            self.close()
            return
        if isinstance(task.exception(), SendTimeout):
            self.close()  # aborted already
            return
        if task.exception() is not None:
            logger.error("request handling failed", exc_info=task.exception())
            self.close()
            return
        if self.transport is not None and task.result():
            self._next()
        else:
            self.close()

    async def _serve(self, req: ParsedRequest) -> bool:
        """Answer one request; True to keep the connection for the next."""
        if req.reject is not None:
            rej = req.reject
            await self._respond(req, JSONResponse(error_body(rej.status, rej.message),
                                                  status_code=rej.status))
            return False
        path, _, query = req.url.partition(b"?")
        if self.server.draining and path not in DRAIN_OPEN_PATHS:
            req.keep_alive = False
            await self._respond(req, draining_answer(path))
            return False
        handler = self.server.routes.get(path) if req.method == b"POST" else None
        if handler is not None:
            body = b"".join(req.parts)
            scope = self._scope(req, path, query, {DISCONNECT_CANCELS: {}})
            request = Request(scope, self._receiver(body))
            request._body = body  # `body()` answers at once (no receive-stream generator)
            response = await serve_route(handler, request)
            await self._respond(req, response)
        else:
            await self._asgi(req, path, query)
        return req.keep_alive

    def _scope(self, req: ParsedRequest, path: bytes, query: bytes,
               extensions: dict[str, Any]) -> dict[str, Any]:
        return {"type": "http", "asgi": _ASGI, "http_version": req.version,
                "method": req.method.decode("ascii"), "scheme": "http",
                "path": path.decode("latin-1"), "raw_path": path, "query_string": query,
                "root_path": "", "headers": req.headers, "client": self.client,
                "server": self.local, "state": {}, "app": self.server.app,
                "extensions": extensions}

    def _receiver(self, body: bytes):  # noqa: ANN202 - an ASGI receive callable
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.shield(self.gone)  # type: ignore[arg-type]
            return {"type": "http.disconnect"}

        return receive

    def _head(self, req: ParsedRequest, status: int, headers: list[tuple[bytes, bytes]],
              chunked: bool) -> bytes:
        out = [STATUS_LINES.get(status) or status_line(status)]
        out += [k + b": " + v + b"\r\n" for k, v in headers]
        if chunked:
            out.append(b"transfer-encoding: chunked\r\n")
        if not req.keep_alive:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        return b"".join(out)

    async def _respond(self, req: ParsedRequest, response: Response) -> None:
        t = self.transport
        if t is None:
            return
        headers = response.raw_headers
        if not isinstance(response, StreamingResponse):
            head = self._head(req, response.status_code, headers, chunked=False)
            await self._write(head if req.method == b"HEAD" else head + response.body)
        else:
            await self._stream(req, response)
        if response.background is not None:
            await response.background()

    async def _stream(self, req: ParsedRequest, response: StreamingResponse) -> None:
        chunked = req.version == "1.1" and req.keep_alive
        if not chunked:
            req.keep_alive = False  # the body ends when the connection does
        it = response.body_iterator
        try:  # the head at once (a client may time out waiting for it), not with a token
            await self._write(self._head(req, response.status_code, response.raw_headers,
                                         chunked))
            async for chunk in it:
                data = chunk if isinstance(chunk, bytes) else chunk.encode(response.charset)
                if not data or self.transport is None:
                    continue
                await self._write(frame(data, chunked))
            if chunked and self.transport is not None:
                await self._write(b"0\r\n\r\n")
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _write(self, data: bytes) -> None:
        """Write, then wait while the transport is over its high-water mark (module doc)."""
        t = self.transport
        if t is None:
            return
        t.write(data)
        size = t.get_write_buffer_size()
        if size > self.server.peak_write_buffered:
            self.server.peak_write_buffered = size
        if self.write_paused:
            await self._drain()

    async def _drain(self) -> None:
        """Wait for `resume_writing`; `SendTimeout` (the connection aborted) when it does
        not come within `send_timeout_s`."""
        loop = self.server.loop
        deadline = loop.time() + self.limits.send_timeout_s
        while self.write_paused and self.transport is not None:
            left = deadline - loop.time()
            if left <= 0:
                logger.info("client %s took no bytes for %g s: connection cut",
                            self.client, self.limits.send_timeout_s)
                self.broken = True  # nothing more is read or answered
                self.pending.clear()
                self.pending_bytes = 0
                self.transport.abort()  # drops the buffer; connection_lost follows
                self.transport = None
                raise SendTimeout
            self.write_waiter = waiter = loop.create_future()
            timer = loop.call_later(left, self._wake_writer)
            try:
                await waiter
            finally:
                timer.cancel()

    def _wake_writer(self) -> None:
        w = self.write_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _asgi(self, req: ParsedRequest, path: bytes, query: bytes) -> None:
        """Any other route: the app over ASGI."""
        state = {"chunked": False, "started": False, "done": False}
        is_head = req.method == b"HEAD"

        async def send(message: Mapping[str, Any]) -> None:
            if self.transport is None:
                return
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                sized = any(k.lower() == b"content-length" for k, _ in headers)
                state["chunked"] = not sized and not is_head and req.version == "1.1"
                if not sized and not state["chunked"]:
                    req.keep_alive = False
                state["started"] = True
                await self._write(self._head(req, message["status"], headers,
                                             state["chunked"]))
            elif message["type"] == "http.response.body" and not state["done"]:
                data = message.get("body", b"")
                out = frame(data, state["chunked"]) if data and not is_head else b""
                if not message.get("more_body", False):
                    state["done"] = True
                    if state["chunked"]:
                        out += b"0\r\n\r\n"  # with the last piece: one write
                if out:
                    await self._write(out)

        scope = self._scope(req, path, query, {})  # FastAPI watches for disconnects itself
        try:
            await self.server.app(scope, self._receiver(b"".join(req.parts)), send)
        except SendTimeout:
            raise
        except Exception:
            logger.exception("unhandled error on %s", path.decode("latin-1"))
            if not state["started"] and self.transport is not None:
                await self._respond(req, JSONResponse(
                    error_body(500, "internal error", type_="server_error"), status_code=500))
                state["done"] = True
        if not state["done"]:
            req.keep_alive = False  # an unfinished answer: only closing ends it

    # -- lifecycle -------------------------------------------------------------------------
    def _arm_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.idle = self.server.loop.call_later(self.limits.keep_alive_s, self.close)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    @property
    def busy(self) -> bool:
        return self.task is not None or bool(self.pending)


class LeanServer:
    """Serves one `FastPaths` app on (host, port); `serve()` runs until `stop()` (or a
    signal, with `install_signals`)."""

    def __init__(self, app: FastPaths, host: str, port: int,
                 limits: ServerLimits | None = None, reuse_port: bool = False) -> None:
        self.reuse_port = reuse_port  # SO_REUSEPORT: several processes share the port
        self.app = app.app
        self.routes: dict[bytes, Handler] = {p.encode(): h for p, h in app.routes.items()}
        self.body_limit = app.limit
        self.host, self.port = host, port
        self.limits = limits or ServerLimits()
        self.connections: set[_Connection] = set()
        self.started = False
        self.peak_write_buffered = 0  # see `ServerStats`
        self.refused = 0
        self._refused_logged = float("-inf")
        self.draining = False  # set at the stop: new requests get `draining_answer`
        self._stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def serve(self, install_signals: bool = False, freeze_gc: bool = False) -> None:
        """`freeze_gc`: after start-up, move every object alive then (modules, tokenizers,
        compiled templates) out of the cyclic collector's sight (`gc.freeze`), so its full
        passes walk only what requests allocate, and collect the young generation less often
        (measured: ~9 % of the router's CPU went to the collector before). For a server
        process, not a test harness (it changes process-wide settings)."""
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        lifespan = Lifespan(self.app)
        await lifespan.startup()
        if freeze_gc:
            gc.collect()
            gc.freeze()
            # a request allocates ~10^2 tracked objects that die with it (by refcount); at
            # the default 700 a young-generation pass ran every few requests and walked the
            # ones still in flight
            gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
        server = await self.loop.create_server(lambda: _Connection(self), self.host, self.port,
                                               backlog=2048, reuse_address=True,
                                               reuse_port=self.reuse_port or None)
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.loop.add_signal_handler(sig, self._stop.set)
        self.started = True
        try:
            await self._stop.wait()
            await self._drain_connections()
        finally:
            server.close()
            for c in list(self.connections):
                if c.task is not None:
                    c.task.cancel()
                c.close()
            await server.wait_closed()
            await lifespan.shutdown()

    def stop(self) -> None:
        """Thread-unsafe; from another thread use `loop.call_soon_threadsafe(server.stop)`."""
        if self._stop is not None:
            self._stop.set()

    def refuse(self) -> None:
        """Count (and now and then log) a connection closed at accept."""
        self.refused += 1
        now = self.loop.time()
        if now - self._refused_logged >= REFUSED_LOG_S:
            self._refused_logged = now
            logger.warning("%d connections open (the most, --max-connections): new ones are "
                           "closed at accept (%d so far)", self.limits.max_connections,
                           self.refused)

    def stats(self) -> ServerStats:
        """What the connections hold now. Call it on the server's loop."""
        conns = list(self.connections)
        return ServerStats(
            connections=len(conns),
            write_buffered=sum(c.transport.get_write_buffer_size() for c in conns
                               if c.transport is not None),
            pending_requests=sum(len(c.pending) for c in conns),
            pending_bytes=sum(c.pending_bytes + len(c.backlog) for c in conns),
            peak_write_buffered=self.peak_write_buffered, refused=self.refused)

    async def _drain_connections(self) -> None:
        """Idle connections close now; busy ones answer what they have already received
        (no new requests are read: `broken`) and close; the caller cuts whatever is still
        running at `graceful_s`. Connections made meanwhile get `draining_answer`s."""
        self.draining = True
        busy = [c for c in self.connections if c.busy]
        for c in list(self.connections):
            if c.busy:
                c.broken = True
            else:
                c.close()
        logger.info("draining: %d requests in flight, up to %.0fs", len(busy),
                    self.limits.graceful_s)
        deadline = self.loop.time() + self.limits.graceful_s
        while any(c.busy for c in busy) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = sum(1 for c in busy if c.busy)
        if cut:
            logger.warning("drain deadline (%.0fs): cutting %d requests still running",
                           self.limits.graceful_s, cut)


async def serve_with(server: LeanServer, side: list[LeanServer]) -> None:
    """Run `side` servers (e.g. a metrics port) alongside `server`: they listen first (a
    failure to bind one stops start-up), `server` takes the signals, and they stop after its
    drain."""
    tasks = [asyncio.create_task(s.serve()) for s in side]
    try:
        while not all(s.started for s in side):
            for t in tasks:
                if t.done():
                    t.result()  # raises what stopped it
                    raise RuntimeError("a side server stopped during start-up")
            await asyncio.sleep(0.01)
        await server.serve(install_signals=True, freeze_gc=True)
    finally:
        for s in side:
            s.stop()
        await asyncio.gather(*tasks, return_exceptions=True)


def run(app: FastPaths, host: str, port: int, limits: ServerLimits | None = None,
        reuse_port: bool = False, side: list[tuple[FastPaths, int]] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, on uvloop when it is installed (a process entry point:
    it also freezes the start-up heap, see `LeanServer.serve`). `side`: (app, port) pairs
    served alongside on `host` (`serve_with`)."""
    server = LeanServer(app, host, port, limits, reuse_port)
    others = [LeanServer(a, host, p, limits, reuse_port) for a, p in side or ()]
    main = serve_with(server, others)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
