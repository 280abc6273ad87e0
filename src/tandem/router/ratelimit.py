"""Per-tenant rate limits: requests/s and tokens/min token buckets, shared through Redis.

Each tenant has two buckets: requests (capacity `burst_requests`, refilled at
`requests_per_s`) and tokens (capacity and refill per minute `tokens_per_min`). A request is
charged up front the most tokens it may use (`usage.worst_case`: prompt + every output token
it allows, times its choices); once its answer shows what it really used, `refund` credits
the rest back (never above the bucket's capacity). A request passes only if both buckets
hold enough, and then both are charged atomically. With Redis (`--redis redis://...`) the
buckets live in Redis and Lua scripts do check-and-charge and the credit on the Redis clock,
so every router replica enforces one shared limit. If Redis is unreachable or slower than
`timeout_s`, the replica falls back to its own in-memory buckets (limits then hold per
replica) instead of failing requests, and retries Redis after `retry_after_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    requests_per_s: float = 0.0  # 0 = unlimited
    burst_requests: float = 0.0  # bucket size; 0 = max(1, requests_per_s)
    tokens_per_min: float = 0.0  # 0 = unlimited

    @property
    def request_capacity(self) -> float:
        return self.burst_requests or max(1.0, self.requests_per_s)

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> Limits:
        unknown = set(d) - {"requests_per_s", "burst_requests", "tokens_per_min"}
        if unknown:
            raise ValueError(f"unknown rate-limit keys {sorted(unknown)}")
        lim = cls(**{k: float(v) for k, v in d.items()})
        if min(lim.requests_per_s, lim.burst_requests, lim.tokens_per_min) < 0:
            raise ValueError("rate limits must be >= 0")
        return lim


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_s: float = 0.0
    reason: str = ""  # "requests" | "tokens" | "too_large"
    charged: int = 0  # tokens taken from the tokens bucket (0: refused, or no token limit)
    shared: bool = False  # charged in Redis (its refund goes there too)


def _bucket(level: float, ts: float, now: float, rate: float, cap: float) -> float:
    return min(cap, level + max(0.0, now - ts) * rate)


class LocalBuckets:
    """The same two-bucket rule in process memory (single replica, or the fallback)."""

    def __init__(self) -> None:
        self._state: dict[tuple[str, str], tuple[float, float]] = {}

    def acquire(self, tenant: str, limits: Limits, tokens: int, now: float) -> Verdict:
        checks = []
        if limits.requests_per_s > 0:
            checks.append(("requests", limits.requests_per_s, limits.request_capacity, 1.0))
        if limits.tokens_per_min > 0:
            if tokens > limits.tokens_per_min:
                return Verdict(False, 0.0, "too_large")
            checks.append(("tokens", limits.tokens_per_min / 60, limits.tokens_per_min,
                           float(tokens)))
        levels = {}
        wait, reason = 0.0, ""
        for name, rate, cap, cost in checks:
            level, ts = self._state.get((tenant, name), (cap, now))
            levels[name] = level = _bucket(level, ts, now, rate, cap)
            if level < cost and (cost - level) / rate > wait:
                wait, reason = (cost - level) / rate, name
        ok = wait == 0.0
        for name, _, _, cost in checks:
            self._state[(tenant, name)] = (levels[name] - (cost if ok else 0.0), now)
        charged = tokens if ok and limits.tokens_per_min > 0 else 0
        return Verdict(ok, wait, reason, charged=charged)

    def credit(self, tenant: str, limits: Limits, tokens: int, now: float) -> float:
        """Give `tokens` back to the tokens bucket (capped at its capacity); its new level."""
        if limits.tokens_per_min <= 0:
            return 0.0
        rate, cap = limits.tokens_per_min / 60, limits.tokens_per_min
        level, ts = self._state.get((tenant, "tokens"), (cap, now))
        level = min(cap, _bucket(level, ts, now, rate, cap) + max(tokens, 0))
        self._state[(tenant, "tokens")] = (level, now)
        return level

    def level(self, tenant: str, limits: Limits, now: float) -> float:
        """The tokens bucket's level at `now` (tests, metrics)."""
        cap = limits.tokens_per_min
        level, ts = self._state.get((tenant, "tokens"), (cap, now))
        return _bucket(level, ts, now, cap / 60, cap)


