"""InferenceServices sharing one Redis, each through the ACL user the operator creates
(`tandem.operator.redis_acl`) on a real password-protected redis-server: the router's rate
limiter and shared index run their real Lua scripts under the restricted user, every key they
write lies under the InferenceService's prefix, and one user cannot read, write or script
another's keys (NOPERM), nor run what the routers never do."""

from __future__ import annotations

import asyncio
import base64
import random

import pytest
import redis

from tandem.operator.redis_acl import (
    ROUTER_COMMANDS,
    ManagedRedis,
    RedisAcl,
    acl_user,
    key_prefix,
    url_secret,
    user_password,
    user_url,
)
from tandem.operator.render.common import Owner
from tandem.protocol.block_hash import hash_block_chain
from tandem.router.index_store import KVWrite, RedisIndexStore
from tandem.router.ratelimit import Limits, RateLimiter
from tandem.router.redis_url import key_prefix as checked_prefix
from tests.conftest import start_redis

ADMIN = "admin-secret-0123456789"
A, B = Owner("alpha", "team-a", "uid-a"), Owner("alpha", "team-b", "uid-b")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    proc, _, port = start_redis(tmp_path_factory.mktemp("redis-acl"), password=ADMIN)
    pw = tmp_path_factory.mktemp("admin") / "password"
    pw.write_text(ADMIN + "\n")
    managed = ManagedRedis("127.0.0.1", port, str(pw))
    acl = RedisAcl(managed)
    for owner in (A, B):
        acl.ensure_user(owner)
    yield managed, acl
    proc.terminate()
    proc.wait(timeout=10)


def _url(managed: ManagedRedis, owner: Owner) -> str:
    return user_url(managed, owner, user_password(ADMIN, owner))


def test_the_prefix_is_a_valid_router_flag_and_users_differ_per_namespace() -> None:
    assert key_prefix(A) == "tandem:team-a:alpha:" == checked_prefix(key_prefix(A))
    assert acl_user(A) != acl_user(B) and user_password(ADMIN, A) != user_password(ADMIN, B)
    for bad in ("", "tandem:*", "a b", "x" * 201, "tandem:[ab]"):
        with pytest.raises(ValueError, match="redis key prefix"):
            checked_prefix(bad)


def test_router_state_works_under_the_restricted_user_and_stays_in_its_prefix(shared) -> None:
    managed, _ = shared
    url_a = _url(managed, A)
    chain = hash_block_chain(list(range(64)), 16)

    async def run() -> None:
        lim = RateLimiter(Limits(requests_per_s=1, burst_requests=2, tokens_per_min=600),
                          redis_url=url_a, prefix=f"{key_prefix(A)}rl")
        store = RedisIndexStore(url_a, prefix=f"{key_prefix(A)}kv:", lookup_timeout_s=1.0)
        try:
            verdicts = [await lim.acquire("tenant", 100) for _ in range(3)]
            assert [v.allowed for v in verdicts] == [True, True, False]
            assert all(v.shared for v in verdicts)  # in Redis, not the local fallback
            await lim.refund("tenant", verdicts[0], 50)
            assert await store._write(KVWrite("w1", "i", 0, snapshot=chain)) == 1
            assert await store.match(chain, ["w1"]) == {"w1": 4}
            assert store.stats["lookup_fallbacks"] == 0
        finally:
            await lim.close()
            await store.close()

    asyncio.run(run())
    admin = redis.Redis(port=managed.port, password=ADMIN, decode_responses=True)
    keys = admin.keys("*")
    assert keys and all(k.startswith(key_prefix(A)) for k in keys), keys
    assert float(admin.hget(f"{key_prefix(A)}rl:tenant:tokens", "level")) > 350  # refunded


