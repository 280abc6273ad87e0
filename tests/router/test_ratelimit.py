"""Per-tenant rate limits: the bucket rule alone, then shared by two router replicas through a
real redis-server, and the fallback when Redis is gone."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tandem.router.app import RouterServerSettings, build_app
from tandem.router.core import Router, RouterSettings
from tandem.router.monitor import MonitorSettings
from tandem.router.ratelimit import Limits, LocalBuckets, RateLimiter
from tests.serving.helpers import free_port

from .test_router_app import Served, _wait_ready, stub_openai


def test_request_bucket_bursts_then_refills():
    b, lim = LocalBuckets(), Limits(requests_per_s=2, burst_requests=3)
    assert [b.acquire("t", lim, 0, now=10.0).allowed for _ in range(4)] == [True] * 3 + [False]
    denied = b.acquire("t", lim, 0, now=10.0)
    assert denied.reason == "requests" and denied.retry_after_s == pytest.approx(0.5)
    assert b.acquire("t", lim, 0, now=10.5).allowed  # one refilled after 1/rate s
    assert not b.acquire("t", lim, 0, now=10.5).allowed
    assert b.acquire("other", lim, 0, now=10.5).allowed  # tenants are independent


def test_token_bucket_charges_prompt_plus_max_tokens():
    b, lim = LocalBuckets(), Limits(tokens_per_min=600)  # 10 tokens/s
    assert b.acquire("t", lim, 500, now=0.0).allowed
    v = b.acquire("t", lim, 200, now=0.0)
    assert not v.allowed and v.reason == "tokens" and v.retry_after_s == pytest.approx(10.0)
    assert b.acquire("t", lim, 200, now=10.0).allowed
    assert b.acquire("t", lim, 601, now=100.0).reason == "too_large"
    assert LocalBuckets().acquire("t", Limits(), 10**9, now=0).allowed  # no limits set


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="unknown"):
        Limits.from_dict({"requests_per_minute": 5})
    with pytest.raises(ValueError, match=">= 0"):
        Limits.from_dict({"requests_per_s": -1})


def test_two_replicas_share_one_budget_through_redis(redis_url):
    async def run() -> list[bool]:
        lim = Limits(requests_per_s=0.5, burst_requests=3)
        a = RateLimiter(lim, redis_url=redis_url, prefix="t1")
        b = RateLimiter(lim, redis_url=redis_url, prefix="t1")
        try:
            got = [(await r.acquire("alpha", 10)).allowed for r in (a, b, a, b, a)]
            denied = await b.acquire("alpha", 10)
            assert denied.reason == "requests" and 0 < denied.retry_after_s <= 2.0
            assert (await a.acquire("beta", 10)).allowed  # per tenant
            return got
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(run()) == [True, True, True, False, False]


def test_redis_down_falls_back_to_per_replica_buckets():
    async def run() -> None:
        dead = f"redis://127.0.0.1:{free_port()}/0"
        r = RateLimiter(Limits(requests_per_s=1, burst_requests=2), redis_url=dead,
                        timeout_s=0.05)
        t = time.monotonic()
        got = [(await r.acquire("alpha", 1)).allowed for _ in range(3)]
        assert time.monotonic() - t < 1.0  # a few ms of timeout, not a stall
        assert got == [True, True, False]  # still limited, by this replica alone
        await r.close()

    asyncio.run(run())


def test_429_with_retry_after_holds_across_two_router_replicas(redis_url):
    seen: list = []
    backend = Served(stub_openai("stub", seen))
    routers = []
    try:
        for _ in range(2):
            limiter = RateLimiter(Limits(requests_per_s=0.2, burst_requests=4),
                                  redis_url=redis_url, prefix="t2")
            router = Router(RouterSettings(seed=0), lambda model: None)
            routers.append(Served(build_app(router, RouterServerSettings(
                worker_urls=[backend.url], rate_limiter=limiter,
                monitor=MonitorSettings(probe_interval_s=0.1)))))
        for r in routers:
            _wait_ready(r.url, 1)
        codes = []
        for i in range(6):
            resp = httpx.post(routers[i % 2].url + "/v1/completions", timeout=10,
                              json={"model": "stub-model", "prompt": f"p{i}", "max_tokens": 4})
            codes.append(resp.status_code)
        assert codes == [200, 200, 200, 200, 429, 429]
        assert int(resp.headers["Retry-After"]) >= 1
        assert resp.json()["error"]["type"] == "rate_limit_error"
        assert len(seen) == 4  # the rejected ones never reached a backend
    finally:
        for r in routers:
            r.stop()
        backend.stop()
