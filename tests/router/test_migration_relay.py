"""The router's migrating relay (`router.migration`) against scripted stub workers on real
ports: what the next worker is sent (signed resume), what the client sees, the bound, and
the wire format (`protocol.migration`)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.protocol.migration import (
    MAX_RESUME_TOKENS,
    RESUME_HEADER,
    TOKENS_HEADER,
    Resume,
    parse_tokens_comment,
    signed_target,
    tokens_comment,
)
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey
from tandem.protocol.web import DRAINING_CODE, error_body
from tandem.router import migration
from tandem.router.migration import Events, Migration, StreamState, take_event
from tandem.router.pd import Route
from tandem.router.policy import Decision
from tandem.router.proxy import ProxySettings, forward, upstream_session
from tandem.router.workers import Worker
from tests.router.test_router_app import Served
from tests.serving.helpers import worker_key_file

BODY = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()


def event(body: dict, sent: int | None = None, ids: list[int] | None = None) -> str:
    head = tokens_comment(sent, ids or []) if sent is not None else ""
    return f"{head}data: {json.dumps(body)}\n\n"


def chunk(text: str) -> dict:
    return {"id": "cmpl-a", "created": 11, "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


class Script:
    """A stub worker answering each POST with the next scripted reply: a list of SSE
    pieces (then EOF, or a dropped connection with `drop`), or a whole JSON body."""

    def __init__(self, replies: list) -> None:
        self.replies = replies
        self.seen: list[dict[str, str]] = []
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            self.seen.append(dict(request.headers))
            reply = self.replies.pop(0)
            if isinstance(reply, dict):
                if reply.get("drop"):
                    return StreamingResponse(_drop(['{"id": "x", "cho', "drop"]),
                                             media_type="application/json")
                return JSONResponse(reply)
            return StreamingResponse(_drop(reply), media_type="text/event-stream")

        self.served = Served(app, lean=False)
        self.url = self.served.url


async def _drop(pieces: list[str]):  # noqa: ANN202 - the pieces, then "drop": a reset
    for p in pieces:
        if p == "drop":
            raise RuntimeError("worker died")  # uvicorn aborts the chunked response
        yield p
        await asyncio.sleep(0)


def run(scripts: list[Script], key: WorkerKey, stream: bool = True, max_migrations: int = 3,
        retries: int = 2):
    """Forward BODY over the scripts' workers (in order); (client bytes or body, results)."""
    workers = [Worker(id=s.url) for s in scripts]
    results: list[tuple[str, str]] = []

    def pick(tried: set[str]) -> Route | None:
        free = [w for w in workers if w.id not in tried]
        return Route(Decision(free[0], "load", 0)) if free else None

    async def go():  # noqa: ANN202
        http = upstream_session(ProxySettings())
        try:
            resp = await forward(http, "/v1/completions", BODY, "rid", pick, stream,
                                 ProxySettings(retries=retries, backoff_s=0), lambda a: None,
                                 key, Migration(max_migrations,
                                                lambda *r: results.append(r)))
            if not stream:
                return resp.body
            return b"".join([c async for c in resp.body_iterator])
        finally:
            await http.close()

    return asyncio.run(go()), results


@pytest.fixture()
def key(tmp_path) -> WorkerKey:
    return WorkerKey(worker_key_file(tmp_path))


def test_a_draining_worker_s_stream_resumes_signed_on_the_next(key):
    a = Script([[chunk_ev := event(chunk("Hel"), 3, [5, 6]), event(chunk("lo"), 5, [7]),
                 event(error_body(503, "draining") | {"error": {
                     **error_body(503, "draining")["error"], "code": DRAINING_CODE}}, 5),
                 "data: [DONE]\n\n"]])
    b = Script([[event(chunk(" world"), 11, [8, 9]), "data: [DONE]\n\n"]])
    out, results = run([a, b], key)
    assert out.decode() == (chunk_ev.split("\n", 1)[1] + f"data: {json.dumps(chunk('lo'))}\n\n"
                            + f"data: {json.dumps(chunk(' world'))}\n\n" + "data: [DONE]\n\n")
    assert results == [("resumed", "draining")]
    first, second = a.seen[0], b.seen[0]
    assert first[TOKENS_HEADER] == "1" and RESUME_HEADER not in first
    assert Resume.decode(second[RESUME_HEADER]) == Resume("cmpl-a", 11, 5, [5, 6, 7])
    assert "x-tandem-prefill" not in second  # resumed aggregated
    # signed for the body and both headers: a worker with the key verifies it
    key.verify(second[SIGNATURE_HEADER.lower()], BODY, signed_target(None, second))


