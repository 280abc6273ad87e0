"""Guardrails on the gateway path (`router.extproc`): input refusals as immediate responses,
output guardrails on the response body (`extproc.output`). First with the in-process ext_proc
client, feeding the picker response bodies chunked as the test likes; then through a real
Envoy (`test_extproc_envoy`'s binary and configuration) in front of a stub worker."""

from __future__ import annotations

import contextlib
import json
import queue
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tandem.router.extproc import stream as extproc_stream
from tandem.router.guardrails import Guardrails
from tests.router.extproc_client import EppRouter, Stream
from tests.router.stub_worker import StubWorker, slow_stream
from tests.router.test_extproc_envoy import (  # noqa: F401 - envoy_bin: a fixture
    CONFIG,
    TYPES,
    envoy_bin,
    running_envoy,
)
from tests.serving.helpers import free_port

MODEL = "stub-model"
GUARDRAILS = {
    "input": [{"name": "no-forbidden", "type": "blocklist", "action": "refuse",
               "terms": ["forbidden"]}],
    "output": [{"name": "hide", "type": "regex", "action": "redact", "pattern": "t1|bcd",
                "replacement": "[x]"},
               {"name": "halt", "type": "regex", "action": "stop", "pattern": "t3"}]}
STOP_ALL = {"output": [{"name": "halt-all", "type": "regex", "action": "stop",
                        "pattern": "bcd"}]}
SSE = "text/event-stream"


def _body(prompt: str, **extra) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5, **extra}).encode()


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"id": "c", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": None}]}).encode() + b"\n\n"


def _headers(items: dict[str, str], eos: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]),
        end_of_stream=eos)


def _decisions(r: EppRouter, name: str, verdict: str) -> float:
    return r.metric("tandem_router_guardrail_decisions_total",
                    {"guardrail": name, "layer": "output", "verdict": verdict})


@pytest.fixture(scope="module")
def worker():
    w = StubWorker(free_port())
    yield w
    w.stop()


@pytest.fixture(scope="module")
def epp(worker):
    r = EppRouter([worker.url], guardrails=Guardrails.from_config(GUARDRAILS))
    r.wait_routable(1)
    yield r
    r.stop()


