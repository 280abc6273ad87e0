"""Session affinity end to end: a real router in front of three stub workers answers with
an `x-session-token` naming (not revealing) the worker that served, streamed or not, and a
request carrying it goes back there, under both the cache-aware and the cost policy; a
forged, over-long or stale token (its worker gone) is ignored."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.router.core import Router, RouterSettings
from tandem.router.scorers.session import MAX_TOKEN_CHARS, SESSION_HEADER, tokens_for
from tests.router.stub_worker import StubWorker
from tests.router.test_router_app import _wait_ready, router_app
from tests.serving.helpers import free_port

HEADER = SESSION_HEADER


def _served_by(workers: list[StubWorker], before: list[int]) -> int:
    """The index of the one worker that received a request since `before` (body counts)."""
    [i] = [i for i, w in enumerate(workers) if len(w.bodies) > before[i]]
    return i


def _post(url: str, prompt: str, token: str | None = None, stream: bool = False
          ) -> httpx.Response:
    headers = {HEADER: token} if token is not None else {}
    return httpx.post(url + "/v1/completions", timeout=10, headers=headers, json={
        "model": "stub-model", "prompt": prompt, "max_tokens": 5, "stream": stream})


@pytest.fixture(scope="module")
def workers():
    ws = [StubWorker(free_port()) for _ in range(3)]
    yield ws
    for w in ws:
        w.stop()


@pytest.mark.parametrize("policy", ["cache-aware", "cost"])
def test_the_session_token_brings_a_client_back_to_its_worker(workers, policy):
    router = router_app([w.url for w in workers],
                        router=Router(RouterSettings(policy=policy, seed=0), lambda m: None))
    try:
        _wait_ready(router.url, 3)
        counts = lambda: [len(w.bodies) for w in workers]  # noqa: E731
        before = counts()
        first = _post(router.url, f"{policy} hello 0")
        assert first.status_code == 200, first.text
        home = _served_by(workers, before)
        token = first.headers[HEADER]
        assert token == tokens_for(None).token(workers[home].url)
        assert len(token) == 25 and str(workers[home].port) not in token  # names no address
        # without the token cold prompts spread over the workers (churn / cost spread them)
        spread = set()
        for i in range(9):
            before = counts()
            assert _post(router.url, f"{policy} cold {i} {'x' * 40 * i}").status_code == 200
            spread.add(_served_by(workers, before))
        assert len(spread) > 1
        # with it, every request (streamed or not) goes home, and the answer says so again
        for i in range(8):
            before = counts()
            r = _post(router.url, f"{policy} session {i} {'y' * 40 * i}", token, stream=i % 2)
            assert r.status_code == 200 and _served_by(workers, before) == home
            assert r.headers[HEADER] == token
            if i % 2:
                assert r.text.rstrip().endswith("data: [DONE]")
        # a forged or over-long token is ignored (the request is served as any other)
        for bad in ("v1.AAAAAAAAAAAAAAAAAAAAAA", "v1." + "A" * MAX_TOKEN_CHARS, "garbage"):
            r = _post(router.url, f"{policy} forged", bad)
            assert r.status_code == 200 and r.headers[HEADER] != bad
        # an error answer names no worker
        r = httpx.post(router.url + "/v1/completions", timeout=10, headers={HEADER: token},
                       json={"model": "no-such-model", "prompt": "x"})
        assert r.status_code == 404 and HEADER not in r.headers
    finally:
        router.stop()


def test_a_stale_token_is_ignored():
    ws = [StubWorker(free_port()) for _ in range(2)]
    router = router_app([w.url for w in ws])
    try:
        _wait_ready(router.url, 2)
        before = [len(w.bodies) for w in ws]
        first = _post(router.url, "stale hello")
        home = _served_by(ws, before)
        token = first.headers[HEADER]
        ws[home].stop()  # its worker goes: the probe marks it unready
        deadline = time.monotonic() + 10
        while httpx.get(router.url + "/ready", timeout=5).json()["ready_workers"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        other = 1 - home
        for i in range(3):
            r = _post(router.url, f"stale again {i}", token)
            assert r.status_code == 200, r.text
            assert r.headers[HEADER] == tokens_for(None).token(ws[other].url) != token
    finally:
        router.stop()
        ws[1 - home].stop()


def test_tokens_are_keyed_and_resolve_only_among_the_candidates():
    public, keyed = tokens_for(None), tokens_for(b"k" * 32)
    a, b = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    assert public.token(a) != keyed.token(a) and public.token(a) != public.token(b)
    assert tokens_for(None).token(a) == public.token(a)  # one codec per key
    fresh = type(public)(public.key)  # another process with the same key: the same tokens
    assert fresh.worker(public.token(b), [a, b]) == b
    assert fresh.worker(public.token(b), [a]) is None  # its worker is not a candidate
    assert fresh.worker(keyed.token(a), [a, b]) is None  # another key's token
    assert fresh.worker(None, [a]) is None and fresh.worker("", [a]) is None
