"""Flow control settles a streamed answer from the usage the stream reports, on both front
doors: a tenant streaming short answers under a large `max_tokens` is charged what it used
(the worker's usage chunk, asked for by the router and stripped before a client that did not
ask for it), not its up-front cost; a stream cut short counts what it streamed so far."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tandem.protocol.signing import WorkerKey
from tandem.router.flowcontrol.front import stream_used
from tandem.router.flowcontrol.local import QueueFlowControl
from tandem.router.flowcontrol.settings import FlowSettings
from tandem.router.usage import StreamUsage
from tests.router.extproc_client import EppRouter
from tests.router.flow_fakes import Slots
from tests.router.stub_worker import COMPLETION_TOKENS, StubWorker
from tests.router.test_router_app import _wait_ready, router_app
from tests.serving.helpers import free_port, worker_key_file

MODEL = "stub-model"
PROMPT = [11, 12, 13]  # token ids: the stub reports 3 prompt tokens
USED = len(PROMPT) + COMPLETION_TOKENS  # what every answer below really uses
KEYS = {"key-short": "short", "key-long": "long"}


class Recording(QueueFlowControl):
    """Least-attained flow control that records each release: (tenant, cost, tokens)."""

    def __init__(self) -> None:
        super().__init__(FlowSettings(enabled=True), Slots(**{MODEL: 64}))
        self.released: list[tuple[str, int, int | None]] = []

    def on_release(self, ticket, used):  # noqa: ANN001, ANN201
        self.released.append((ticket.req.tenant, ticket.req.cost, used))
        super().on_release(ticket, used)

    def attained(self) -> dict[str, int]:
        """What each tenant was charged once settled (the up-front cost when unknown)."""
        out: dict[str, int] = {}
        for tenant, cost, used in self.released:
            out[tenant] = out.get(tenant, 0) + (cost if used is None else used)
        return out


def _body(stream: bool, **extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "stream": stream, **extra}


@pytest.fixture()
def worker():
    w = StubWorker(free_port())
    yield w
    w.stop()


def test_http_streams_settle_from_their_usage_chunk(worker, tmp_path) -> None:
    fc = Recording()
    served = router_app([worker.url], keys=KEYS, flow_control=fc,
                        worker_key=WorkerKey(worker_key_file(tmp_path)))
    try:
        _wait_ready(served.url, 1)
        texts = []
        for i in range(3):  # short streams, one client asking for the usage chunk itself
            extra = {"stream_options": {"include_usage": True}} if i == 2 else {}
            r = httpx.post(served.url + "/v1/completions", json=_body(True, **extra),
                           headers={"authorization": "Bearer key-short"}, timeout=10)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert worker.bodies[-1]["stream_options"] == {"include_usage": True}
            texts.append(r.text)
        assert '"usage"' not in texts[0] and '"usage"' not in texts[1]
        assert f'"total_tokens": {USED}' in texts[2]  # asked for: relayed
        r = httpx.post(served.url + "/v1/completions", json=_body(False),
                       headers={"authorization": "Bearer key-long"}, timeout=10)
        assert r.status_code == 200
        assert fc.released == [("short", 1003, USED)] * 3 + [("long", 1003, USED)]
        assert fc.attained() == {"short": 3 * USED, "long": USED}
    finally:
        served.stop()


def test_gateway_streams_settle_from_their_usage_chunk(worker) -> None:
    fc = Recording()
    r = EppRouter([worker.url], flow_control=fc)
    try:
        r.wait_routable(1)
        for _ in range(2):
            ex = r.envoy.request("/v1/completions", json.dumps(_body(True)).encode())
            assert ex.status == 200, ex.immediate
            assert worker.bodies[-1]["stream_options"] == {"include_usage": True}
            assert b'"usage"' not in ex.body and ex.body.endswith(b"data: [DONE]\n\n")
        # (the gateway path costs max_tokens bounded by the context left: 400 - 3)
        assert fc.released == [("anonymous", 400, USED)] * 2
    finally:
        r.stop()


def test_a_stream_cut_short_counts_what_it_streamed() -> None:
    reader = StreamUsage(strip_usage=True)
    assert stream_used(reader, 3, 1003) is None  # nothing streamed: the up-front cost
    reader.feed(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}'
                b"\n\ndata: {\"choices\": [{\"text\": \"c\"")  # the third never ended
    assert stream_used(reader, 3, 1003) == 5
    assert stream_used(reader, 3, 4) == 4  # never above the up-front cost
    out = reader.feed(b'}]}\n\ndata: {"choices": [], "usage": {"total_tokens": 9}}\n\n'
                      b"data: [DONE]\n\n")
    assert b"usage" not in out and reader.events == 3
    assert stream_used(reader, 3, 1003) == 9  # the usage chunk, once seen


def test_with_a_rate_limit_too_both_settle_and_the_client_gets_no_usage(worker) -> None:
    from tandem.router.ratelimit import Limits, RateLimiter

    fc = Recording()
    limiter = RateLimiter(Limits(tokens_per_min=600))  # each stream is charged 400 up front
    served = router_app([worker.url], flow_control=fc, rate_limiter=limiter)
    try:
        _wait_ready(served.url, 1)
        for i in range(2):  # the 2nd fits only once the 1st was refunded to what it used
            r = httpx.post(served.url + "/v1/completions", json=_body(True), timeout=10)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert '"usage"' not in r.text
            deadline = time.monotonic() + 10  # the refund and release run in the background
            while time.monotonic() < deadline and not (len(fc.released) > i and limiter.local.level(
                    "anonymous", limiter.default, time.monotonic()) >= 600 - USED - 1):
                time.sleep(0.02)
        assert fc.released == [("anonymous", 1003, USED)] * 2
    finally:
        served.stop()