def _routed(r: EppRouter, body: bytes) -> Stream:
    """A request through the picker up to its pick; the stream, for the answer."""
    s = Stream(r.envoy.stub)
    s.send(pb.ProcessingRequest(request_headers=_headers(
        {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"})))
    s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    assert s.recv().WhichOneof("response") == "request_headers"
    while not s.recv().request_body.response.body_mutation.streamed_response.end_of_stream:
        pass
    return s


def _answer(s: Stream, content_type: str | None, chunks: list[bytes], eos: bool = True
            ) -> list[pb.ProcessingResponse]:
    """Play the worker's answer (`chunks`, the last with end_of_stream when `eos`; no
    response headers message when `content_type` is None); the picker's answers until the
    client's body ends (or an immediate response)."""
    if content_type is not None:
        s.send(pb.ProcessingRequest(response_headers=_headers(
            {":status": "200", "content-type": content_type})))
    for n, chunk in enumerate(chunks):
        s.send(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=chunk, end_of_stream=eos and n == len(chunks) - 1)))
    out = []
    while True:
        answer = s.recv()
        out.append(answer)
        which = answer.WhichOneof("response")
        streamed = answer.response_body.response.body_mutation.streamed_response
        if which == "immediate_response" or (which == "response_body"
                                             and streamed.end_of_stream):
            return out


def _body_of(answers: list[pb.ProcessingResponse]) -> bytes:
    return b"".join(a.response_body.response.body_mutation.streamed_response.body
                    for a in answers if a.WhichOneof("response") == "response_body")


def _texts(sse: bytes) -> tuple[str, list[dict]]:
    """(the text streamed, the other JSON events) of an SSE body that ends with [DONE]."""
    events = [e[6:] for e in sse.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]", events
    docs = [json.loads(e) for e in events[:-1]]
    text = "".join(c["text"] for d in docs for c in d.get("choices", ()))
    return text, [d for d in docs if "error" in d]


def test_an_input_refusal_is_an_immediate_400_and_nothing_is_picked(epp, worker) -> None:
    before = len(worker.bodies)
    routed = epp.metric("tandem_router_extproc_picks_total", {"outcome": "routed"})
    ex = epp.envoy.request("/v1/completions", _body("say the forbidden word"))
    assert ex.immediate is not None and ex.pick is None
    assert ex.immediate.status.code == 400
    err = json.loads(ex.immediate.body)["error"]
    assert err["code"] == "guardrail" and "no-forbidden" in err["message"]
    assert len(worker.bodies) == before
    assert epp.metric("tandem_router_extproc_picks_total", {"outcome": "routed"}) == routed


def test_a_streamed_match_split_across_body_messages_is_redacted(epp) -> None:
    s = _routed(epp, _body("stream", stream=True))
    first, second = _event("ab t"), _event("1 cd")
    # the match spans two events, and the second event spans two body messages
    answers = _answer(s, SSE, [first + second[:9], second[9:], b"data: [DONE]\n\n"])
    assert answers[0].WhichOneof("response") == "response_headers"  # not held for a stream
    text, errors = _texts(_body_of(answers))
    assert text == "ab [x] cd" and not errors
    s.close()
    assert s.recv() is None


def test_answers_are_guarded_when_the_gateway_skips_the_response_headers(epp) -> None:
    s = _routed(epp, _body("stream", stream=True))
    answers = _answer(s, None, [_event("ab t"), _event("1 cd"), b"data: [DONE]\n\n"])
    assert _texts(_body_of(answers)) == ("ab [x] cd", [])
    s.close()
    s = _routed(epp, _body("whole"))
    raw = json.dumps({"choices": [{"index": 0, "text": "abcde", "finish_reason": "length"}]})
    answers = _answer(s, None, [raw[:10].encode(), raw[10:].encode()])
    assert json.loads(_body_of(answers))["choices"][0]["text"] == "a[x]e"
    s.close()


def test_a_stop_ends_the_stream_with_the_error_event_and_done(epp) -> None:
    before = _decisions(epp, "halt", "stop")
    s = _routed(epp, _body("stream", stream=True))
    answers = _answer(s, SSE, [_event("t0"), _event("t2 t"), _event("3 t4"), _event("t5")],
                      eos=False)
    text, errors = _texts(_body_of(answers))
    assert text == "t0t2 " and len(errors) == 1
    assert errors[0]["error"]["code"] == "guardrail" and "halt" in errors[0]["error"]["message"]
    # what the worker still sends is not answered: the client's body is over
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=_event("t6"),
                                                          end_of_stream=True)))
    with pytest.raises(queue.Empty):
        s.recv(timeout=0.3)
    s.close()
    assert s.recv() is None
    assert _decisions(epp, "halt", "stop") == before + 1  # audited once


