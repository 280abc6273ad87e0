"""The router's front door over real sockets: answers name no worker (a pod address) unless
`debug_headers`, a failed connect's 502 names no address, `/metrics` needs a key when API keys
are on or lives on its own port, FastAPI's docs are off, and a streaming client that stops
reading is cut after the send timeout, which closes the worker's stream (the worker aborts
the request), with the router's buffers bounded meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.protocol.http_server import ServerLimits
from tandem.protocol.signing import WorkerKey
from tandem.protocol.web import APIError
from tandem.router.app import RouterServerSettings, build_app, metrics_app
from tandem.router.auth import ApiKeys
from tandem.router.core import Router, RouterSettings
from tandem.router.main import FrontDoor, add_router_args, build, front_door
from tandem.router.pd import Route
from tandem.router.policy import Decision
from tandem.router.proxy import ProxySettings, forward, upstream_session
from tandem.router.workers import Worker
from tests.protocol.test_http_server import held, on_loop, stalled_client, wait_until
from tests.router.stub_worker import slow_stream, stream_shape
from tests.router.test_router_app import Served, _wait_ready, router_app, stub_base
from tests.router.test_router_lifecycle import Router as RouterProcess
from tests.serving.helpers import free_port, worker_key_file

CHUNK = 8 << 10  # the flooding stream's SSE data per event
TIMING = "engine;dur=1.500, total;dur=2.000"
READ_MAX = 256 << 10  # the most one upstream read delivers (asyncio), relayed as one chunk


class FloodWorker:
    """A stock-OpenAI-shaped worker (/health, /v1/models, completions with server-timing);
    `slow_stream(chunks)`'s header bounds a stream, else it streams until the client goes, and
    `closed` is set when its stream ends for any reason."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.streams = 0
        self.served = Served(self.app(), lean=False)
        self.url = self.served.url

    def app(self) -> FastAPI:
        app = stub_base()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            if not body.get("stream"):
                return JSONResponse({"id": "x", "object": "text_completion", "choices": [
                    {"index": 0, "text": "hi", "finish_reason": "length"}]},
                    headers={"server-timing": TIMING})
            limit = stream_shape(request, 0)[0] or None
            self.streams += 1

            async def events():  # noqa: ANN202
                try:
                    i = 0
                    while limit is None or i < limit:
                        yield "data: " + json.dumps({"i": i, "text": "t" * CHUNK}) + "\n\n"
                        i += 1
                        await asyncio.sleep(0)
                    yield "data: [DONE]\n\n"
                finally:
                    self.closed.set()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"server-timing": TIMING})

        return app


@pytest.fixture(scope="module")
def worker():
    w = FloodWorker()
    yield w
    w.served.stop()


def _complete(url: str, headers: dict[str, str] | None = None, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=10, headers=headers,
                      json={"model": "stub-model", "prompt": "hello", **extra})


def test_answers_name_no_worker_unless_debug_headers(worker):
    for debug in (False, True):
        router = router_app([worker.url], debug_headers=debug)
        try:
            _wait_ready(router.url, 1)
            plain = _complete(router.url)
            streamed = _complete(router.url, slow_stream(2), stream=True)
            for r in (plain, streamed):
                assert r.status_code == 200, r.text
                if debug:
                    assert r.headers["x-tandem-worker"] == worker.url
                    assert r.headers["server-timing"] == TIMING
                else:
                    assert "x-tandem-worker" not in r.headers
                    assert "server-timing" not in r.headers
                    assert worker.url.split("//")[1] not in r.text
            assert streamed.text.endswith("data: [DONE]\n\n")
        finally:
            router.stop()


def test_a_failed_connect_is_a_502_naming_no_address():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def attempt(debug: bool) -> APIError:
        w = Worker(id=dead)
        http = upstream_session(ProxySettings())
        try:
            with pytest.raises(APIError) as err:
                await forward(http, "/v1/completions", b"{}", "rid",
                              lambda tried: None if tried else Route(Decision(w, "load", 0)),
                              False, ProxySettings(retries=0, debug_headers=debug),
                              lambda a: None)
        finally:
            await http.close()
        return err.value

    quiet, debug = asyncio.run(attempt(False)), asyncio.run(attempt(True))
    assert quiet.status == 502 and quiet.message == "no worker could be reached " \
                                                    "(connection failed)"
    assert debug.status == 502 and dead.split("//")[1] in debug.message


