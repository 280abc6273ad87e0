"""`FastPaths`: hot POST routes served straight from ASGI keep the endpoint contract (OpenAI
errors, 413 body limit, logged 500) and leave every other route to FastAPI. Real sockets,
under both servers: uvicorn (the worker) and the lean server (the router)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tandem.protocol.web import APIError, FastPaths, install_error_handlers
from tests.router.test_router_app import Served

LIMIT = 1000


@pytest.fixture(scope="module", params=["lean", "uvicorn"])
def served(request):
    app = FastAPI()
    install_error_handlers(app)
    calls: list[str] = []

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        calls.append("echo")
        if body.get("fail") == "api":
            raise APIError(429, "slow down", headers={"Retry-After": "3"})
        if body.get("fail") == "bug":
            raise KeyError("boom")
        return JSONResponse({"got": body})

    @app.get("/other")
    async def other() -> dict:
        return {"fastapi": True}

    server = Served(FastPaths(app, {"/echo": echo}, LIMIT), lean=request.param == "lean")
    yield server, calls, app
    server.stop()


def test_the_fast_route_answers_and_others_reach_fastapi(served):
    server, calls, app = served
    r = httpx.post(server.url + "/echo", json={"a": 1})
    assert r.status_code == 200 and r.json() == {"got": {"a": 1}}
    assert httpx.get(server.url + "/other").json() == {"fastapi": True}
    assert httpx.get(server.url + "/echo").status_code == 405  # FastAPI's own answer
    assert "/echo" in httpx.get(server.url + "/openapi.json").json()["paths"]
    assert FastPaths(app, {}, LIMIT).state is app.state


def test_errors_are_openai_json(served):
    server, _, _ = served
    r = httpx.post(server.url + "/echo", json={"fail": "api"})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"] == {"message": "slow down", "type": "rate_limit_error",
                                 "param": None, "code": 429}
    r = httpx.post(server.url + "/echo", json={"fail": "bug"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "KeyError" in r.json()["error"]["message"]


def test_oversized_bodies_are_413_declared_or_streamed(served):
    server, calls, _ = served
    before = len(calls)
    r = httpx.post(server.url + "/echo", content=b"x" * (LIMIT + 1),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: the limit trips while the body streams in
        for _ in range(20):
            yield b"[" * 100

    r = httpx.post(server.url + "/echo", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds 1000 bytes" in r.json()["error"]["message"]
    assert len(calls) == before  # the handler never got past reading either body
    assert httpx.post(server.url + "/echo", json={"still": "fine"}).status_code == 200