def test_a_whole_answer_is_held_and_redacted(epp) -> None:
    s = _routed(epp, _body("whole"))
    doc = {"id": "c", "object": "text_completion", "choices": [
        {"index": 0, "text": "abcde", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}}
    raw = json.dumps(doc).encode()
    answers = _answer(s, "application/json", [raw[:20], raw[20:]])
    # the headers answer waits for the body's end, then the rewritten body follows
    assert [a.WhichOneof("response") for a in answers][:2] == ["response_headers",
                                                               "response_body"]
    got = json.loads(_body_of(answers))
    assert got["choices"][0]["text"] == "a[x]e" and got["usage"]["total_tokens"] == 6
    s.close()


def test_a_stopped_whole_answer_becomes_a_400(epp) -> None:
    s = _routed(epp, _body("whole"))
    raw = json.dumps({"choices": [{"index": 0, "text": "t2 t3", "finish_reason": "length"}]})
    (answer,) = _answer(s, "application/json", [raw.encode()])
    assert answer.immediate_response.status.code == 400
    err = json.loads(answer.immediate_response.body)["error"]
    assert err["code"] == "guardrail" and "halt" in err["message"]
    assert s.recv() is None  # an immediate response ends the stream


def test_a_whole_answer_over_the_limit_fails_closed(epp, monkeypatch) -> None:
    monkeypatch.setattr(extproc_stream, "MAX_USAGE_BYTES", 1000)
    s = _routed(epp, _body("whole"))
    (answer,) = _answer(s, "application/json", [b"x" * 600, b"y" * 600, b"z"])
    assert answer.immediate_response.status.code == 502
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "guardrail"
    assert s.recv() is None


# -- through a real Envoy ------------------------------------------------------------------
@contextlib.contextmanager
def _envoy_gateway(envoy: Path, worker: StubWorker, config: str
                   ) -> Iterator[tuple[str, EppRouter]]:
    """Envoy (its `config` template) in front of a guarded picker over `worker`: (its URL,
    the picker), once Envoy routes."""
    router = EppRouter([worker.url], guardrails=Guardrails.from_config(GUARDRAILS))
    router.wait_routable(1)
    listen = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(config.format(listen=listen, epp=router.port, types=TYPES))
        try:
            with running_envoy(envoy, path, listen) as url:
                deadline = time.monotonic() + 10
                while httpx.get(f"{url}/v1/models", timeout=10).status_code != 200:
                    assert time.monotonic() < deadline, "Envoy did not find the picker"
                    time.sleep(0.2)
                yield url, router
        finally:
            router.stop()


@pytest.fixture(scope="module")
def gateway(envoy_bin, worker):  # noqa: F811 - the fixture imported above
    with _envoy_gateway(envoy_bin, worker, CONFIG) as got:
        yield got


def test_envoy_never_forwards_a_refused_request(gateway, worker) -> None:
    url, _router = gateway
    before = len(worker.bodies)
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "forbidden"},
                      timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "guardrail"
    assert len(worker.bodies) == before


def assert_redacted_answers(url: str) -> None:
    """Through Envoy at `url`: a whole answer and a streamed one, each with its match
    redacted."""
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "p"},
                      timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "a[x]e"
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30, headers=slow_stream(3),
                      json={"model": MODEL, "prompt": "s", "stream": True}) as resp:
        assert resp.status_code == 200
        body = b"".join(resp.iter_raw())
    assert _texts(body) == ("t0[x]t2", [])


def test_envoy_relays_redacted_answers(gateway) -> None:
    assert_redacted_answers(gateway[0])


def test_envoy_aborts_the_workers_stream_on_a_stop(gateway, worker) -> None:
    url, _router = gateway
    finished, aborted = worker.finished_streams, worker.aborted_streams
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      headers=slow_stream(60, 0.05),
                      json={"model": MODEL, "prompt": "s", "stream": True}) as resp:
        assert resp.status_code == 200
        body = b"".join(resp.iter_raw())
    text, errors = _texts(body)
    assert text == "t0[x]t2" and errors[0]["error"]["code"] == "guardrail"
    assert time.monotonic() - t0 < 2.5  # the client's answer ended at the stop
    deadline = time.monotonic() + 5
    while worker.aborted_streams == aborted:  # the worker saw its stream cut short
        assert time.monotonic() < deadline, "the worker's stream was not aborted"
        time.sleep(0.05)
    assert worker.finished_streams == finished


def test_envoy_answers_a_stopped_whole_answer_400(gateway) -> None:
    url, router = gateway
    settings = router.ra.settings
    kept, settings.guardrails = settings.guardrails, Guardrails.from_config(STOP_ALL)
    try:
        resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "p"},
                          timeout=30)
    finally:
        settings.guardrails = kept
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert err["code"] == "guardrail" and "halt-all" in err["message"]