def test_a_reset_before_anything_was_sent_resends_the_request_afresh(key):
    a = Script([["drop"]])
    b = Script([[event(chunk("ok"), 2, [4]), "data: [DONE]\n\n"]])
    out, results = run([a, b], key)
    assert out.decode() == f"data: {json.dumps(chunk('ok'))}\n\ndata: [DONE]\n\n"
    assert results == [("resumed", "connection")] and RESUME_HEADER not in b.seen[0]


def test_a_stream_without_token_ids_is_not_migrated(key):
    a = Script([[event(chunk("x")), "drop"]])
    b = Script([])
    out, results = run([a, b], key)
    events = out.decode().split("\n\n")
    assert events[0] == f"data: {json.dumps(chunk('x'))}"
    assert json.loads(events[1][6:])["error"]["code"] == 502 and events[2] == "data: [DONE]"
    assert results == [("not_replayable", "connection")] and b.seen == []


def test_the_bound_ends_the_stream_with_the_last_error_event(key):
    drain = {"error": {**error_body(503, "gone")["error"], "code": DRAINING_CODE}}
    a = Script([[event(chunk("a"), 1, [1]), event(drain, 1), "data: [DONE]\n\n"]])
    b = Script([[event(chunk("b"), 2, [2]), event(drain, 2), "data: [DONE]\n\n"]])
    c = Script([])
    out, results = run([a, b, c], key, max_migrations=1)
    assert out.decode() == (f"data: {json.dumps(chunk('a'))}\n\n"
                            f"data: {json.dumps(chunk('b'))}\n\n"
                            f"data: {json.dumps(drain)}\n\ndata: [DONE]\n\n")
    assert results == [("resumed", "draining"), ("limit", "draining")] and c.seen == []
    assert Resume.decode(b.seen[0][RESUME_HEADER]).token_ids == [1]


def test_a_client_error_event_is_relayed_not_migrated(key):
    timeout = error_body(504, "request timed out")
    a = Script([[event(chunk("a"), 1, [1]), event(timeout, 1), "data: [DONE]\n\n"]])
    out, results = run([a, Script([])], key)
    assert out.decode().endswith(f"data: {json.dumps(timeout)}\n\ndata: [DONE]\n\n")
    assert results == []


def test_a_non_streamed_request_cut_mid_body_is_retried_elsewhere(key):
    whole = {"id": "cmpl-b", "choices": []}
    a, b = Script([{"drop": True}]), Script([whole])
    body, results = run([a, b], key, stream=False)
    assert json.loads(body) == whole and results == [("retried", "connection")]
    assert TOKENS_HEADER not in a.seen[0]  # nothing streamed: no token ids asked for


def test_take_event_and_split_events_follow_random_chunkings():
    rng = random.Random(3)
    for _ in range(300):
        ids = [[rng.randrange(1000) for _ in range(rng.randint(0, 4))] for _ in range(5)]
        sent = 0
        wire = ""
        for t in ids:
            sent += len(t)
            wire += event(chunk("x" * len(t)) | {"id": "c", "created": 9}, sent, t)
        wire += "data: [DONE]\n\n"
        raw = wire.encode()
        cuts = sorted(rng.sample(range(1, len(raw)), 6))
        state, events, out = StreamState(), Events(), b""
        for lo, hi in zip([0, *cuts], [*cuts, len(raw)], strict=True):
            for ev, whole in events.feed(raw[lo:hi]):
                assert whole
                out += take_event(ev, state)[0]
        assert state.token_ids == [t for ts in ids for t in ts] and state.done
        assert state.sent_chars == sent and state.replayable
        assert (state.response_id, state.created) == ("c", 9)
        assert b"tandem-tokens" not in out and out.count(b"data: ") == 6


def test_an_overlong_event_passes_unparsed_and_memory_stays_bounded(monkeypatch):
    monkeypatch.setattr(migration, "MAX_EVENT_BYTES", 400)
    rng = random.Random(5)
    passed = 0
    for _ in range(200):
        small = [event(chunk("a") | {"id": "c", "created": 9}, 1, [1]) for _ in range(2)]
        big = "data: " + "x" * rng.randint(400, 1500) + "\n\n"  # over the bound
        raw = (small[0] + big + small[1]).encode()
        cuts = sorted(rng.sample(range(1, len(raw)), 5))
        events, pieces = Events(), []
        for lo, hi in zip([0, *cuts], [*cuts, len(raw)], strict=True):
            pieces += events.feed(raw[lo:hi])
            assert len(events.buffer) <= 400
        state, out = StreamState(), b""
        for piece, whole in pieces:
            out += take_event(piece, state)[0] if whole else piece
        # the overlong event reaches the client whole, the others as before
        assert out == (f"data: {json.dumps(chunk('a') | {'id': 'c', 'created': 9})}\n\n"
                       + big + f"data: {json.dumps(chunk('a') | {'id': 'c', 'created': 9})}"
                       "\n\n").encode()
        assert not events.overlong and not events.buffer
        passed += not all(whole for _, whole in pieces)
    assert passed == 200  # however it was cut, the overlong event was passed on unparsed


