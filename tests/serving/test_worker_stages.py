"""The worker's routes and request stages (`serving.routes.WorkerApp`), called one by one
without a server or an engine: each stage's refusal, and `build_app` serving the methods."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi.routing import APIRoute
from starlette.requests import Request

from tandem.engine.errors import InvalidRequestError
from tandem.protocol.signing import TENANT_SALT_PREFIX
from tandem.protocol.web import APIError
from tandem.serving.api_server import ServerSettings, build_app
from tandem.serving.routes import WorkerApp


def _request(body: dict | None = None, path: str = "/v1/completions") -> Request:
    raw = json.dumps(body or {}).encode()

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    return Request(scope, receive)


def _app(**settings) -> WorkerApp:
    return WorkerApp(ServerSettings(served_model_name="m", **settings), lambda: None)


def _status(coro) -> int:
    with pytest.raises(APIError) as err:
        asyncio.run(coro)
    return err.value.status


def test_build_app_serves_the_worker_app_methods() -> None:
    app = build_app(ServerSettings(served_model_name="m"), lambda: None)
    wa = app.state.worker_app
    assert isinstance(wa, WorkerApp)
    assert app.state.holder is wa.holder and app.state.metrics is wa.metrics
    served = {r.path: r.endpoint for r in app.routes if isinstance(r, APIRoute)}
    assert {p: served[p] for p in ("/health", "/ready", "/metrics", "/v1/models", "/tokenize",
                                   "/detokenize", "/v1/completions", "/v1/chat/completions")} \
        == {"/health": wa.health, "/ready": wa.ready, "/metrics": wa.prometheus,
            "/v1/models": wa.models, "/tokenize": wa.tokenize, "/detokenize": wa.detokenize,
            "/v1/completions": wa.completions, "/v1/chat/completions": wa.chat}
    app.state.draining = True  # the worker's SIGTERM handler sets it on the app
    assert wa.draining


def test_authenticate_refuses_a_tenant_salt_without_a_key_and_counts_it() -> None:
    wa = _app()
    asyncio.run(wa.authenticate(_request()))  # nothing asks for a signature
    assert _status(wa.authenticate(_request(), f"{TENANT_SALT_PREFIX}a")) == 403
    samples = [s for m in wa.metrics.registry.collect() for s in m.samples
               if s.name == "tandem_worker_auth_rejected_total"]
    assert sum(s.value for s in samples) == 1


def test_engine_for_is_503_until_the_engine_has_loaded() -> None:
    with pytest.raises(APIError) as err:
        _app().engine_for("m")
    assert err.value.status == 503


def test_off_thread_runs_in_the_pool_and_refuses_past_its_slots() -> None:
    wa = _app(max_pending_tokenize=1)
    assert asyncio.run(wa.off_thread(threading.current_thread)).name.startswith(
        "tandem-tokenize")

    def bad() -> None:
        raise InvalidRequestError("too long", "prompt")

    assert _status(wa.off_thread(bad)) == 400
    assert wa.tokenize_slots.acquire(blocking=False)  # the one slot is taken: 429
    assert _status(wa.off_thread(lambda: None)) == 429
    wa.tokenize_slots.release()
    wa.tokenizer_pool.shutdown()


def test_serve_is_503_while_draining() -> None:
    app = build_app(ServerSettings(served_model_name="m"), lambda: None)
    app.state.draining = True
    wa = app.state.worker_app
    assert _status(wa.serve(_request(), None, None, [])) == 503  # type: ignore[arg-type]
