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

from tandem.protocol.migration import RESUME_HEADER, TOKENS_HEADER
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey
from tandem.protocol.web import PREFILL_HEADER, APIError
from tandem.router.extproc.settings import ExtProcSettings, FairnessIds
from tandem.router.flowcontrol.base import REASON_HEADER
from tandem.router.scorers.session import SESSION_HEADER
from tandem.serving.worker_auth import check_signature
from tests.router.extproc_client import EppRouter, FlowDouble
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


def test_session_tokens_work_on_the_gateway_path(epp, workers) -> None:
    """The answer carries the serving worker's `x-session-token` (as the HTTP router's); a
    request sending it back is picked onto that worker; a forged one is ignored."""
    eps = [_ep(w) for w in workers]
    first = epp.envoy.request("/v1/completions", _body("session opener"), subset=[eps[2]])
    token = first.response_set[SESSION_HEADER]
    assert first.status == 200 and token.startswith("v1.") and not first.set_both
    for i in range(6):  # fresh prompts: no prefix pulls them anywhere
        ex = epp.envoy.request("/v1/completions", _body(f"session turn {i} " * 3),
                               headers={SESSION_HEADER: token})
        assert ex.endpoints[0] == eps[2] and ex.response_set[SESSION_HEADER] == token
    seen = {epp.envoy.request("/v1/completions", _body(f"forged {i} " * 3),
                              headers={SESSION_HEADER: "v1.AAAAAAAAAAAAAAAAAAAAAA"}
                              ).endpoints[0] for i in range(12)}
    assert len(seen) > 1  # a forged token names no worker: the load spreads as usual


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
        r.envoy.request("/v1/completions", _body("shed"),  # no API keys: the gateway's flow
                        headers={"x-gateway-inference-fairness-id": "team-7"})
        assert flow.seen[-1].tenant == "team-7"
        ex = r.envoy.request("/v1/completions", _body("rewrite"),  # not supported: refused
                             headers={"x-gateway-model-name-rewrite": "other"})
        assert ex.immediate.status.code == 400 and len(flow.seen) == 3
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
            "authorization": "Bearer sk-client", TOKENS_HEADER: "1",
            RESUME_HEADER: "cmpl-1;1;0;AQAAAA=="})
        assert ex.status == 200 and worker.refused == [], worker.refused
        # the client's own P/D target, migration headers, signature and API key never reach
        # the worker
        assert set(ex.removed) == {PREFILL_HEADER, "authorization", TOKENS_HEADER, RESUME_HEADER}
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


def test_ext_proc_port_with_several_processes_is_a_usage_error(capsys) -> None:
    import argparse

    from tandem.router.main import add_router_args, run

    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(["--port", str(free_port()), "--ext-proc-port", str(free_port()),
                         "--processes", "2", "--workers", "http://127.0.0.1:9"])
    assert run(args) == 2  # before anything binds or loads
    assert "--ext-proc-port runs in one router process" in capsys.readouterr().err


def test_pd_the_decode_worker_gets_the_signed_prefill_target(tmp_path) -> None:
    from tests.router.test_pd_app import LONG, stub_worker
    from tests.router.test_router_app import Served

    seen: list = []
    (decode, _), (prefill, target) = (stub_worker("decode", "decode", seen),
                                      stub_worker("p1", "prefill", seen))
    servers = [Served(decode), Served(prefill)]
    r = EppRouter([s.url for s in servers], worker_key=WorkerKey(worker_key_file(tmp_path)))
    try:
        r.wait_routable(2)
        ex = r.envoy.request("/v1/completions", _body(LONG))
        assert ex.endpoints == [servers[0].url.removeprefix("http://")]  # never the prefill
        assert ex.set_headers[PREFILL_HEADER] == target and ex.status == 200
        assert seen == [("decode", target)]  # the stub verified it: 403 otherwise
        assert json.loads(ex.body)["choices"][0]["text"] == "decode"
        assert r.metric("tandem_router_disaggregated_requests_total", {"backend": "grpc"}) == 1
    finally:
        r.stop()
        for s in servers:
            s.stop()