# KEYS: requests bucket, tokens bucket. ARGV: req rate, req cap, tok rate, tok cap, tokens.
# A rate of 0 skips that bucket. Returns {allowed, wait_ms, reason}.
_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rates = {tonumber(ARGV[1]), tonumber(ARGV[3])}
local caps = {tonumber(ARGV[2]), tonumber(ARGV[4])}
local costs = {1, tonumber(ARGV[5])}
local names = {'requests', 'tokens'}
if rates[2] > 0 and costs[2] > caps[2] then return {0, 0, 'too_large'} end
local levels = {}
local wait, reason = 0, ''
for i = 1, 2 do
  if rates[i] > 0 then
    local v = redis.call('HMGET', KEYS[i], 'level', 'ts')
    local level = tonumber(v[1]) or caps[i]
    local ts = tonumber(v[2]) or now
    level = math.min(caps[i], level + math.max(0, now - ts) * rates[i])
    levels[i] = level
    if level < costs[i] and (costs[i] - level) / rates[i] > wait then
      wait = (costs[i] - level) / rates[i]
      reason = names[i]
    end
  end
end
for i = 1, 2 do
  if rates[i] > 0 then
    local charged = levels[i]
    if wait == 0 then charged = charged - costs[i] end
    redis.call('HSET', KEYS[i], 'level', tostring(charged), 'ts', tostring(now))
    redis.call('EXPIRE', KEYS[i], math.ceil(caps[i] / rates[i]) + 60)
  end
end
if wait == 0 then return {1, 0, ''} end
return {0, math.ceil(wait * 1000), reason}
"""

# KEYS: tokens bucket. ARGV: tok rate, tok cap, tokens to credit. Returns the new level.
_CREDIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(v[1]) or cap
local ts = tonumber(v[2]) or now
level = math.min(cap, level + math.max(0, now - ts) * rate + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(cap / rate) + 60)
return tostring(level)
"""


class RateLimiter:
    """`acquire(tenant, tokens)` for the tenant's limits (`per_tenant` or `default`)."""

    def __init__(self, default: Limits, per_tenant: Mapping[str, Limits] | None = None,
                 redis_url: str | None = None, timeout_s: float = 0.05,
                 retry_after_s: float = 5.0, prefix: str = "tandem:rl") -> None:
        self.default = default
        self.per_tenant = dict(per_tenant or {})
        self.local = LocalBuckets()
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.prefix = prefix
        self._redis = None
        self._script = None
        self._credit = None
        self._redis_down_until = 0.0
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(redis_url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
            self._script = self._redis.register_script(_LUA)
            self._credit = self._redis.register_script(_CREDIT_LUA)

    def limits(self, tenant: str) -> Limits:
        return self.per_tenant.get(tenant, self.default)

    @property
    def shared(self) -> bool:
        """The buckets live in Redis (one limit for every router process and replica)."""
        return self._redis is not None

    @property
    def enabled(self) -> bool:
        lims = [self.default, *self.per_tenant.values()]
        return any(lim.requests_per_s > 0 or lim.tokens_per_min > 0 for lim in lims)

    async def acquire(self, tenant: str, tokens: int) -> Verdict:
        lim = self.limits(tenant)
        if lim.requests_per_s <= 0 and lim.tokens_per_min <= 0:
            return Verdict(True)
        now = time.monotonic()
        if self._script is not None and now >= self._redis_down_until:
            keys = [f"{self.prefix}:{tenant}:requests", f"{self.prefix}:{tenant}:tokens"]
            args = [lim.requests_per_s, lim.request_capacity, lim.tokens_per_min / 60,
                    lim.tokens_per_min, tokens]
            try:
                ok, wait_ms, reason = await asyncio.wait_for(
                    self._script(keys=keys, args=args), self.timeout_s)
                reason = reason.decode() if isinstance(reason, bytes) else str(reason)
                allowed = bool(int(ok))
                return Verdict(allowed, int(wait_ms) / 1000, reason, shared=True,
                               charged=tokens if allowed and lim.tokens_per_min > 0 else 0)
            except Exception as exc:  # noqa: BLE001 - any Redis trouble: limit locally
                self._redis_down_until = now + self.retry_after_s
                logger.warning("rate limits: Redis unavailable (%s); using per-replica "
                               "buckets for %.0fs", type(exc).__name__, self.retry_after_s)
        return self.local.acquire(tenant, lim, tokens, now)

    async def refund(self, tenant: str, verdict: Verdict, tokens: int) -> None:
        """Credit back `tokens` (at most what `verdict` charged) of a request that used less
        than it was charged. A refund Redis cannot take is dropped (the limit errs strict)."""
        tokens = min(int(tokens), verdict.charged)
        if tokens <= 0:
            return
        lim = self.limits(tenant)
        if not verdict.shared or self._redis is None:
            self.local.credit(tenant, lim, tokens, time.monotonic())
            return
        try:
            await asyncio.wait_for(self._credit(
                keys=[f"{self.prefix}:{tenant}:tokens"],
                args=[lim.tokens_per_min / 60, lim.tokens_per_min, tokens]), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - strict rather than failing the request
            logger.info("rate limits: refund of %d tokens for %r dropped (%s)", tokens,
                        tenant, type(exc).__name__)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


def retry_after_header(v: Verdict) -> str:
    return str(max(1, math.ceil(v.retry_after_s)))