def test_a_stream_with_an_overlong_event_passes_it_on_and_is_not_migrated(key, monkeypatch):
    monkeypatch.setattr(migration, "MAX_EVENT_BYTES", 400)
    big = event(chunk("y" * 1000), 1001, [3])  # one event over the bound
    a = Script([[event(chunk("x"), 1, [2]), big[:500], big[500:], "drop"]])
    b = Script([])
    out, results = run([a, b], key)
    events = out.decode().split("\n\n")
    assert events[0] == f"data: {json.dumps(chunk('x'))}"
    assert events[1] + "\n\n" == big  # as the worker sent it: not parsed
    assert json.loads(events[2][6:])["error"]["code"] == 502 and events[3] == "data: [DONE]"
    assert results == [("not_replayable", "connection")] and b.seen == []


def test_token_ids_past_the_resume_bound_are_not_kept():
    state = StreamState()
    per = [1] * 1000
    for n in range(MAX_RESUME_TOKENS // 1000):
        take_event(event(chunk("x"), n, per).encode()[:-2], state)
    assert state.replayable and len(state.token_ids) == MAX_RESUME_TOKENS // 1000 * 1000
    take_event(event(chunk("x"), 1, per).encode()[:-2], state)  # past MAX_RESUME_TOKENS
    assert not state.replayable and state.id_chunks == []
    take_event(event(chunk("x"), 1, per).encode()[:-2], state)
    assert state.id_chunks == []  # nothing kept once the stream cannot be resumed
    for bad in (tokens_comment(1, [1]).replace("1 1", "1 " + "9" * 11),  # an 11-digit id
                tokens_comment(1, [1]).replace(" 1 ", " " + "1" * 11 + " ")):  # sent_chars
        state = StreamState()
        take_event(f"{bad}data: {json.dumps(chunk('x'))}".encode(), state)
        assert not state.replayable and state.id_chunks == []


def test_the_resume_header_round_trips_and_refuses_bad_values():
    r = Resume("chatcmpl-1", 17, 4, [0, 1, 2**32 - 1])
    assert Resume.decode(r.encode()) == r
    assert parse_tokens_comment(tokens_comment(3, [1, 2]).strip("\n").encode()) == (3, [1, 2])
    assert parse_tokens_comment(b": tandem-tokens x 1") is None
    too_many = Resume("a", 1, 0, [1] * (MAX_RESUME_TOKENS + 1)).encode()
    for bad in ("", "a;1;0", "a b;1;0;AQAAAA==", "a;-1;0;AQAAAA==", "a;1;0;!!", "a;1;0;AQA=",
                too_many):
        with pytest.raises(ValueError):
            Resume.decode(bad)


def test_a_stream_cut_after_its_finish_reason_just_ends(key):
    last = chunk("!") | {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}
    a = Script([[event(chunk("a"), 1, [1]), event(last, 2, [2]), "drop"]])
    out, results = run([a, Script([])], key)
    assert out.decode() == (f"data: {json.dumps(chunk('a'))}\n\ndata: {json.dumps(last)}\n\n"
                            "data: [DONE]\n\n")
    assert results == [("finished", "connection")]


def test_max_migrations_from_flags_and_router_yaml(tmp_path):
    import argparse

    from tandem.router.config import RouterConfigError
    from tandem.router.main import add_router_args, build

    def settings(*argv: str) -> int:
        p = argparse.ArgumentParser()
        add_router_args(p)
        return build(p.parse_args(["--workers", "http://a:1", *argv]))[2].proxy.max_migrations

    cfg = tmp_path / "router.yaml"
    cfg.write_text("max_migrations: 5\n")
    assert settings() == 3
    assert settings("--config", str(cfg)) == 5
    assert settings("--config", str(cfg), "--max-migrations", "0") == 0
    with pytest.raises(SystemExit, match="max_migrations: a number of migrations >= 0"):
        settings("--max-migrations", "-1")
    cfg.write_text("max_migrations: -1\n")
    with pytest.raises(RouterConfigError, match="max_migrations"):
        settings("--config", str(cfg))