def test_a_held_whole_answer_settles_the_rate_limit_from_its_usage(worker) -> None:
    from tandem.router.ratelimit import Limits, RateLimiter

    limiter = RateLimiter(Limits(tokens_per_min=60))  # 1 token/s back
    r = EppRouter([worker.url], guardrails=Guardrails.from_config(GUARDRAILS),
                  rate_limiter=limiter)
    try:
        r.wait_routable(1)
        s = _routed(r, _body("whole"))  # charged its worst case: 7 + max_tokens 5
        raw = json.dumps({"choices": [{"index": 0, "text": "abcde", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                    "total_tokens": 2}}).encode()
        assert json.loads(_body_of(_answer(s, "application/json", [raw])))["choices"][0][
            "text"] == "a[x]e"
        s.close()
        # settled from the usage the guard read: 2 of the 12 charged stay charged (without
        # it, the prompt's 7-token estimate would)
        deadline = time.monotonic() + 0.5
        while (level := limiter.local.level("anonymous", limiter.default,
                                            time.monotonic())) < 60 - 2.5:
            assert time.monotonic() < deadline, level
            time.sleep(0.01)
        assert level < 60 - 1
    finally:
        r.stop()


@pytest.fixture(scope="module")
def gateway_skip(envoy_bin, worker):  # noqa: F811 - the fixture imported above
    """Envoy whose ext_proc skips the response headers (`response_header_mode: SKIP`)."""
    config = CONFIG.replace("response_header_mode: SEND", "response_header_mode: SKIP")
    assert config != CONFIG
    with _envoy_gateway(envoy_bin, worker, config) as got:
        yield got


def test_envoy_skipping_response_headers_still_guards_answers(gateway_skip) -> None:
    url, router = gateway_skip
    assert_redacted_answers(url)
    # a stopped whole answer: Envoy sent the worker's headers on already (the picker never
    # saw them), so no 400 can replace them; the body is cut off before any of the answer
    settings = router.ra.settings
    kept, settings.guardrails = settings.guardrails, Guardrails.from_config(STOP_ALL)
    got = b""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "p"}) as resp:
            assert resp.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                for chunk in resp.iter_raw():
                    got += chunk
    finally:
        settings.guardrails = kept
    assert b"bcd" not in got and b"choices" not in got  # nothing of the answer got out


def _until_trailers(s: Stream) -> list[pb.ProcessingResponse]:
    out = []
    while (answer := s.recv()) is not None:
        out.append(answer)
        if answer.WhichOneof("response") in ("response_trailers", "immediate_response"):
            break
    return out


def test_an_answer_ending_with_trailers_sends_what_was_held_first(epp) -> None:
    # an SSE answer: the text the scanner still holds goes out before the trailers' answer,
    # and the body never claims to end (the trailers do)
    s = _routed(epp, _body("stream", stream=True))
    s.send(pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": SSE})))
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=_event("ab t") + _event(
        "1 cd e"))))
    s.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    answers = _until_trailers(s)
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds[0] == "response_headers" and kinds[-1] == "response_trailers"
    assert not any(a.response_body.response.body_mutation.streamed_response.end_of_stream
                   for a in answers)
    events = [e for e in _body_of(answers).split(b"\n\n") if e]
    text = "".join(c["text"] for e in events for c in json.loads(e[6:])["choices"])
    assert text == "ab [x] cd e"
    s.close()
    # a JSON answer: held whole, rewritten, then the trailers
    s = _routed(epp, _body("whole"))
    s.send(pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": "application/json"})))
    raw = json.dumps({"choices": [{"index": 0, "text": "abcde", "finish_reason": "length"}]})
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=raw.encode())))
    s.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    answers = _until_trailers(s)
    assert [a.WhichOneof("response") for a in answers][-1] == "response_trailers"
    assert json.loads(_body_of(answers))["choices"][0]["text"] == "a[x]e"
    s.close()
    # stopped before the trailers: the body ended there, the trailers get no answer
    s = _routed(epp, _body("stream", stream=True))
    s.send(pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": SSE})))
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=_event("t2 t3 t4"))))
    answers = []
    while not (answers and answers[-1].response_body.response.body_mutation
               .streamed_response.end_of_stream):
        answers.append(s.recv())
    assert _texts(_body_of(answers))[1][0]["error"]["code"] == "guardrail"
    s.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    with pytest.raises(queue.Empty):
        s.recv(timeout=0.3)
    s.close()
