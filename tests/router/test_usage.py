"""Token accounting: the worst case charged up front, the bucket's refund arithmetic
(randomized), usage read from answers and streams, and `env:VAR` Redis URLs."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from tandem.router.ratelimit import Limits, LocalBuckets, RateLimiter
from tandem.router.redis_url import masked, resolve
from tandem.router.usage import (
    UNKNOWN_CONTEXT_OUTPUT,
    Settlement,
    answer_usage,
    drain_refunds,
    worst_case,
)


def test_worst_case_counts_every_token_the_request_allows():
    # max_tokens, bounded by the context left
    assert worst_case("completions", {"max_tokens": 50}, 100, 4096) == (150, 100)
    assert worst_case("completions", {"max_tokens": 5000}, 100, 4096) == (4096, 100)
    # no max_tokens: to the end of the context (not a fixed 16)
    assert worst_case("chat", {}, 100, 4096) == (4096, 100)
    assert worst_case("chat", {"max_completion_tokens": 7, "max_tokens": 99}, 10, None) == (
        17, 10)
    assert worst_case("completions", {}, 10, None) == (10 + UNKNOWN_CONTEXT_OUTPUT, 10)
    # n (or a larger best_of) sequences each
    assert worst_case("completions", {"max_tokens": 50, "n": 3}, 100, 4096) == (450, 100)
    assert worst_case("completions", {"max_tokens": 50, "n": 2, "best_of": 4}, 100,
                      None) == (600, 100)
    assert worst_case("chat", {"n": 2}, 100, 1000) == (2000, 100)
    # a batch: the other prompts by their ids, or their bytes + 2
    assert worst_case("completions", {"prompt": ["abc", "héllo"], "max_tokens": 10}, 4,
                      None) == (4 + 10 + (6 + 2) + 10, 12)
    assert worst_case("completions", {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 1}, 2,
                      100) == (3 + 4, 5)


def test_refunds_keep_the_bucket_between_worst_case_and_actual_use():
    """Random requests on one tenant's token bucket, each charged its worst case and later
    settled with what it used. At every step the level is at least that of a bucket charged
    the same admitted worst cases that never refunds (no more charged than the worst cases)
    and at most the ledger
    start + refill - used - still reserved (no fewer than actually used), and each refund is
    at most the request's unused part (all of it unless the bucket is full)."""
    rng = random.Random(20)
    for trial in range(200):
        cap = rng.choice([100, 600, 5000])
        lim = Limits(tokens_per_min=cap)
        rate = cap / 60
        live = LocalBuckets()
        now, ledger, never, open_ = 0.0, float(cap), float(cap), []
        for _ in range(60):
            dt = rng.choice([0.0, 0.0, rng.uniform(0, 2), rng.uniform(0, 30)])
            now += dt
            ledger += dt * rate
            never = min(cap, never + dt * rate)
            if open_ and rng.random() < 0.5:
                worst, used = open_.pop(rng.randrange(len(open_)))
                before = live.level("t", lim, now)
                after = live.credit("t", lim, worst - used, now)
                assert 0 <= after - before <= worst - used + 1e-9
                if before + (worst - used) <= cap:
                    assert after == pytest.approx(before + worst - used)
                ledger += worst - used
            else:
                worst = rng.randint(1, cap)
                used = rng.randint(0, worst)
                v = live.acquire("t", lim, worst, now)
                if v.allowed:
                    assert v.charged == worst
                    ledger -= worst
                    never -= worst
                    open_.append((worst, used))
            ledger = min(ledger, cap)  # the real bucket cannot hold more either
            level = live.level("t", lim, now)
            assert never - 1e-6 <= level <= cap + 1e-9, trial
            assert level <= ledger + 1e-6, trial