def test_one_inference_service_cannot_touch_anothers_keys(shared) -> None:
    managed, _ = shared
    admin = redis.Redis(port=managed.port, password=ADMIN, decode_responses=True)
    theirs = f"{key_prefix(B)}rl:tenant:tokens"
    admin.hset(theirs, mapping={"level": "7", "ts": "0"})
    a = redis.Redis.from_url(_url(managed, A), decode_responses=True)
    rng = random.Random(13)
    attempts = [lambda: a.hget(theirs, "level"), lambda: a.hset(theirs, "level", "1e9"),
                lambda: a.delete(theirs), lambda: a.keys("*"), lambda: a.flushall(),
                lambda: a.config_get("requirepass"), lambda: a.execute_command("ACL", "LIST"),
                lambda: a.get(f"{key_prefix(B)}x"), lambda: a.publish(f"{key_prefix(A)}c", "x"),
                lambda: a.eval("return redis.call('HGET', KEYS[1], 'level')", 1, theirs),
                lambda: a.hget("tandem:rl:tenant:tokens", "level")]  # the unprefixed layout
    sha = a.script_load("return redis.call('HSET', ARGV[1], 'level', '0')")
    attempts.append(lambda: a.evalsha(sha, 0, theirs))  # key names built inside the script
    for attempt in rng.sample(attempts, len(attempts)):
        with pytest.raises(redis.ResponseError, match="(?i)noperm|no permissions|can't access"):
            attempt()  # NOPERM (a script's call: "can't access ... keys")
    assert admin.hget(theirs, "level") == "7"
    assert a.hset(f"{key_prefix(A)}mine", "level", "1") == 1  # its own prefix: allowed
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(_url(managed, A).replace(acl_user(A), acl_user(B))).ping()


def test_users_are_reset_and_deleted(shared) -> None:
    managed, acl = shared
    admin = redis.Redis(port=managed.port, password=ADMIN, decode_responses=True)
    owner = Owner("gamma", "team-c", "uid-c")
    acl.ensure_user(owner)
    acl.ensure_user(owner)  # idempotent: a reconcile after a Redis restart sets it again
    (rules,) = [u for u in admin.acl_list() if u.startswith(f"user {acl_user(owner)} ")]
    assert f"~{key_prefix(owner)}*" in rules and "resetchannels" in rules
    assert all(f"+{c}" in rules for c in ROUTER_COMMANDS) and "-@all" in rules
    secret = url_secret(managed, owner)
    assert secret["metadata"]["name"] == "gamma-redis"
    url = base64.b64decode(secret["data"]["url"]).decode()
    assert redis.Redis.from_url(url).ping()
    assert acl.delete_user(owner) and not acl.delete_user(owner)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url).ping()


def test_the_router_puts_every_key_under_its_prefix(shared) -> None:
    """`--redis-key-prefix` (or router.yaml `redis_key_prefix`) reaches the rate limiter and
    the shared index; a bad one is a start-up error naming the flag."""
    import argparse

    from tandem.router.main import add_router_args, build

    managed, _ = shared
    p = argparse.ArgumentParser()
    add_router_args(p)
    url = _url(managed, A)
    cfg = {"rate_limits": {"default": {"requests_per_s": 5}}, "redis": url, "index": url}
    argv = ["--workers", "http://127.0.0.1:1"]
    for args, conf in ((argv + ["--redis-key-prefix", key_prefix(A)], cfg),
                       (argv, {**cfg, "redis_key_prefix": key_prefix(A)})):
        _, _, server = build(p.parse_args(args), dict(conf))
        assert server.rate_limiter.prefix == f"{key_prefix(A)}rl"
        assert server.index_store.prefix == f"{key_prefix(A)}kv:"
    _, _, server = build(p.parse_args(argv), dict(cfg))
    assert (server.rate_limiter.prefix, server.index_store.prefix) == ("tandem:rl",
                                                                      "tandem:kv:")
    for bad in ("tandem:*", ""):  # an empty one is refused, not read as "unset"
        with pytest.raises(SystemExit, match="--redis-key-prefix"):
            build(p.parse_args(argv + ["--redis-key-prefix", bad]), dict(cfg))
