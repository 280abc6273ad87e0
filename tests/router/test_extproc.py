"""The router's endpoint picker (`router.extproc`) played as Envoy plays it: an ext_proc client
from Envoy's published protos streams each request's headers and body (FULL_DUPLEX_STREAMED),
forwards what the picker returns to the picked stub worker over real HTTP, and streams the
worker's answer back through the picker (`extproc_client`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey
from tandem.protocol.web import PREFILL_HEADER, APIError
from tandem.router.extproc.settings import ExtProcSettings
from tandem.router.flowcontrol.base import (
    REASON_HEADER,
    FlowControl,
    FlowRequest,
    FlowTicket,
)
from tandem.serving.worker_auth import check_signature
from tests.router.extproc_client import EppRouter
from tests.router.stub_worker import COMPLETION_TOKENS, StubWorker, slow_stream
from tests.serving.helpers import free_port, worker_key_file

MODEL = "stub-model"


def _body(prompt: str, **extra) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5, **extra}).encode()


@pytest.fixture(scope="module")
def workers():
    ws = [StubWorker(free_port()) for _ in range(3)]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def epp(workers):
    r = EppRouter([w.url for w in workers],
                  ext=ExtProcSettings(port=0, host="127.0.0.1", fallbacks=2))
    r.wait_routable(3)
    yield r
    r.stop()


def _ep(w: StubWorker) -> str:
    return f"127.0.0.1:{w.port}"


def test_the_pick_lands_on_the_worker_holding_the_prefix(epp, workers) -> None:
    a, b = workers[0], workers[1]
    long_a, long_b = "alpha " * 200, "bravo " * 200
    for prompt, holder in ((long_a, a), (long_b, b)):  # each prefix computed on one worker
        ex = epp.envoy.request("/v1/completions", _body(prompt + "first"), subset=[_ep(holder)])
        assert ex.endpoints[0] == _ep(holder) and ex.status == 200
    for _ in range(3):
        for prompt, holder in ((long_a, a), (long_b, b)):
            n = len(holder.bodies)
            ex = epp.envoy.request("/v1/completions", _body(prompt + "again"), chunk=97)
            assert ex.endpoints[0] == _ep(holder), (ex.endpoints, holder.port)
            assert len(holder.bodies) == n + 1 and holder.bodies[-1]["prompt"].endswith("again")
            # the header and the envoy.lb metadata agree, raw_value only, fallbacks after
            assert ex.metadata_endpoints == ex.endpoints and not ex.set_both
            assert len(ex.endpoints) == 3 and len(set(ex.endpoints)) == 3
            assert json.loads(ex.body)["usage"]["completion_tokens"] == COMPLETION_TOKENS
            assert ex.trailing is None  # the picker closed its side cleanly


def test_the_subset_hint_is_honoured(epp, workers) -> None:
    eps = [_ep(w) for w in workers]
    for subset in ([eps[2]], f"{eps[0]}, {eps[2]}", ["127.0.0.1"]):
        for i in range(4):
            ex = epp.envoy.request("/v1/completions", _body(f"subset {i} {subset}"),
                                   subset=subset)
            allowed = eps if subset == ["127.0.0.1"] else [e.strip() for e in (
                subset if isinstance(subset, list) else subset.split(","))]
            assert set(ex.endpoints) <= set(allowed) and ex.status == 200
            assert len(ex.endpoints) == len(allowed)
    for subset in (["10.9.9.9:8000"], []):  # nothing eligible, or an empty list: 503
        ex = epp.envoy.request("/v1/completions", _body("x"), subset=subset)
        assert ex.immediate is not None and ex.immediate.status.code == 503
        err = json.loads(ex.immediate.body)["error"]
        assert err["code"] == 503 and "subset" in err["message"]


def test_bad_requests_are_answered_by_the_picker(epp) -> None:
    before = epp.metric("tandem_router_extproc_immediate_responses_total", {"status": "400"})
    ex = epp.envoy.request("/v1/completions", b'{"model": "stub-model", "prompt": ')
    assert ex.immediate.status.code == 400 and ex.pick is None
    assert json.loads(ex.immediate.body)["error"]["type"] == "invalid_request_error"
    headers = {h.header.key: h.header.raw_value for h in ex.immediate.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    assert epp.metric("tandem_router_extproc_immediate_responses_total",
                      {"status": "400"}) == before + 1
    ex = epp.envoy.request("/v1/completions", _body("x"), headers={"content-type": "text/plain"})
    assert ex.immediate.status.code == 400
    ex = epp.envoy.request("/v1/embeddings", _body("x"))
    assert ex.immediate.status.code == 404
    ex = epp.envoy.request("/v1/completions", b"", method="GET")
    assert ex.immediate.status.code == 405
    ex = epp.envoy.request("/v1/models", b"", method="GET")
    assert ex.immediate.status.code == 200
    assert [m["id"] for m in json.loads(ex.immediate.body)["data"]] == [MODEL]


def test_an_oversized_body_is_413(workers) -> None:
    r = EppRouter([workers[0].url], max_body_bytes=1000)
    try:
        r.wait_routable(1)
        ex = r.envoy.request("/v1/completions", _body("y" * 2000), chunk=300)
        assert ex.immediate.status.code == 413
        assert "1000 bytes" in json.loads(ex.immediate.body)["error"]["message"]
        ex = r.envoy.request("/v1/completions", _body("y" * 500), chunk=300)
        assert ex.status == 200
    finally:
        r.stop()


def test_sse_is_relayed_in_order_as_it_streams(epp) -> None:
    ex = epp.envoy.request("/v1/completions", _body("stream me", stream=True),
                           headers=slow_stream(6, 0.1))
    assert ex.status == 200 and ex.response_headers["content-type"].startswith(
        "text/event-stream")
    events = [e for e in ex.body.split(b"\n\n") if e]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert texts == [f"t{i}" for i in range(6)] and events[-1] == b"data: [DONE]"
    # streamed, not buffered: the first event reached the client before the last was sent
    assert ex.received_at[0] < ex.sent_at[-1] - 0.2


class Recorded(FlowTicket):
    def __init__(self, log: list) -> None:
        self.log = log

    def release(self, used_tokens: int | None = None) -> None:
        self.log.append(used_tokens)


class FlowDouble(FlowControl):
    """Admits, or sheds with flow control's 429, and records what it saw."""

    def __init__(self, shed: bool) -> None:
        self.shed, self.seen, self.released = shed, [], []

    async def acquire(self, req: FlowRequest) -> FlowTicket:
        self.seen.append(req)
        if self.shed:
            raise APIError(429, "band 3 is full; retry later",
                           headers={"Retry-After": "2", REASON_HEADER: "band-full"})
        return Recorded(self.released)

    def kick(self) -> None:
        pass

    async def close(self) -> None:
        pass