def test_answer_usage_reads_usage_else_bounds_the_text():
    body = {"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                   "total_tokens": 5}}
    assert answer_usage(json.dumps(body).encode()) == (5, 0)
    body = {"choices": [{"message": {"content": "héllo"}}, {"text": "ab"}]}
    assert answer_usage(json.dumps(body).encode()) == (None, (6 + 1) + (2 + 1))
    assert answer_usage(b"not json") == (None, 8)


def _sse(*docs: object) -> list[bytes]:
    return [f"data: {d if isinstance(d, str) else json.dumps(d)}\n\n".encode() for d in docs]


def test_stream_tap_settles_from_the_usage_chunk_and_strips_it():
    async def run(chunks: list[bytes], strip: bool) -> tuple[bytes, float]:
        limiter = RateLimiter(Limits(tokens_per_min=1000))
        v = await limiter.acquire("t", 600)
        bill = Settlement(limiter, "t", v, prompt_share=100)

        async def source():  # noqa: ANN202
            for c in chunks:
                yield c

        out = b"".join([c async for c in bill.tap(source(), strip)])
        await drain_refunds()  # the refund runs in the background
        return out, limiter.local.level("t", limiter.default, __import__("time").monotonic())

    usage = {"id": "x", "choices": [], "usage": {"total_tokens": 130}}
    token = {"id": "x", "choices": [{"index": 0, "text": "a"}]}
    events = _sse(token, token, usage, "[DONE]")
    wire = b"".join(events)
    # split anywhere: the tap reassembles events
    pieces = [wire[i:i + 7] for i in range(0, len(wire), 7)]
    out, level = asyncio.run(run(pieces, strip=True))
    assert out == b"".join(_sse(token, token, "[DONE]"))
    assert level == pytest.approx(1000 - 130, abs=1)
    out, level = asyncio.run(run(events, strip=False))
    assert out == wire
    assert level == pytest.approx(870, abs=1)
    # no usage chunk: the prompt share + one token per streamed byte stay charged
    out, level = asyncio.run(run(_sse(token, "[DONE]"), strip=True))
    bound = sum(len(e) - 1 for e in _sse(token, "[DONE]"))
    assert level == pytest.approx(1000 - 100 - bound, abs=1)


def test_env_redis_urls_are_resolved_and_masked():
    env = {"REDIS_URL": "redis://:pa55@redis.ns.svc:6379/0"}
    assert resolve("env:REDIS_URL", "--redis", env) == env["REDIS_URL"]
    assert resolve("redis://h:1/0", "--redis", env) == "redis://h:1/0"
    assert resolve(None, "--redis", env) is None
    with pytest.raises(ValueError, match="environment variable MISSING") as e:
        resolve("env:MISSING", "--index", env)
    assert "--index" in str(e.value)
    with pytest.raises(ValueError, match="not env:VARIABLE_NAME"):
        resolve("env:9 bad", "--redis", env)
    assert masked(env["REDIS_URL"]) == "redis://***@redis.ns.svc:6379/0"
    assert masked("rediss://user:pw@h:6380/1?password=pw2&db=1") == (
        "rediss://***@h:6380/1?password=***&db=1")
    assert masked("redis://h:6379/0") == "redis://h:6379/0"


def test_a_stopping_limiter_waits_for_the_refunds_in_flight(redis_url):
    """A refund settled just before shutdown still reaches Redis: `drain_refunds` (which the
    router's shutdown runs before closing its limiter) waits for it, leaving nothing pending."""
    import time

    import redis

    async def run() -> None:
        limiter = RateLimiter(Limits(tokens_per_min=1000), redis_url=redis_url,
                              timeout_s=2.0, prefix=f"drain{time.monotonic_ns()}")
        v = await limiter.acquire("t", 600)
        assert v.shared and v.charged == 600
        Settlement(limiter, "t", v, prompt_share=100).settle(total=130)
        await drain_refunds()
        await limiter.close()
        level = float(redis.Redis.from_url(redis_url).hget(
            f"{limiter.prefix}:t:tokens", "level"))
        assert level == pytest.approx(870, abs=2)

    asyncio.run(run())
