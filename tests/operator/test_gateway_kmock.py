"""`router.mode: gateway` and `router.attachTo` through the running operator (kopf against
kmock's API emulator, `test_operator_kmock`'s fixtures): gateway mode creates the
InferencePool, the endpoint picker's Deployment and Service and the HTTPRoute with exactly
the rendered content; switching back to `router` deletes them and brings the router back;
an attached InferenceService runs no router, its status names the one that serves it, and
that router fetches its tokenizer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import yaml

from tests.operator import test_operator_kmock as km
from tests.operator.harness import condition, wait_for
from tests.operator.samples import SHA
from tests.operator.test_operator_kmock import Env, expected, server_side

kube_env = km.kube_env  # the operator against the emulator, for this module


@pytest.fixture()
def env(kube_env: Env) -> Iterator[Env]:
    yield kube_env
    kube_env.clean()


AGG = {"model": {"uri": "pvc://models/m.gguf", "sha256": SHA}, "decode": {"replicas": 1}}
GATEWAY = {"mode": "gateway", "gateway": {"parentRefs": [{"name": "inference-gateway"}]}}
EPP = [("Deployment", "gw-epp"), ("Service", "gw-epp"), ("ConfigMap", "gw-epp-config"),
       ("InferencePool", "gw"), ("HTTPRoute", "gw"), ("NetworkPolicy", "gw-inference-pool")]


def test_gateway_mode_applies_the_pool_and_switching_back_deletes_it(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """... and the status timer, which re-applies when a workload is missing, finds the
    picker's Deployment where it is (no re-apply on every tick)."""
    spec = {**AGG, "router": GATEWAY}
    env.create("gw", spec)
    want = {(d["kind"], d["metadata"]["name"]): d for d in
            wait_for(lambda: env.isvc("gw")["metadata"]["uid"] and expected(env, "gw", spec))}
    for kind, name in EPP:
        got = wait_for(lambda kind=kind, name=name: env.get(kind, name), what=f"{kind} {name}")
        assert server_side(got) == want[kind, name], f"{kind}/{name} differs from the render"
    assert env.get("Deployment", "gw-router") is None
    st = wait_for(lambda: env.status("gw").get("observedGeneration") == 1 and env.status("gw"))
    assert st["router"] == "gw" and "endpoint" not in st
    env.roll_out("gw-worker", "gw-epp")
    wait_for(lambda: condition(env.isvc("gw"), "Ready")["status"] == "True", what="Ready")
    caplog.clear()
    time.sleep(1.0)  # three status ticks
    assert not [r for r in caplog.records if "re-applying" in r.getMessage()]
    env.patch("gw", {"router": {"mode": "router", "gateway": None}})
    wait_for(lambda: env.get("Deployment", "gw-router"), what="the router back")
    for kind, name in EPP:
        wait_for(lambda kind=kind, name=name: env.get(kind, name) is None,
                 what=f"{kind} {name} removed")
    st = wait_for(lambda: env.status("gw").get("observedGeneration") == 2 and env.status("gw"))
    assert st["endpoint"] == "http://gw-router.ml.svc:8000"


def test_an_attached_service_runs_no_router_and_names_its_own(env: Env) -> None:
    env.create("host", AGG)
    env.create("guest", {"model": {**AGG["model"], "name": "guest-model"},
                         "router": {"attachTo": "host"}})
    svc = wait_for(lambda: env.get("Service", "guest-worker"), what="guest's workers")
    assert svc["metadata"]["labels"]["tandem.dev/router-group"] == "host"
    st = wait_for(lambda: env.status("guest").get("observedGeneration") == 1
                  and env.status("guest"))
    assert st["router"] == "host" and "endpoint" not in st
    assert env.get("Deployment", "guest-router") is None
    assert env.get("Deployment", "guest-epp") is None
    host = wait_for(lambda: env.get("Service", "host-worker"))
    assert host["metadata"]["labels"]["tandem.dev/router-group"] == "host"
    # the host's router fetches the guest's tokenizer from its next re-apply (resync) on
    config = wait_for(lambda: "/tokenizer-1" in str(env.get("ConfigMap", "host-router-config"))
                      and env.get("ConfigMap", "host-router-config"), what="guest's tokenizer")
    assert yaml.safe_load(config["data"]["router.yaml"])["tokenizers"] == {
        "m": "/tokenizer", "guest-model": "/tokenizer-1"}
    env.roll_out("guest-worker")
    wait_for(lambda: condition(env.isvc("guest"), "Ready")["status"] == "True", what="Ready")


def test_an_attached_service_without_a_router_says_so_until_one_exists(env: Env) -> None:
    """attachTo a name no InferenceService has: Ready False, reason RouterNotFound, the
    workers deployed; attached to one that is itself attached: the same, naming the end of
    the chain; once its router's InferenceService exists, Ready (the status timer)."""
    env.create("orphan", {**AGG, "router": {"attachTo": "later"}})
    wait_for(lambda: env.get("Deployment", "orphan-worker"), what="its workers")
    env.roll_out("orphan-worker")
    message = "router.attachTo later: no InferenceService later in ml; nothing routes to this one"
    ready = wait_for(lambda: (c := condition(env.isvc("orphan"), "Ready"))
                     and c["message"] == message and c, what="RouterNotFound alone")
    assert (ready["status"], ready["reason"]) == ("False", "RouterNotFound")
    env.create("chained", {**AGG, "router": {"attachTo": "orphan"}})
    chained = wait_for(lambda: (c := condition(env.isvc("chained"), "Ready"))
                       and c["reason"] == "RouterNotFound" and c, what="the chain")
    assert "orphan is itself attached to later (attach to later)" in chained["message"]
    env.create("later", AGG)
    wait_for(lambda: condition(env.isvc("orphan"), "Ready")["status"] == "True",
             what="Ready once its router's InferenceService exists")