def _settings(worker: FloodWorker, **fields) -> RouterServerSettings:
    return RouterServerSettings(worker_urls=[worker.url], **fields)


def test_metrics_need_a_key_when_api_keys_are_on(worker, tmp_path):
    key = WorkerKey(worker_key_file(tmp_path))
    tenant, admin = {"Authorization": "Bearer sk-t"}, {"Authorization": "Bearer sk-admin"}
    router = router_app([worker.url], keys={"sk-t": "acme"}, worker_key=key)
    try:
        r = httpx.get(router.url + "/metrics")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": "missing or malformed Authorization: Bearer "
                                                 "<key>", "type": "authentication_error",
                                      "param": None, "code": 401}}
        r = httpx.get(router.url + "/metrics", headers=tenant)  # no admin keys: any key
        assert r.status_code == 200 and "tandem_router_" in r.text
        assert httpx.get(router.url + "/health").status_code == 200  # probes stay open
        assert httpx.get(router.url + "/ready").status_code in (200, 503)
    finally:
        router.stop()
    router = router_app([worker.url], keys={"sk-t": "acme"}, worker_key=key,
                        admin_keys=ApiKeys({"sk-admin": "ops"}))
    try:  # with admin keys, only they read /metrics
        assert httpx.get(router.url + "/metrics").status_code == 401
        r = httpx.get(router.url + "/metrics", headers=tenant)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert httpx.get(router.url + "/metrics", headers=admin).status_code == 200
    finally:
        router.stop()
    router = router_app([worker.url], keys={"sk-t": "acme"}, worker_key=key,
                        metrics_auth=False)  # the operator's explicit choice
    try:
        assert httpx.get(router.url + "/metrics").status_code == 200
    finally:
        router.stop()
    with pytest.raises(ValueError, match="metrics auth needs API keys"):
        build_app(Router(RouterSettings(), lambda m: None), _settings(worker, metrics_auth=True))


def test_metrics_on_their_own_port_only(worker, tmp_path):
    key = WorkerKey(worker_key_file(tmp_path))
    app = build_app(Router(RouterSettings(seed=0), lambda m: None), _settings(
        worker, api_keys=ApiKeys({"sk-t": "acme"}), worker_key=key, metrics_port=free_port()))
    side = metrics_app(app)
    assert side is not None
    router, metrics = Served(app), Served(side)
    try:
        assert httpx.get(router.url + "/metrics").status_code == 404  # not on the main port
        r = httpx.get(metrics.url + "/metrics")  # open there: a NetworkPolicy guards it
        assert r.status_code == 200 and "tandem_router_" in r.text
        for path in ("/health", "/v1/models", "/docs", "/openapi.json"):
            assert httpx.get(metrics.url + path).status_code == 404
    finally:
        metrics.stop()
        router.stop()
    assert metrics_app(build_app(Router(RouterSettings(), lambda m: None),
                                 _settings(worker))) is None