def test_a_streams_usage_settles_the_rate_limit_and_is_not_relayed(workers) -> None:
    from tandem.router.ratelimit import Limits, RateLimiter

    limiter = RateLimiter(Limits(tokens_per_min=600))  # 10 tokens/s back
    w = StubWorker(free_port(), max_model_len=400)
    r = EppRouter([w.url], rate_limiter=limiter)
    try:
        r.wait_routable(1)
        body = json.dumps({"model": MODEL, "prompt": list(range(1, 101)), "stream": True})
        used = 100 + COMPLETION_TOKENS
        for i in range(2):  # each charged 400 (100 + the 300 left): the 2nd fits only refunded
            ex = r.envoy.request("/v1/completions", body.encode())
            assert ex.status == 200, ex.immediate
            assert w.bodies[-1]["stream_options"] == {"include_usage": True}
            assert b'"usage"' not in ex.body and ex.body.endswith(b"data: [DONE]\n\n")
            assert int(ex.set_headers["content-length"]) == len(ex.forwarded_body)
            deadline = time.monotonic() + 10  # the refund runs in the background
            while limiter.local.level("anonymous", limiter.default, time.monotonic()) \
                    < 600 - (i + 1) * used - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        ex = r.envoy.request("/v1/completions", body.replace('"stream": true',
                                                             '"max_tokens": 600').encode())
        assert ex.immediate.status.code == 429  # larger than a minute's tokens
    finally:
        r.stop()
        w.stop()


def test_tandem_router_serves_the_endpoint_picker(workers) -> None:
    port, epp_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "router", "--port", str(port),
                             "--ext-proc-port", str(epp_port), "--workers", workers[0].url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = f"127.0.0.1:{epp_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if _health(target, "readiness") == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "the endpoint picker did not become ready"
            time.sleep(0.2)
        from tests.router.extproc_client import Envoy

        envoy = Envoy(target)
        ex = envoy.request("/v1/completions", _body("a process"))
        envoy.close()
        assert ex.endpoints == [_ep(workers[0])] and ex.status == 200
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'tandem_router_extproc_picks_total{outcome="routed"} 1.0' in metrics
        assert "tandem_router_extproc_streams_total 1.0" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_router_yaml_and_flags_configure_the_picker(tmp_path) -> None:
    import argparse

    import yaml

    from tandem.router.config import RouterConfigError, check_config
    from tandem.router.main import add_router_args, ext_proc_settings

    for bad, named in (({"ext_proc_port": 0}, "ext_proc_port"),
                       ({"objectives": {"gold": "high"}}, "objectives.gold"),
                       ({"ext_proc_fallbacks": -1}, "ext_proc_fallbacks"),
                       ({"ext_proc": 1}, 'unknown key "ext_proc"')):
        with pytest.raises(RouterConfigError, match=named):
            check_config(bad)
    p = argparse.ArgumentParser()
    add_router_args(p)
    cfg = check_config(yaml.safe_load(
        "ext_proc_port: 9002\nobjectives: {critical: 10, batch: -1}\next_proc_fallbacks: 1\n"))
    got = ext_proc_settings(p.parse_args(["--host", "0.0.0.0"]), cfg)
    assert (got.port, got.host, dict(got.objectives), got.fallbacks, got.tls_cert) == \
        (9002, "0.0.0.0", {"critical": 10, "batch": -1}, 1, None)
    assert ext_proc_settings(p.parse_args([]), {}) is None
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    for argv, message in ((["--ext-proc-port", "8000"], "must differ"),
                          (["--ext-proc-port", "9002", "--ext-proc-tls-cert", str(cert)],
                           "go together"),
                          (["--ext-proc-port", "9002", "--ext-proc-tls-cert", str(cert),
                            "--ext-proc-tls-key", str(tmp_path / "none")], "cannot read"),
                          (["--ext-proc-tls-cert", str(cert)], "need --ext-proc-port")):
        with pytest.raises(SystemExit, match=message):
            ext_proc_settings(p.parse_args(argv), {})


