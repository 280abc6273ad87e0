"""The lean HTTP/1.1 server (`protocol.http_server`) over real sockets: framing (keep-alive,
pipelining, chunked bodies in and out, HTTP/1.0), limits and malformed input, client
disconnects cancelling the request, the idle timeout, the lifespan and graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.protocol.http_server import ServerLimits
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

    async def finish(request: Request) -> Response:
        await request.body()
        await asyncio.sleep(0.5)
        events.add("finish:done")
        return JSONResponse({"finished": True})

    routes = {"/echo": echo, "/slow": slow, "/stream": stream, "/finish": finish}
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