def test_api_docs_are_off_by_default_and_behind_the_keys_when_on(worker, tmp_path):
    router = router_app([worker.url])
    try:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            r = httpx.get(router.url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == 404
    finally:
        router.stop()
    router = router_app([worker.url], keys={"sk-t": "acme"},
                        worker_key=WorkerKey(worker_key_file(tmp_path)), openapi=True)
    try:
        assert httpx.get(router.url + "/openapi.json").status_code == 401
        r = httpx.get(router.url + "/openapi.json", headers={"Authorization": "Bearer sk-t"})
        assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
        assert httpx.get(router.url + "/docs").status_code == 404
    finally:
        router.stop()


def test_a_stalled_streaming_client_is_cut_and_the_worker_stream_closed(worker):
    """The client asks for a stream and never reads: the router's transport fills to its
    high-water mark and waits, the upstream pauses; after the send timeout the router cuts
    the client and closes the upstream connection, which ends the worker's stream."""
    worker.closed.clear()
    router = router_app([worker.url], limits=ServerLimits(send_timeout_s=1.0))
    try:
        _wait_ready(router.url, 1)
        before = worker.streams
        with stalled_client(router) as s:
            high = held(router)[2]
            body = json.dumps({"model": "stub-model", "prompt": "x", "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            t0 = time.monotonic()
            assert worker.closed.wait(20), "the worker's stream never closed"
            took = time.monotonic() - t0
            assert worker.streams == before + 1
            assert 1.0 <= took < 10, took
            peak = on_loop(router, router.server.stats).peak_write_buffered
            assert high < peak <= high + READ_MAX, (peak, high)  # it filled, no further
            assert wait_until(lambda: held(router)[:2] == (0, 0))
            with contextlib.suppress(ConnectionResetError):
                while s.recv(65536):  # what got through, then the end: the router cut it
                    pass
        assert _complete(router.url).status_code == 200  # the router serves on
    finally:
        router.stop()


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(["--workers", "http://a:8000", *argv])


def test_front_door_flags_and_router_yaml(tmp_path):
    _, _, server = build(_args())
    assert not server.proxy.debug_headers and server.metrics_port is None
    assert server.metrics_auth is None and not server.openapi
    assert front_door(_args(), {}) == FrontDoor(send_timeout_s=30.0, max_connections=4096)
    cfg = tmp_path / "router.yaml"
    cfg.write_text("debug_headers: true\nmetrics_port: 9090\nopenapi: true\n"
                   "send_timeout_seconds: 5\nmax_connections: 100\nmetrics_auth: false\n")
    _, _, server = build(_args("--config", str(cfg)))
    assert server.proxy.debug_headers and server.metrics_port == 9090 and server.openapi
    assert server.metrics_auth is False
    assert front_door(_args(), {"send_timeout_seconds": 5, "max_connections": 100}) == \
        FrontDoor(send_timeout_s=5.0, max_connections=100)
    door = front_door(_args("--metrics-port", "9100", "--metrics-auth", "--debug-headers",
                            "--send-timeout-seconds", "2.5", "--max-connections", "7"),
                      {"metrics_port": 9090, "metrics_auth": False})  # flags win
    assert door == FrontDoor(debug_headers=True, metrics_port=9100, metrics_auth=True,
                             send_timeout_s=2.5, max_connections=7)
    for argv, cfg_, message in (
            ((), {"metrics_port": 99999}, "metrics_port: a port in 1-65535"),
            (("--metrics-port", "8000"), {}, "must differ from --port"),
            ((), {"metrics_port": "9090"}, "metrics_port: an integer"),
            ((), {"debug_headers": "yes"}, "debug_headers: a boolean"),
            (("--send-timeout-seconds", "0"), {}, "send_timeout_seconds: in"),
            (("--max-connections", "0"), {}, "max_connections: at least 1")):
        with pytest.raises(SystemExit, match=message):
            front_door(_args(*argv), cfg_)
    with pytest.raises(SystemExit, match="--metrics-auth needs --api-keys"):
        build(_args("--metrics-auth"))


def test_the_router_process_serves_metrics_on_its_own_port_only(worker, tmp_path):
    """`tandem router --metrics-port`: the side listener is up with the main one, serves
    /metrics alone, and goes down with the process on SIGTERM."""
    metrics_port = free_port()
    router = RouterProcess(tmp_path, [worker.url], "--metrics-port", str(metrics_port))
    metrics = f"http://127.0.0.1:{metrics_port}"
    try:
        router.wait_listening()
        r = httpx.get(metrics + "/metrics", timeout=5)
        assert r.status_code == 200 and "tandem_router_" in r.text
        assert httpx.get(metrics + "/v1/models", timeout=5).status_code == 404
        assert httpx.get(router.url + "/metrics", timeout=5).status_code == 404
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0, router.log()
        with pytest.raises(httpx.ConnectError):
            httpx.get(metrics + "/metrics", timeout=5)
    finally:
        router.stop()
