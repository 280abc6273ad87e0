"""The endpoint picker feeds the per-worker circuit breakers from the answers it sees (the
gateway's response headers and served endpoint), so a worker failing behind the gateway is
skipped by the next picks on both front doors, as one failing behind the HTTP router is.
Played with the ext_proc client (`extproc_client`) against real stub workers."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.router.extproc.settings import ExtProcSettings
from tandem.router.workers import BreakerState
from tests.router.extproc_client import EppRouter, Stream, _headers
from tests.router.stub_worker import StubWorker
from tests.serving.helpers import free_port

MODEL = "stub-model"


class FailingStub(StubWorker):
    """Answers completions 500 while `failing`."""

    failing = False

    def app(self):  # noqa: ANN201
        app = super().app()
        ok = next(r for r in app.router.routes if getattr(r, "path", "") == "/v1/completions")
        app.router.routes.remove(ok)

        @app.post("/v1/completions")
        async def completions(request: Request):  # noqa: ANN202
            if self.failing:
                self.bodies.append(await request.json())
                return JSONResponse({"error": {"message": "boom", "code": 500}},
                                    status_code=500)
            return await ok.endpoint(request)

        return app


def _body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5}).encode()


@pytest.fixture
def fleet():
    bad, good = FailingStub(free_port()), StubWorker(free_port())
    r = EppRouter([bad.url, good.url], ext=ExtProcSettings(port=0, host="127.0.0.1"))
    r.wait_routable(2)
    yield r, bad, good
    r.stop()
    bad.stop()
    good.stop()


def _ep(w: StubWorker) -> str:
    return f"127.0.0.1:{w.port}"


def test_worker_5xx_through_the_gateway_opens_its_breaker_on_both_front_doors(fleet) -> None:
    r, bad, good = fleet
    breaker = r.ra.router.workers[bad.url].breaker
    bad.failing = True
    for i in range(breaker.threshold):  # the gateway's subset hint sends them to `bad`
        ex = r.envoy.request("/v1/completions", _body(f"fail {i}"), subset=[_ep(bad)])
        assert ex.endpoints == [_ep(bad)] and ex.status == 500
    assert breaker.state is BreakerState.OPEN and len(bad.bodies) == breaker.threshold
    ex = r.envoy.request("/v1/completions", _body("only bad allowed"), subset=[_ep(bad)])
    assert ex.immediate is not None and ex.immediate.status.code == 503  # skipped
    for i in range(6):  # the next picks, through the gateway and the HTTP router, skip it
        assert r.envoy.request("/v1/completions", _body(f"gw {i}")).endpoints == [_ep(good)]
        got = httpx.post(f"{r.served.url}/v1/completions", content=_body(f"http {i}"),
                         headers={"content-type": "application/json"}, timeout=10)
        assert got.status_code == 200
    assert len(bad.bodies) == breaker.threshold and len(good.bodies) == 12
    # past the cooldown one request is the half-open trial; its success closes the breaker
    bad.failing = False
    breaker.reopen_at = 0.0  # the cooldown is over
    ex = r.envoy.request("/v1/completions", _body("trial"), subset=[_ep(bad)])
    assert ex.status == 200 and breaker.state is BreakerState.CLOSED and breaker.failures == 0


def _pick(r: EppRouter, subset_ep: str) -> Stream:
    """A stream whose request was picked onto `subset_ep` (the body streamed back read)."""
    from tests.router.extproc_client import _metadata

    s = Stream(r.envoy.stub)
    first = pb.ProcessingRequest(request_headers=_headers(
        {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"},
        eos=False))
    first.metadata_context.CopyFrom(_metadata(
        "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", [subset_ep]))
    s.send(first)
    s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=_body("local"),
                                                         end_of_stream=True)))
    assert s.recv().WhichOneof("response") == "request_headers"
    assert s.recv().WhichOneof("response") == "request_body"
    return s


def _answer(s: Stream, headers: dict[str, str]) -> None:
    """The gateway's answer (headers only, as Envoy's local replies end there)."""
    s.send(pb.ProcessingRequest(response_headers=_headers(headers, eos=True)))
    assert s.recv().WhichOneof("response") == "response_headers"
    s.close()


def test_the_gateways_own_answers_are_judged_as_envoy_means_them(fleet) -> None:
    r, bad, _ = fleet
    breaker = r.ra.router.workers[bad.url].breaker
    # Envoy's own overflow or rate limit never reached the worker: not its failure
    for marker, status in (("x-envoy-overloaded", "503"), ("x-envoy-ratelimited", "429")):
        _answer(_pick(r, _ep(bad)), {":status": status, marker: "true"})
    assert breaker.failures == 0
    # Envoy's 503 for a refused connection, 504 for a timeout: the worker's failures
    for status in ("503", "504"):
        _answer(_pick(r, _ep(bad)), {":status": status, "content-type": "text/plain"})
    assert breaker.failures == 2 and breaker.state is BreakerState.CLOSED
    _answer(_pick(r, _ep(bad)), {":status": "200"})
    assert breaker.failures == 0


def test_a_half_open_trial_with_no_answer_frees_the_breaker(fleet) -> None:
    r, bad, _ = fleet
    breaker = r.ra.router.workers[bad.url].breaker
    bad.failing = True
    for i in range(breaker.threshold):
        r.envoy.request("/v1/completions", _body(f"fail {i}"), subset=[_ep(bad)])
    assert breaker.state is BreakerState.OPEN
    breaker.reopen_at = 0.0  # the cooldown is over
    s = _pick(r, _ep(bad))  # the trial, then the gateway goes away before any answer
    assert breaker.trial_in_flight
    s.call.cancel()
    deadline = time.monotonic() + 5
    while breaker.trial_in_flight:
        assert time.monotonic() < deadline, "the trial was never given up"
        time.sleep(0.02)
    bad.failing = False  # the next request may be the trial, and it closes the breaker
    assert r.envoy.request("/v1/completions", _body("next"), subset=[_ep(bad)]).status == 200
    assert breaker.state is BreakerState.CLOSED
