"""The lean HTTP/1.1 server (`protocol.http_server`) over real sockets: framing (keep-alive,
pipelining, chunked bodies in and out, HTTP/1.0), limits and malformed input, client
disconnects cancelling the request, the idle timeout, the lifespan and graceful stop."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.protocol.http_server import FEED_BYTES, MAX_PIPELINED, ServerLimits
from tandem.protocol.web import FastPaths, install_error_handlers
from tests.router.test_router_app import Served

LIMIT = 4096


class Events:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.cond = threading.Condition()

    def add(self, what: str) -> None:
        with self.cond:
            self.log.append(what)
            self.cond.notify_all()

    def wait_for(self, what: str, timeout: float = 5.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: what in self.log, timeout)


def make_app(events: Events) -> FastPaths:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        events.add("startup")
        yield
        events.add("shutdown")

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/hello")
    async def hello() -> dict:
        return {"hello": "world"}

    @app.get("/big")
    async def big(n: int, id: str = "") -> Response:  # noqa: A002 - the request's id
        events.add("big")
        return Response(f"{id}:".encode() + b"x" * n, media_type="text/plain")

    @app.get("/chunks")
    async def chunks() -> StreamingResponse:  # no Content-Length: chunked via the bridge
        async def gen() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"part{i};".encode()
        return StreamingResponse(gen(), media_type="text/plain")

    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse({"len": len(body), "head": body[:20].decode("latin-1"),
                             "id": request.headers.get("x-id")})

    async def slow(request: Request) -> Response:
        await request.body()
        events.add("slow:start")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.add("slow:cancelled")
            raise
        return JSONResponse({})

    async def stream(request: Request) -> Response:
        n = int((await request.body()) or b"3")

        async def gen() -> AsyncIterator[str]:
            try:
                for i in range(n):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01 if n < 100 else 0.05)
            finally:
                events.add("stream:closed")
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def flood(request: Request) -> Response:
        """16 KiB chunks as fast as they are taken, until the client goes."""
        await request.body()

        async def gen() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"f" * (16 << 10)
                    await asyncio.sleep(0)
            finally:
                events.add("flood:closed")
        return StreamingResponse(gen(), media_type="text/plain")

    async def finish(request: Request) -> Response:
        await request.body()
        await asyncio.sleep(0.5)
        events.add("finish:done")
        return JSONResponse({"finished": True})

    routes = {"/echo": echo, "/slow": slow, "/stream": stream, "/finish": finish,
              "/flood": flood}
    return FastPaths(app, routes, LIMIT)


class Lean(Served):
    """The lean server with `make_app` on a real port, in a thread."""

    def __init__(self, limits: ServerLimits | None = None) -> None:
        self.events = Events()
        super().__init__(make_app(self.events), lean=True, limits=limits)

    def stop(self) -> None:
        super().stop()
        assert not self.thread.is_alive()

    def raw(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


@pytest.fixture(scope="module")
def lean():
    server = Lean(ServerLimits(max_headers=20, max_header_bytes=2048, keep_alive_s=5.0))
    yield server
    server.stop()


def read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def read_responses(sock: socket.socket, n: int) -> list[bytes]:
    """`n` Content-Length framed responses off one keep-alive connection."""
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(rest) < length:
            rest += sock.recv(65536)
        out.append(head + b"\r\n\r\n" + rest[:length])
        buf = rest[length:]
    return out


def test_fast_routes_the_app_routes_and_keep_alive(lean):
    with httpx.Client(base_url=lean.url) as c:
        for i in range(3):  # one connection, several requests
            r = c.post("/echo", content=b"x" * (100 + i), headers={"x-id": str(i)})
            assert r.status_code == 200 and r.json() == {"len": 100 + i, "head": "x" * 20,
                                                         "id": str(i)}
        assert c.get("/hello").json() == {"hello": "world"}
        r = c.get("/chunks")
        assert r.text == "part0;part1;part2;" and r.headers["transfer-encoding"] == "chunked"
        r = c.get("/nowhere")
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        assert c.get("/echo").status_code == 404  # fast paths are POST only; FastAPI has no /echo
        assert c.head("/hello").content == b""
    assert lean.events.wait_for("startup")


def test_pipelined_requests_are_answered_in_order(lean):
    with lean.raw() as s:
        reqs = b"".join(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Id: %d\r\nContent-Length: %d"
                        b"\r\n\r\n%b" % (i, i + 1, b"y" * (i + 1)) for i in range(5))
        s.sendall(reqs + b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = read_responses(s, 6)
    for i, a in enumerate(answers[:5]):
        assert a.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b'"id":"%d"' % i in a and b'"len":%d' % (i + 1) in a
    assert answers[5].endswith(b'{"hello":"world"}')


def test_chunked_request_body_and_expect_continue(lean):
    with lean.raw() as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Expect: 100-continue\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        (answer,) = read_responses(s, 1)
    assert b'"len":11' in answer and b'"head":"hello world"' in answer


def test_http10_closes_after_the_answer(lean):
    with lean.raw() as s:
        s.sendall(b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nab")
        data = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in data.lower()
    assert data.endswith(b'"len":2,"head":"ab","id":null}')


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nContent-Length: nope\r\n\r\n", 400),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /hello HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(30)) + b"\r\n",
     431),
    (b"GET /hello HTTP/1.1\r\nX-Big: " + b"v" * 3000 + b"\r\n\r\n", 431),
    (b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1), 413),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"400\r\n" + b"z" * 1024 + b"\r\n" * 1 + (b"400\r\n" + b"z" * 1024 + b"\r\n") * 4, 413),
])
def test_bad_requests_get_an_openai_error_and_the_connection_closes(lean, request_bytes,
                                                                    status):
    with lean.raw() as s:
        s.sendall(request_bytes)
        data = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 %d " % status), data[:80]
    assert b'"code":%d' % status in data and b"connection: close" in data.lower()
    assert httpx.get(lean.url + "/hello").status_code == 200  # the server lives on


def test_an_upgrade_request_gets_plain_http_then_the_connection_closes(lean):
    with lean.raw() as s:
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                  b"Upgrade: websocket\r\n\r\n\x81\x05hello")  # then a WebSocket frame
        data = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b'{"hello":"world"}')
    assert b"connection: close" in data.lower()


def test_streamed_answers_are_chunked_and_flow(lean):
    with httpx.Client(base_url=lean.url) as c, c.stream("POST", "/stream", content=b"5") as r:
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events == [f"data: {i}" for i in range(5)]


def test_client_gone_mid_stream_closes_the_generator(lean):
    with lean.raw() as s:
        s.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n500")
        got = b""
        while b"data: 1" not in got:
            got += s.recv(4096)
        assert got.startswith(b"HTTP/1.1 200 OK")
    assert lean.events.wait_for("stream:closed")


def test_client_gone_cancels_the_request(lean):
    with lean.raw() as s:
        s.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert lean.events.wait_for("slow:start")
    assert lean.events.wait_for("slow:cancelled")


def test_idle_connections_close_and_lifespan_and_graceful_stop():
    server = Lean(ServerLimits(keep_alive_s=0.3, graceful_s=5.0))
    try:
        assert server.events.wait_for("startup")
        with server.raw() as s:
            s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
            t0 = time.monotonic()
            data = read_until_closed(s)  # answered, then closed once idle
        assert data.endswith(b'{"hello":"world"}') and time.monotonic() - t0 < 3
        results: list[httpx.Response] = []
        t = threading.Thread(target=lambda: results.append(httpx.post(server.url + "/finish")))
        t.start()
        time.sleep(0.2)  # in flight when the stop comes: it still completes
    finally:
        server.stop()
    t.join(timeout=5)
    assert results and results[0].json() == {"finished": True}
    assert server.events.log[-2:] == ["finish:done", "shutdown"]


# -- backpressure, send timeout, connection cap ---------------------------------------------
def on_loop(server: Lean, fn):  # noqa: ANN001, ANN201 - fn() run on the server's loop
    done: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)

    server.server.loop.call_soon_threadsafe(call)
    return done.result(5)


def held(server: Lean) -> tuple[int, int, int]:
    """(connections, bytes waiting in their transports, the transports' high-water mark)."""
    def measure() -> tuple[int, int, int]:
        conns = [c for c in server.server.connections if c.transport is not None]
        high = max((c.transport.get_write_buffer_limits()[1] for c in conns), default=0)
        return (len(server.server.connections),
                sum(c.transport.get_write_buffer_size() for c in conns), high)
    return on_loop(server, measure)


def stalled_client(server: Lean) -> socket.socket:
    """A client with a 4 KiB receive buffer (it will read little or nothing); the server's
    side of it gets a 4 KiB send buffer too, so what the client leaves unread piles up in
    the server's transport, not in the kernels."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect(("127.0.0.1", server.port))
    me = s.getsockname()

    def shrink() -> bool:
        for c in server.server.connections:
            if c.client == me and c.transport is not None:
                c.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                                socket.SO_SNDBUF, 4096)
                return True
        return False
    assert wait_until(lambda: on_loop(server, shrink))
    return s


def wait_until(pred, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def settled_count(events: Events, what: str, quiet_s: float = 0.4,
                  timeout: float = 20.0) -> int:
    """How many `what` events, once no new one came for `quiet_s`."""
    deadline = time.monotonic() + timeout
    last = -1
    while (now := events.log.count(what)) != last and time.monotonic() < deadline:
        last = now
        time.sleep(quiet_s)
    return last


def test_a_client_that_pipelines_and_never_reads_holds_bounded_memory():
    """The probe: thousands of pipelined GETs, nothing read. The server stops answering
    once the transport is over its high-water mark (so it holds at most that plus one
    answer), and frees everything when the client goes."""
    server = Lean(ServerLimits(send_timeout_s=60))
    n, size = 2000, 32 << 10
    try:
        with stalled_client(server) as s:
            s.sendall(b"".join(b"GET /big?n=%d&id=%d HTTP/1.1\r\nHost: x\r\n\r\n" % (size, i)
                               for i in range(n)))
            answered = settled_count(server.events, "big")
            conns, buffered, high = held(server)
            assert conns == 1 and high > 0
            assert buffered <= high + size + 1024, (buffered, high)
            assert answered < n / 4  # the rest wait: read, or parked unparsed
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # RST
        assert wait_until(lambda: held(server)[:2] == (0, 0)), held(server)
        assert httpx.get(server.url + "/hello").json() == {"hello": "world"}
    finally:
        server.stop()


def _request(rng: random.Random, i: int) -> tuple[bytes, tuple]:
    kind = rng.choice(("big", "big", "echo", "hello"))
    if kind == "big":
        n = rng.choice((0, 10, 5000, 70_000, 150_000))
        return b"GET /big?n=%d&id=%d HTTP/1.1\r\nHost: x\r\n\r\n" % (n, i), ("big", i, n)
    if kind == "echo":
        n = rng.randint(0, 3000)
        return (b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Id: %d\r\nContent-Length: %d\r\n\r\n%b"
                % (i, n, b"e" * n), ("echo", i, n))
    return b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n", ("hello", i, 0)


def _take_answers(buf: bytearray, expected: collections.deque) -> None:
    """Check and drop every complete answer at the head of `buf`, in request order."""
    while (end := buf.find(b"\r\n\r\n")) >= 0:
        head = bytes(buf[:end]).split(b"\r\n")
        length = next(int(h.split(b":")[1]) for h in head if h.lower().startswith(
            b"content-length:"))
        if len(buf) < end + 4 + length:
            return
        body = bytes(buf[end + 4:end + 4 + length])
        del buf[:end + 4 + length]
        kind, i, n = expected.popleft()
        assert head[0] == b"HTTP/1.1 200 OK", (head, kind, i)
        if kind == "big":
            assert body == b"%d:" % i + b"x" * n, (kind, i, len(body))
        elif kind == "echo":
            assert json.loads(body) == {"len": n, "head": "e" * min(n, 20), "id": str(i)}
        else:
            assert body == b'{"hello":"world"}'


class _Pipeliner:
    """A non-blocking client: queued requests go out as the socket takes them; answers are
    checked against `expected` as they complete."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.expected: collections.deque = collections.deque()
        self.outbox, self.buf, self.seq = bytearray(), bytearray(), 0

    def send(self, data: bytes, want: tuple) -> None:
        self.outbox += data
        self.expected.append(want)
        self.seq += 1

    def pump(self, want: int) -> None:
        """Send what the socket takes, read up to `want` bytes, check complete answers."""
        with contextlib.suppress(BlockingIOError):
            while self.outbox:
                del self.outbox[:self.sock.send(self.outbox)]
        with contextlib.suppress(BlockingIOError):
            while want > 0 and (got := self.sock.recv(min(want, 65536))):
                self.buf.extend(got)
                want -= len(got)
        _take_answers(self.buf, self.expected)


def test_random_interleavings_keep_buffers_bounded_and_answer_each_request_once_in_order():
    """Seeded: random pipelined batches, partial reads and pauses on real sockets. Every
    request read gets exactly one answer, in order; no connection's transport ever holds
    more than its high-water mark plus one answer; requests parked in the pipeline stay
    within `MAX_PIPELINED` plus one parse slice of them."""
    rng = random.Random(1307)
    server = Lean(ServerLimits(send_timeout_s=60))
    biggest = 150_000 + 300  # the largest answer, head included
    try:
        for _ in range(5):
            c = _Pipeliner(stalled_client(server))
            for _ in range(40):
                op = rng.random()
                if op < 0.4:
                    for _ in range(rng.randint(1, 12)):
                        c.send(*_request(rng, c.seq))
                    c.pump(0)
                elif op < 0.8:
                    c.pump(rng.choice((1, 100, 4096, 100_000)))
                else:
                    time.sleep(rng.random() * 0.01)
                stats = on_loop(server, server.server.stats)
                assert stats.pending_requests <= MAX_PIPELINED + FEED_BYTES // 33
            deadline = time.monotonic() + 20
            while c.expected or c.outbox:
                assert time.monotonic() < deadline, (len(c.expected), len(c.outbox))
                c.pump(1 << 20)
                time.sleep(0.001)
            assert not c.buf
            high = held(server)[2]
            c.sock.close()
            stats = on_loop(server, server.server.stats)
            assert stats.peak_write_buffered <= high + biggest, (stats, high)
            assert wait_until(lambda: held(server)[:2] == (0, 0))
        assert on_loop(server, server.server.stats).peak_write_buffered > high  # it was tested
    finally:
        server.stop()


def test_a_stalled_stream_is_cut_after_the_send_timeout():
    """A streaming client that stops reading: after `send_timeout_s` without progress the
    connection is aborted and the answer's generator closed (a relay would close its
    upstream); what the transport held stays within high-water + one chunk."""
    server = Lean(ServerLimits(send_timeout_s=0.5))
    try:
        with stalled_client(server) as s:
            high = held(server)[2]
            s.sendall(b"POST /flood HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            t0 = time.monotonic()
            assert server.events.wait_for("flood:closed", timeout=15)
            assert time.monotonic() - t0 < 10
            assert on_loop(server, server.server.stats).peak_write_buffered <= high + (17 << 10)
            assert wait_until(lambda: held(server)[:2] == (0, 0))
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                while s.recv(65536):  # what was sent, then the end: the server cut it
                    pass
    finally:
        server.stop()


def test_connections_beyond_the_cap_are_closed_at_accept():
    server = Lean(ServerLimits(max_connections=2))
    try:
        held_open = [server.raw(), server.raw()]
        for c in held_open:  # both served (and so registered)
            c.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_responses(c, 1)[0].endswith(b'{"hello":"world"}')
        with server.raw() as extra, contextlib.suppress(ConnectionResetError):
            extra.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(100) == b""  # closed, never answered
        assert on_loop(server, server.server.stats).refused == 1
        held_open.pop().close()
        assert wait_until(lambda: held(server)[0] == 1)
        assert httpx.get(server.url + "/hello").json() == {"hello": "world"}  # room again
        held_open.pop().close()
    finally:
        server.stop()