def test_flow_control_sheds_with_429_and_bands_come_from_objectives(workers) -> None:
    flow = FlowDouble(shed=True)
    ext = ExtProcSettings(port=0, host="127.0.0.1", objectives={"critical": 7})
    r = EppRouter([workers[0].url], ext=ext, flow_control=flow)
    try:
        r.wait_routable(1)
        ex = r.envoy.request("/v1/completions", _body("shed"),
                             headers={"x-gateway-inference-objective": "critical"})
        assert ex.immediate.status.code == 429 and ex.pick is None
        headers = {h.header.key: h.header.raw_value for h in ex.immediate.headers.set_headers}
        assert headers["Retry-After"] == b"2" and headers[REASON_HEADER] == b"band-full"
        assert flow.seen[-1].band == 7 and flow.seen[-1].tenant == "anonymous"
        assert r.metric("tandem_router_extproc_picks_total", {"outcome": "shed"}) == 1
        r.envoy.request("/v1/completions", _body("shed"),  # unknown objective: the tenant's
                        headers={"x-gateway-inference-objective": "nope"})
        assert flow.seen[-1].band == 0 and flow.seen[-1].model == MODEL
        flow.shed = False
        ex = r.envoy.request("/v1/completions", _body("admitted"))
        assert ex.status == 200 and flow.released == [1 + COMPLETION_TOKENS]  # its usage
    finally:
        r.stop()


