"""Tokens-per-minute limits through a real router process and a real, password-protected
redis-server (its URL from an environment variable, `redis: env:VAR`): a request is charged
its worst case (the context left when max_tokens is unset, times n) and settled from the
usage its answer reports, so the unused tokens come back for the next request."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import httpx
import pytest
import redis
import yaml

from tandem.router.main import add_router_args, build
from tests.conftest import start_redis
from tests.router.stub_worker import COMPLETION_TOKENS, StubWorker, slow_stream
from tests.router.test_router_lifecycle import Router
from tests.serving.helpers import free_port

PASSWORD = "s3cret-pa55word"
TPM = 600  # 10 tokens/s refill
PROMPT = list(range(1, 101))  # 100 token ids: counted exactly, no tokenizer needed
CONTEXT = 400  # the stub's max_model_len


@pytest.fixture(scope="module")
def secret_redis(tmp_path_factory):
    proc, url, port = start_redis(tmp_path_factory.mktemp("redis-pw"), PASSWORD)
    yield url, port
    proc.terminate()
    proc.wait(timeout=10)


def level(r: redis.Redis) -> float:
    """The anonymous tenant's tokens bucket now, as the Lua script computes it."""
    got = r.hmget("tandem:rl:anonymous:tokens", "level", "ts")
    if got[0] is None:
        return float(TPM)
    sec, usec = r.time()
    return min(TPM, float(got[0]) + max(0.0, sec + usec / 1e6 - float(got[1])) * TPM / 60)


def settled(r: redis.Redis, at_least: float, timeout: float = 10.0) -> float:
    """The bucket's level once a background refund has lifted it to `at_least` (or the
    deadline passed: the caller's assertion then reports the level)."""
    deadline = time.monotonic() + timeout
    while (now := level(r)) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


def post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30,
                      json={"model": "stub-model", "prompt": PROMPT, **body})


def test_worst_case_charge_then_settle_through_shared_redis(tmp_path, secret_redis):
    url, port = secret_redis
    r = redis.Redis.from_url(url)
    worker = StubWorker(free_port(), max_model_len=CONTEXT)
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"rate_limits": {"default": {"tokens_per_min": TPM}},
                                   "redis": "env:TANDEM_TEST_REDIS_URL"}))
    os.environ["TANDEM_TEST_REDIS_URL"] = url
    try:
        router = Router(tmp_path, [worker.url], "--config", str(cfg))
    finally:
        del os.environ["TANDEM_TEST_REDIS_URL"]
    try:
        router.wait_ready()
        drift = 10 * 3 + 2  # refill over a few seconds of test, + rounding

        # A: streamed, no max_tokens: charged prompt + the context left (400), settled to 105
        out: dict = {}

        def stream() -> None:
            with httpx.stream("POST", router.url + "/v1/completions", timeout=30, json={
                    "model": "stub-model", "prompt": PROMPT, "stream": True},
                    headers=slow_stream(2, 1.0)) as resp:
                out["events"] = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]

        t = threading.Thread(target=stream)
        t.start()
        # in flight (its two events come a second apart): the worst case is charged; polled,
        # since on a loaded machine the request may reach the router late
        deadline = time.monotonic() + 1.5
        while level(r) > TPM - CONTEXT + drift and time.monotonic() < deadline:
            time.sleep(0.05)
        assert TPM - CONTEXT <= level(r) <= TPM - CONTEXT + drift
        t.join(timeout=30)
        used = len(PROMPT) + COMPLETION_TOKENS
        after_a = settled(r, TPM - used)  # the refund lands in the background
        assert TPM - used <= after_a <= TPM - used + drift
        assert worker.bodies[-1]["stream_options"] == {"include_usage": True}
        assert out["events"][-1] == "[DONE]" and len(out["events"]) == 3  # no usage chunk
        assert all("usage" not in json.loads(e) for e in out["events"][:-1])

        # B: the same again fits (400 <= ~495) only because A's unused tokens came back
        resp = post(router.url)
        assert resp.status_code == 200, resp.text
        after_b = settled(r, after_a - used - 1)
        assert after_a - used - 1 <= after_b <= after_a - used + drift

        # n multiplies the charge: 2 x (100 + 300) exceeds the whole budget
        resp = post(router.url, n=2)
        assert resp.status_code == 429 and "800 tokens" in resp.json()["error"]["message"]
        assert resp.json()["error"]["param"] == "max_tokens"

        # n=2, max_tokens=50: charged 2 x 150 = 300; used 100 + 2 x 5
        resp = post(router.url, n=2, max_tokens=50)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["total_tokens"] == 110
        after_c = settled(r, after_b - 110 - 1)
        assert after_b - 110 - 1 <= after_c <= after_b - 110 + drift

        # a worst case above what is left waits: 429 with Retry-After, never sent on
        sent = len(worker.bodies)
        resp = post(router.url, max_tokens=CONTEXT - len(PROMPT))  # 400 > ~280
        assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 5
        assert len(worker.bodies) == sent

        log = router.log()
        assert f"rate limits shared through Redis at redis://***@127.0.0.1:{port}/0" in log
        assert PASSWORD not in log
    finally:
        router.stop()
        worker.stop()


def test_an_unset_env_redis_url_names_the_variable(tmp_path):
    p = argparse.ArgumentParser()
    add_router_args(p)
    os.environ.pop("TANDEM_NO_SUCH_VAR", None)
    args = p.parse_args(["--workers", "http://127.0.0.1:1", "--redis", "env:TANDEM_NO_SUCH_VAR"])
    with pytest.raises(SystemExit, match="environment variable TANDEM_NO_SUCH_VAR"):
        build(args, {"rate_limits": {"default": {"tokens_per_min": 10}}})
    args = p.parse_args(["--workers", "http://127.0.0.1:1"])
    with pytest.raises(SystemExit, match="--index / index: environment variable TANDEM_NO_SU"):
        build(args, {"index": "env:TANDEM_NO_SUCH_VAR"})