def test_the_picker_serves_tls_with_a_certificate(tmp_path, workers) -> None:
    from tests.protocol.certs import CA

    ca = CA("epp-test-ca")
    cert, key = ca.issue("epp")
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    r = EppRouter([workers[0].url], ext=ExtProcSettings(
        port=0, host="127.0.0.1", tls_cert=str(tmp_path / "tls.crt"),
        tls_key=str(tmp_path / "tls.key")))
    try:
        r.wait_routable(1)
        creds = grpc.ssl_channel_credentials(root_certificates=ca.pem)
        with grpc.secure_channel(r.target, creds) as ch:
            got = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError):  # plaintext is not served
            _health(r.target, "liveness")
    finally:
        r.stop()


def test_a_broken_stream_releases_the_flow_ticket(workers) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tests.router.extproc_client import Stream, _headers

    flow = FlowDouble(shed=False)
    r = EppRouter([workers[0].url], flow_control=flow)
    try:
        r.wait_routable(1)
        s = Stream(r.envoy.stub)
        s.send(pb.ProcessingRequest(request_headers=_headers(
            {":method": "POST", ":path": "/v1/completions",
             "content-type": "application/json"}, eos=False)))
        s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=_body("gone"),
                                                             end_of_stream=True)))
        assert s.recv().WhichOneof("response") == "request_headers" and flow.released == []
        s.call.cancel()  # the gateway went away before any response
        deadline = time.monotonic() + 5
        while flow.released != [None]:  # released once, its use unknown
            assert time.monotonic() < deadline, flow.released
            time.sleep(0.02)
        assert r.metric("tandem_router_extproc_served_total", {"outcome": "unreported"}) == 1
        assert r.ra.router.workers[workers[0].url].local_in_flight == 0
    finally:
        r.stop()


class ResponsesStub(StubWorker):
    RID = "resp_" + "ab" * 16

    def app(self):  # noqa: ANN201
        app = super().app()

        @app.post("/v1/responses")
        async def create(request: Request) -> JSONResponse:
            self.bodies.append(await request.json())
            return JSONResponse({"id": self.RID, "object": "response", "status": "completed",
                                 "output": [], "usage": {"total_tokens": 3}})

        return app


def test_a_stored_response_is_remembered_with_the_worker_that_served_it() -> None:
    worker = ResponsesStub(free_port())
    r = EppRouter([worker.url])
    try:
        r.wait_routable(1)
        ex = r.envoy.request("/v1/responses", json.dumps({"model": MODEL, "input": "hi"})
                             .encode())
        assert ex.status == 200 and json.loads(ex.body)["id"] == ResponsesStub.RID
        assert r.ra.locations.get(None, ResponsesStub.RID) == worker.url
        ex = r.envoy.request("/v1/responses", json.dumps(
            {"model": MODEL, "input": "x", "store": False}).encode())
        assert ex.status == 200 and len(r.ra.locations) == 1
    finally:
        r.stop()
        worker.stop()


def test_the_flow_is_the_tenant_before_the_gateways_fairness_id() -> None:
    from tandem.router.extproc.picker import flow_id

    header = "x-gateway-inference-fairness-id"
    assert flow_id("gold", {header: "team-7"}) == "gold"  # API keys: the caller's tenant
    assert flow_id(None, {header: "team-7"}) == "team-7"
    assert flow_id(None, {header: "no spaces allowed"}) == "anonymous"
    assert flow_id(None, {header: "x" * 129}) == "anonymous" and flow_id(None, {}) == "anonymous"
    known = FairnessIds(limit=2)  # client-chosen ids: a bounded number get flows of their own
    flows = [flow_id(None, {header: f"team-{i}"}, known) for i in (1, 2, 3, 1, 4, 2)]
    assert flows == ["team-1", "team-2", "other", "team-1", "other", "team-2"]
    assert known.known == {"team-1", "team-2"}
    assert flow_id("gold", {header: "team-9"}, known) == "gold" and len(known.known) == 2


def test_request_trailers_end_the_body(epp) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tests.router.extproc_client import Stream, _headers

    s = Stream(epp.envoy.stub)
    try:
        s.send(pb.ProcessingRequest(request_headers=_headers(
            {":method": "POST", ":path": "/v1/completions",
             "content-type": "application/json"}, eos=False)))
        s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=_body("trailed"))))
        s.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        kinds = [s.recv().WhichOneof("response") for _ in range(3)]
        assert kinds == ["request_headers", "request_body", "request_trailers"]
    finally:
        s.close()
