"""`router.managedRedis`: the operator (kopf with `tandem.operator.main`'s handlers against
kmock's API emulator, as in test_operator_kmock) with the chart's Redis (a real
password-protected redis-server) creates an InferenceService's ACL user and URL Secret, sets
the user again after Redis forgot it (a restart keeps no ACLs), renders the routers' prefix
and Secret, deletes the user with the InferenceService; an operator without Redis refuses
the spec (InvalidSpec)."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from tandem.operator.reconcile import OperatorConfig
from tandem.operator.redis_acl import acl_user
from tandem.operator.render.common import Owner
from tests.operator.harness import FakeMetrics, wait_for
from tests.operator.test_operator_kmock import NS, PD, Env, operator_with_redis

ADMIN = "chart-admin-password"
SPEC = {**PD, "router": {"managedRedis": True, "sharedIndex": True,
                         "rateLimits": {"default": {"requestsPerSecond": 5}}}}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Env, redis.Redis, int]]:
    metrics = FakeMetrics()
    with operator_with_redis(tmp_path_factory, ADMIN, status_interval_s=0.3,
                             autoscale_interval_s=5, backoff_s=0.2, resync_interval_s=1.0,
                             metrics=metrics) as (cluster, port):
        yield Env(cluster, metrics), redis.Redis(port=port, password=ADMIN,
                                                 decode_responses=True), port


def _users(admin: redis.Redis) -> set[str]:
    return set(admin.acl_users())


def test_create_makes_the_user_and_secret_and_delete_removes_the_user(world) -> None:
    env, admin, port = world
    env.create("zeta", SPEC)
    wait_for(lambda: env.status("zeta").get("observedGeneration") == 1, what="applied")
    owner = Owner("zeta", NS, env.isvc("zeta")["metadata"]["uid"])
    user = acl_user(owner)
    assert user in _users(admin)
    secret = env.get("Secret", "zeta-redis")
    url = base64.b64decode(secret["data"]["url"]).decode()
    assert urlsplit(url).username == user and secret["metadata"]["ownerReferences"][0][
        "uid"] == owner.uid
    local = redis.Redis.from_url(url.replace(urlsplit(url).hostname, "127.0.0.1"))
    assert local.ping()
    with pytest.raises(redis.ResponseError, match="(?i)noperm|no permissions"):
        local.get("tandem:rl:anyone:tokens")  # keys outside tandem:ml:zeta:
    dep = env.get("Deployment", "zeta-router")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env_refs = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c["env"]}
    assert env_refs["TANDEM_REDIS_URL"] == {"name": "zeta-redis", "key": "url"}
    cfg = yaml.safe_load(env.get("ConfigMap", "zeta-router-config")["data"]["router.yaml"])
    assert cfg["redis_key_prefix"] == "tandem:ml:zeta:"
    assert cfg["redis"] == cfg["index"] == "env:TANDEM_REDIS_URL"
    admin.acl_deluser(user)  # as a Redis restart would: the next resync sets it again
    wait_for(lambda: user in _users(admin), timeout=10, what="the user set again")
    env.delete("zeta")
    wait_for(lambda: env.isvc("zeta") is None, timeout=30, what="the InferenceService gone")
    assert user not in _users(admin)


def test_an_operator_without_redis_refuses_managed_redis() -> None:
    from tandem.operator.reconcile import check_environment
    from tandem.operator.spec import SpecError, parse_spec

    with pytest.raises(SpecError, match="router.managedRedis: this operator has no Redis"):
        check_environment(parse_spec(SPEC), Owner("a", NS, "u"), OperatorConfig())
    check_environment(parse_spec(PD), Owner("a", NS, "u"), OperatorConfig())


def test_managed_redis_is_exclusive_with_a_url_secret() -> None:
    from tandem.operator.spec import SpecError, parse_spec

    bad = {**PD, "router": {"managedRedis": True, "redisUrlSecretRef": {"name": "mine"}}}
    with pytest.raises(SpecError, match="managedRedis and router.redisUrlSecretRef"):
        parse_spec(bad)


def test_a_host_path_is_an_invalid_spec_naming_the_field(world) -> None:
    """The admission checks run in the operator's handler: InvalidSpec, nothing deployed."""
    from tests.operator.harness import condition

    env, _, _ = world
    bad = {**PD, "decode": {"replicas": 1, "volumes": [{"name": "root",
                                                         "hostPath": {"path": "/"}}]}}
    env.create("eta", bad)
    ready = wait_for(lambda: condition(env.isvc("eta"), "Ready"), what="a Ready condition")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "decode.volumes[0].hostPath: volume type not allowed" in ready["message"]
    time.sleep(1.5)  # the status (0.3 s) and resync (1 s) timers apply nothing either
    assert env.get("Deployment", "eta-decode") is None
    assert env.get("Deployment", "eta-router") is None
    env.delete("eta")