class SigningStub(StubWorker):
    """A stub worker that checks the router's signature as a worker with
    `--require-signed-requests` does (`serving.worker_auth.check_signature`)."""

    def __init__(self, port: int, key: WorkerKey) -> None:
        self.key, self.refused = key, []
        super().__init__(port)

    def app(self):  # noqa: ANN201
        app = super().app()

        @app.middleware("http")
        async def signed(request: Request, call_next):  # noqa: ANN202
            if request.method == "POST":
                try:
                    await check_signature(request, self.key, None, required=True)
                except APIError as exc:
                    self.refused.append(exc.message)
                    return JSONResponse({"error": exc.message}, status_code=exc.status)
            return await call_next(request)

        return app


def test_the_forwarded_request_carries_the_routers_signature(tmp_path) -> None:
    path = worker_key_file(tmp_path)
    worker = SigningStub(free_port(), WorkerKey(path))
    r = EppRouter([worker.url], worker_key=WorkerKey(path))
    try:
        r.wait_routable(1)
        ex = r.envoy.request("/v1/completions", _body("signed"), headers={
            PREFILL_HEADER: "10.0.0.1:50051", SIGNATURE_HEADER: "t=1,n=0,v1=00",
            "authorization": "Bearer sk-client"})
        assert ex.status == 200 and worker.refused == [], worker.refused
        # the client's own P/D target, signature and API key never reach the worker
        assert set(ex.removed) == {PREFILL_HEADER, "authorization"}
        assert ex.set_headers[SIGNATURE_HEADER] != "t=1,n=0,v1=00"
        assert int(ex.set_headers["content-length"]) == len(ex.forwarded_body)
        # the check is real: the same signature over another body is refused
        resp = httpx.post(f"{worker.url}/v1/completions", content=_body("forged"),
                          headers={SIGNATURE_HEADER: ex.set_headers[SIGNATURE_HEADER],
                                   "content-type": "application/json"})
        assert resp.status_code == 403 and len(worker.refused) == 1
    finally:
        r.stop()
        worker.stop()


def test_a_fallback_that_served_takes_the_prefix(epp, workers) -> None:
    prompt = "charlie " * 200
    ex = epp.envoy.request("/v1/completions", _body(prompt + "one"), serve=1)
    assert ex.status == 200 and ex.served_by == ex.endpoints[1]
    assert epp.metric("tandem_router_extproc_served_total", {"outcome": "fallback"}) >= 1
    ex2 = epp.envoy.request("/v1/completions", _body(prompt + "two"))
    assert ex2.endpoints[0] == ex.endpoints[1]  # recorded where it was served, not the pick


def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_follows_worker_readiness() -> None:
    worker = StubWorker(free_port(), loading=True)
    r = EppRouter([worker.url])
    try:
        serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                                health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _health(r.target, "liveness") == serving
        for name in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert _health(r.target, name) == not_serving
        ex = r.envoy.request("/v1/completions", _body("early"))
        assert ex.immediate.status.code == 503  # loading: no endpoint yet
        worker.loading = False
        deadline = time.monotonic() + 5
        while _health(r.target, "readiness") != serving:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert _health(r.target, "envoy.service.ext_proc.v3.ExternalProcessor") == serving
    finally:
        r.stop()
        worker.stop()


def test_ext_proc_port_with_several_processes_is_a_usage_error() -> None:
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "router", "--port",
                          str(free_port()), "--ext-proc-port", str(free_port()),
                          "--processes", "2", "--workers", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--ext-proc-port runs in one router process" in out.stderr
