"""The operator running for real: kopf with `tandem.operator.main`'s handlers (as `tandem
operator --all-namespaces` runs them) against kmock's Kubernetes API emulator on a local
port, extended in `kube_emulator` (versions, generations, status, server-side apply, the
garbage collector's cascade). The test writes InferenceServices as `kubectl` would, plays the
Deployment controller where readiness matters (it writes Deployment status), and feeds the
autoscaler through a fake metrics source.

What each test proves is in its docstring; together: create → children with the rendered
content and owner references → Ready; replicas → only the Deployment's replicas change;
model → the pools' pod templates change (a rollout); P/D → aggregated removes the prefill
pool; delete → kopf lifts its finalizer and the (emulated) GC removes the children; a bad
spec → an InvalidSpec condition; API failures → ApplyFailed, retried; the autoscaler raises
and lowers replicas without flapping.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

import pytest
from kubernetes.client import ApiClient, AppsV1Api, Configuration, CoreV1Api, CustomObjectsApi

from tandem.operator.reconcile import OperatorConfig
from tandem.operator.render import Owner, render_all
from tandem.operator.render.common import CONFIG_HASH
from tandem.operator.spec import parse_spec
from tandem.serving.ports import free_port
from tests.operator.harness import (
    FakeMetrics,
    FakeRouter,
    condition,
    operator_at,
    wait_for,
)
from tests.operator.kube_emulator import SERVER_META, FakeCluster
from tests.operator.samples import SHA

NS = "ml"
TANDEM = Path(sys.executable).with_name("tandem")
IMAGE = "registry.example/tandem:test"
RW = {"list", "watch", "get", "create", "patch", "delete"}
RESOURCES: dict[str, dict[str, Any]] = {
    "tandem.dev/v1alpha1/inferenceservices": dict(
        kind="InferenceService", namespaced=True, verbs=RW, subresources={"status", "scale"}),
    "apps/v1/deployments": dict(kind="Deployment", namespaced=True, verbs=RW,
                                subresources={"status"}),
    "v1/services": dict(kind="Service", namespaced=True, verbs=RW),
    "v1/configmaps": dict(kind="ConfigMap", namespaced=True, verbs=RW),
    "v1/serviceaccounts": dict(kind="ServiceAccount", namespaced=True, verbs=RW),
    "v1/events": dict(kind="Event", namespaced=True, verbs=RW),
    "v1/namespaces": dict(kind="Namespace", namespaced=False, verbs={"list", "watch", "get"}),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", namespaced=True,
                                           verbs=RW),
    "rbac.authorization.k8s.io/v1/roles": dict(kind="Role", namespaced=True, verbs=RW),
    "rbac.authorization.k8s.io/v1/rolebindings": dict(kind="RoleBinding", namespaced=True,
                                                      verbs=RW),
    "discovery.k8s.io/v1/endpointslices": dict(kind="EndpointSlice", namespaced=True,
                                               verbs={"list", "watch"}),
    "autoscaling/v2/horizontalpodautoscalers": dict(kind="HorizontalPodAutoscaler",
                                                    namespaced=True, verbs=RW),
    "networking.k8s.io/v1/networkpolicies": dict(kind="NetworkPolicy", namespaced=True,
                                                 verbs=RW),
    "v1/secrets": dict(kind="Secret", namespaced=True, verbs=RW),
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": dict(
        kind="LeaderWorkerSet", namespaced=True, verbs=RW, subresources={"status", "scale"}),
    "keda.sh/v1alpha1/scaledobjects": dict(kind="ScaledObject", namespaced=True, verbs=RW),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch"}),
    # router.mode gateway
    "inference.networking.k8s.io/v1/inferencepools": dict(kind="InferencePool",
                                                          namespaced=True, verbs=RW),
    "gateway.networking.k8s.io/v1/httproutes": dict(kind="HTTPRoute", namespaced=True,
                                                    verbs=RW),
}
PLURALS = {"Deployment": "apps/v1/deployments", "Service": "v1/services",
           "ConfigMap": "v1/configmaps", "ServiceAccount": "v1/serviceaccounts",
           "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
           "Role": "rbac.authorization.k8s.io/v1/roles",
           "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings",
           "NetworkPolicy": "networking.k8s.io/v1/networkpolicies", "Secret": "v1/secrets",
           "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1/leaderworkersets",
           "InferencePool": "inference.networking.k8s.io/v1/inferencepools",
           "HTTPRoute": "gateway.networking.k8s.io/v1/httproutes",
           "ScaledObject": "keda.sh/v1alpha1/scaledobjects"}
ISVC = "tandem.dev/v1alpha1/inferenceservices"


class Env:
    def __init__(self, cluster: FakeCluster, metrics: FakeMetrics,
                 router: FakeRouter | None = None) -> None:
        self.cluster, self.metrics, self.router = cluster, metrics, router  # router: /scaling
        client = ApiClient(Configuration(host=cluster.url))
        self.api, self.apps = CustomObjectsApi(client), AppsV1Api(client)
        self.core = CoreV1Api(client)
        self.created: list[str] = []

    def clean(self) -> None:
        """Delete what the test created (fewer timers ticking for the next tests)."""
        for name in self.created:
            if self.isvc(name) is not None:
                self.delete(name)
        self.created.clear()

    # kubectl
    def create(self, name: str, spec: dict[str, Any]) -> None:
        self.created.append(name)
        self.api.create_namespaced_custom_object(
            "tandem.dev", "v1alpha1", NS, "inferenceservices",
            {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": name, "namespace": NS}, "spec": spec})

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object("tandem.dev", "v1alpha1", NS,
                                                "inferenceservices", name, {"spec": spec})

    def delete(self, name: str) -> None:
        self.api.delete_namespaced_custom_object("tandem.dev", "v1alpha1", NS,
                                                 "inferenceservices", name)

    # reading the emulator's store
    def history(self, kind: str, name: str) -> list[dict[str, Any] | None]:
        return self.cluster.history(PLURALS.get(kind, kind), NS, name)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        h = self.history(kind, name)
        return h[-1] if h else None

    def isvc(self, name: str) -> dict[str, Any] | None:
        return self.get(ISVC, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.isvc(name) or {}).get("status") or {}

    # the Deployment controller, as far as readiness goes
    def roll_out(self, *names: str) -> None:
        for name in names:
            dep = self.get("Deployment", name)
            n = dep["spec"]["replicas"]
            self.apps.patch_namespaced_deployment_status(name, NS, {"status": {
                "observedGeneration": dep["metadata"]["generation"], "replicas": n,
                "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n}})


@contextmanager
def operator_with_redis(tmp_path_factory: pytest.TempPathFactory, admin_password: str,
                        **config: Any) -> Iterator[tuple[FakeCluster, int]]:
    """(kmock's API emulator, the port of the chart's Redis: a real redis-server with
    `admin_password`) with the operator (`OperatorConfig(image=IMAGE, **config)` managing
    that Redis's ACL users) running against both; $KUBECONFIG points at the emulator
    meanwhile (read by the operator's login)."""
    from tandem.operator.redis_acl import ManagedRedis, RedisAcl
    from tests.conftest import start_redis

    cluster = FakeCluster(RESOURCES, tmp_path_factory.mktemp("kube"))
    redis_proc, _, redis_port = start_redis(tmp_path_factory.mktemp("redis"),
                                            password=admin_password)
    password_file = tmp_path_factory.mktemp("redis-admin") / "password"
    password_file.write_text(admin_password)
    operator_config = OperatorConfig(image=IMAGE, redis=RedisAcl(ManagedRedis(
        "127.0.0.1", redis_port, str(password_file))), **config)
    try:
        with operator_at(cluster.kubeconfig, operator_config):
            yield cluster, redis_port
    finally:
        cluster.stop()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


@pytest.fixture(scope="module")
def kube_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    metrics = FakeMetrics()  # the chart's Redis: the examples' router.managedRedis
    with operator_with_redis(tmp_path_factory, "adm", image_pull_policy="IfNotPresent",
                             status_interval_s=0.3, autoscale_interval_s=0.2, backoff_s=0.2,
                             resync_interval_s=1.0, metrics=metrics) as (cluster, _):
        yield Env(cluster, metrics)


@pytest.fixture()
def env(kube_env: Env) -> Iterator[Env]:
    yield kube_env
    kube_env.clean()


def server_side(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` without what the API server adds."""
    out = {k: v for k, v in copy.deepcopy(obj).items() if k != "status"}
    for key in SERVER_META:
        out["metadata"].pop(key, None)
    return out


def expected(env: Env, name: str, spec: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    uid = env.isvc(name)["metadata"]["uid"]
    return render_all(parse_spec(spec), Owner(name, NS, uid), image=IMAGE,
                      image_pull_policy="IfNotPresent", **kw)


def template_hash(dep: dict[str, Any]) -> str:
    return dep["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]


PD = {"model": {"uri": "pvc://models/llama/llama-3-8b.Q8_0.gguf", "sha256": SHA},
      "prefill": {"replicas": 1}, "decode": {"replicas": 2}}


def children(name: str, disaggregated: bool = True) -> dict[str, list[str]]:
    pools = ["prefill", "decode"] if disaggregated else ["worker"]
    return {"Deployment": [f"{name}-{p}" for p in pools] + [f"{name}-router"],
            "Service": [f"{name}-{p}" for p in pools] + [f"{name}-router"],
            "PodDisruptionBudget": [f"{name}-{p}" for p in pools] + [f"{name}-router"],
            "ConfigMap": [f"{name}-router-config"], "ServiceAccount": [f"{name}-router"],
            "Role": [f"{name}-router"], "RoleBinding": [f"{name}-router"],
            "NetworkPolicy": [f"{name}-workers", f"{name}-router"]}


def test_create_applies_the_rendered_children_and_becomes_ready(env: Env) -> None:
    """Every child appears with exactly the rendered content (the operator's image and pull
    policy, the owner reference with the InferenceService's uid); status reports the
    endpoint, digest, selectors and, once the Deployments are rolled out, Ready."""
    env.create("alpha", PD)
    want = {(d["kind"], d["metadata"]["name"]): d for d in
            wait_for(lambda: env.isvc("alpha")["metadata"]["uid"] and expected(env, "alpha", PD))}
    assert sorted(want) == sorted((k, n) for k, names in children("alpha").items()
                                  for n in names)
    for (kind, name), doc in want.items():
        got = wait_for(lambda kind=kind, name=name: env.get(kind, name), what=f"{kind} {name}")
        assert server_side(got) == doc, f"{kind}/{name} differs from the render"
        (ref,) = got["metadata"]["ownerReferences"]
        assert ref["uid"] == env.isvc("alpha")["metadata"]["uid"] and ref["controller"]
    st = wait_for(lambda: env.status("alpha").get("observedGeneration") == 1
                  and env.status("alpha"))
    assert st["endpoint"] == "http://alpha-router.ml.svc:8000"
    assert st["modelDigest"] == SHA
    assert st["decode"]["selector"] == ("tandem.dev/inference-service=alpha,"
                                        "app.kubernetes.io/component=worker,tandem.dev/role=decode")
    assert condition(env.isvc("alpha"), "Ready")["status"] == "False"
    assert "alpha-decode: 0/2 ready" in condition(env.isvc("alpha"), "Ready")["message"]
    env.roll_out("alpha-prefill", "alpha-decode", "alpha-router")
    wait_for(lambda: condition(env.isvc("alpha"), "Ready")["status"] == "True", what="Ready")
    st = env.status("alpha")
    assert (st["prefill"]["readyReplicas"], st["decode"]["readyReplicas"],
            st["routerReadyReplicas"]) == (1, 2, 1)
    assert condition(env.isvc("alpha"), "Progressing")["status"] == "False"
    assert condition(env.isvc("alpha"), "Degraded")["reason"] == "AsExpected"


def test_replicas_change_patches_only_the_deployments_replicas(env: Env) -> None:
    """decode.replicas 2 → 4: the decode Deployment's new version differs in spec.replicas
    only (same pod template: no rollout); no other child gets a new version."""
    env.create("beta", PD)
    wait_for(lambda: env.status("beta").get("observedGeneration") == 1)
    before = {(k, n): len(env.history(k, n)) for k, names in children("beta").items()
              for n in names}
    old = env.get("Deployment", "beta-decode")
    env.patch("beta", {"decode": {"replicas": 4}})
    new = wait_for(lambda: env.get("Deployment", "beta-decode")["spec"]["replicas"] == 4
                   and env.get("Deployment", "beta-decode"))
    assert server_side(new)["spec"] == {**server_side(old)["spec"], "replicas": 4}
    assert server_side(new)["metadata"] == server_side(old)["metadata"]
    assert template_hash(new) == template_hash(old)
    wait_for(lambda: env.status("beta").get("observedGeneration") == 2)
    after = {key: len(env.history(*key)) for key in before}
    assert {k for k in before if after[k] != before[k]} == {("Deployment", "beta-decode")}


def test_model_change_rolls_both_pools(env: Env) -> None:
    """A new model digest changes each pool's pod template (config hash, --model-sha256):
    Kubernetes rolls the pods; status follows the new generation."""
    env.create("gamma", PD)
    wait_for(lambda: env.status("gamma").get("observedGeneration") == 1)
    old = {p: env.get("Deployment", f"gamma-{p}") for p in ("prefill", "decode")}
    digest = "f" * 64
    env.patch("gamma", {"model": {"sha256": digest}})
    for pool, dep in old.items():
        new = wait_for(lambda pool=pool: digest in str(
            env.get("Deployment", f"gamma-{pool}")["spec"]["template"])
            and env.get("Deployment", f"gamma-{pool}"))
        assert template_hash(new) != template_hash(dep)
        assert new["metadata"]["generation"] == dep["metadata"]["generation"] + 1
    assert wait_for(lambda: env.status("gamma").get("modelDigest") == digest)
    assert condition(env.isvc("gamma"), "Progressing")["status"] == "True"


def test_switch_to_aggregated_removes_the_prefill_pool(env: Env) -> None:
    """prefill.replicas → 0: one aggregated `worker` pool replaces prefill + decode; the
    children no longer rendered are deleted (label + controller reference) and an Event
    says which."""
    env.create("delta", PD)
    wait_for(lambda: env.get("Deployment", "delta-prefill"))
    env.patch("delta", {"prefill": {"replicas": 0}})
    wait_for(lambda: env.get("Deployment", "delta-worker"), what="the aggregated pool")
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        for pool in ("prefill", "decode"):
            wait_for(lambda kind=kind, pool=pool: env.get(kind, f"delta-{pool}") is None,
                     what=f"{kind} delta-{pool} removed")
    for kind, names in children("delta", disaggregated=False).items():
        for name in names:
            assert env.get(kind, name) is not None, f"{kind}/{name}"
    st = wait_for(lambda: env.status("delta").get("observedGeneration") == 2
                  and env.status("delta"))
    assert st["prefill"] == {"replicas": 0, "readyReplicas": 0}
    assert st["decode"]["selector"].endswith("tandem.dev/role=both")
    wait_for(lambda: [e for e in env.cluster.objects("v1/events") if e.get("reason") ==
                      "Removed" and "Deployment/delta-prefill" in e["message"]],
             what="a Removed event")


TP = {"model": {"uri": "pvc://models/llama-70b", "sha256": SHA, "dtype": "bfloat16"},
      "decode": {"replicas": 2, "parallelism": {"tensor": 16},
                 "resources": {"limits": {"nvidia.com/gpu": 8}}}}
LWS = ("leaderworkerset.x-k8s.io", "v1", NS, "leaderworkersets")


def test_a_multi_node_pool_is_a_leader_worker_set_applied_and_pruned(env: Env) -> None:
    """TP=16 on 8-GPU pods: the pool is a LeaderWorkerSet with exactly the rendered content
    (no worker Deployment) and its group NetworkPolicy; status waits for its groups (here
    the LWS controller is played: it reports ready groups) and then is Ready; tensor 8 puts
    the worker on one node: a Deployment replaces the LWS, which is deleted with its policy."""
    env.create("tp", TP)
    want = {(d["kind"], d["metadata"]["name"]): d for d in
            wait_for(lambda: env.isvc("tp")["metadata"]["uid"] and expected(env, "tp", TP))}
    got = wait_for(lambda: env.get("LeaderWorkerSet", "tp-worker"), what="the LWS")
    assert server_side(got) == want[("LeaderWorkerSet", "tp-worker")]
    assert got["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert ("Deployment", "tp-worker") not in want and env.get("Deployment", "tp-worker") is None
    assert env.get("NetworkPolicy", "tp-worker-group") is not None
    wait_for(lambda: env.status("tp").get("observedGeneration") == 1)
    wait_for(lambda: "tp-worker: 0/2 ready" in condition(env.isvc("tp"), "Ready")["message"],
             what="waiting for the groups")
    env.roll_out("tp-router")
    env.api.patch_namespaced_custom_object_status(*LWS, "tp-worker", {"status": {
        "observedGeneration": got["metadata"]["generation"], "replicas": 2,
        "readyReplicas": 2, "updatedReplicas": 2}})
    wait_for(lambda: condition(env.isvc("tp"), "Ready")["status"] == "True", what="Ready")
    assert env.status("tp")["decode"]["readyReplicas"] == 2
    env.patch("tp", {"decode": {"parallelism": {"tensor": 8}}})
    dep = wait_for(lambda: env.get("Deployment", "tp-worker"), what="the Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size"):][:4] == [
        "--tensor-parallel-size", "8", "--distributed-executor-backend", "mp"]
    wait_for(lambda: env.get("LeaderWorkerSet", "tp-worker") is None, what="the LWS removed")
    wait_for(lambda: env.get("NetworkPolicy", "tp-worker-group") is None,
             what="its NetworkPolicy removed")


def test_worker_auth_secret_is_created_once_and_never_overwritten(env: Env) -> None:
    """The operator creates `<isvc>-worker-auth` (Opaque, `key`: 32 random bytes, owned by
    the InferenceService) before the pods that mount it; a key rotated by hand survives the
    resyncs and spec changes, and rolls no pod (the config hash ignores it); deleting the
    InferenceService takes the Secret with it. A spec naming its own Secret gets none."""
    import base64

    env.create("lambda", PD)
    secret = wait_for(lambda: env.get("Secret", "lambda-worker-auth"), what="the key Secret")
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"key"}
    assert len(base64.b64decode(secret["data"]["key"])) == 32
    (ref,) = secret["metadata"]["ownerReferences"]
    assert ref["uid"] == env.isvc("lambda")["metadata"]["uid"] and ref["controller"]
    wait_for(lambda: env.status("lambda").get("observedGeneration") == 1)
    deployments = {n: env.get("Deployment", n) for n in children("lambda")["Deployment"]}
    rotated = base64.b64encode(b"r" * 32).decode()
    env.core.patch_namespaced_secret("lambda-worker-auth", NS, {"data": {"key": rotated}})
    env.patch("lambda", {"decode": {"replicas": 3}})  # an apply, then resyncs (1 s)
    wait_for(lambda: env.status("lambda").get("observedGeneration") == 2)
    time.sleep(2.5)
    assert env.get("Secret", "lambda-worker-auth")["data"]["key"] == rotated
    assert len(env.history("Secret", "lambda-worker-auth")) == 2  # created, rotated: no more
    for name, dep in deployments.items():
        assert template_hash(env.get("Deployment", name)) == template_hash(dep), name
        assert env.get("Deployment", name)["spec"]["template"] == dep["spec"]["template"]
    env.delete("lambda")
    wait_for(lambda: env.isvc("lambda") is None, timeout=60, what="the InferenceService gone")
    wait_for(lambda: env.get("Secret", "lambda-worker-auth") is None, what="the GC")
    own = {**PD, "security": {"workerAuthSecretName": "mu-key"}}
    env.create("mu", own)
    wait_for(lambda: env.status("mu").get("observedGeneration") == 1)
    assert env.get("Secret", "mu-worker-auth") is None
    vols = env.get("Deployment", "mu-decode")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "worker-auth", "secret": {"secretName": "mu-key", "defaultMode": 0o440,
                                              "items": [{"key": "key", "path": "key"}]}} in vols


def test_delete_lifts_the_finalizer_and_the_children_follow(env: Env) -> None:
    """kopf's finalizer (its timers need one) is removed on deletion, so the InferenceService
    goes; its children go with it through their owner references (here kmock's emulated
    garbage collector; the operator has no delete handler)."""
    env.create("eps", PD)
    wait_for(lambda: env.get("Deployment", "eps-router"))
    assert env.isvc("eps")["metadata"]["finalizers"] == ["tandem.dev/operator"]
    env.delete("eps")
    wait_for(lambda: env.isvc("eps") is None, what="the InferenceService gone")
    for kind, names in children("eps").items():
        for name in names:
            assert env.get(kind, name) is None, f"{kind}/{name} survived"


def test_a_delete_during_a_timer_tick_is_not_held_up(env: Env, monkeypatch) -> None:
    """A delete that lands while a timer's tick runs (in its thread) still lifts the finalizer
    within seconds: kopf re-checks the stopping timer every `cancellation_polling` (its
    default, 60 s, kept the InferenceService a minute; a CI flake under load)."""
    import threading

    from tandem.operator import reconcile

    env.create("nu", PD)
    wait_for(lambda: env.status("nu").get("observedGeneration") == 1)
    inside, deleted, real = threading.Event(), threading.Event(), reconcile.workloads

    def held(kube, owner):  # the status timer's read, held open until the delete
        if owner.name == "nu":
            inside.set()
            deleted.wait(10)
        return real(kube, owner)

    monkeypatch.setattr(reconcile, "workloads", held)
    assert inside.wait(10), "no status tick"
    env.delete("nu")
    deleted.set()
    wait_for(lambda: env.isvc("nu") is None, timeout=10, what="the InferenceService gone")


def test_a_deployment_deleted_by_hand_comes_back(env: Env) -> None:
    """The status timer notices a missing Deployment and applies the children again."""
    env.create("iota", {"model": {"uri": "SmolLM2-135M-Instruct"}})
    first = wait_for(lambda: env.get("Deployment", "iota-worker"))
    env.apps.delete_namespaced_deployment("iota-worker", NS)
    back = wait_for(lambda: (d := env.get("Deployment", "iota-worker"))
                    and d["metadata"]["uid"] != first["metadata"]["uid"] and d,
                    what="the Deployment re-applied")
    assert server_side(back) == server_side(first)


def test_children_deleted_or_edited_by_hand_are_repaired(env: Env) -> None:
    """The resync timer applies the children again: a Service and the router's ConfigMap
    deleted by hand come back as rendered, a Deployment's image edited by hand is reverted,
    a Repaired Warning Event names exactly those, and untouched children are not written."""
    env.create("kappa", PD)
    wait_for(lambda: env.status("kappa").get("observedGeneration") == 1)
    first = {(kind, name): env.get(kind, name)
             for kind, names in children("kappa").items() for name in names}
    env.core.delete_namespaced_service("kappa-router", NS)
    env.core.delete_namespaced_config_map("kappa-router-config", NS)
    env.apps.patch_namespaced_deployment("kappa-decode", NS, [
        {"op": "replace", "path": "/spec/template/spec/containers/0/image",
         "value": "registry.example/other:latest"}])
    assert env.get("Deployment", "kappa-decode")["spec"]["template"]["spec"]["containers"][0][
        "image"] == "registry.example/other:latest"
    for kind, name in (("Service", "kappa-router"), ("ConfigMap", "kappa-router-config")):
        back = wait_for(lambda kind=kind, name=name: (o := env.get(kind, name))
                        and o["metadata"]["uid"] != first[kind, name]["metadata"]["uid"] and o,
                        what=f"{kind}/{name} re-applied")
        assert server_side(back) == server_side(first[kind, name])
    reverted = wait_for(lambda: (d := env.get("Deployment", "kappa-decode"))
                        and d["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
                        and d, what="the image reverted")
    assert server_side(reverted)["spec"] == server_side(first["Deployment", "kappa-decode"])[
        "spec"]
    events = wait_for(lambda: [e["message"] for e in env.cluster.objects("v1/events")
                               if e.get("reason") == "Repaired"
                               and e["involvedObject"]["name"] == "kappa"],
                      what="a Repaired event")
    named = " ".join(events)
    for child in ("Service/kappa-router", "ConfigMap/kappa-router-config",
                  "Deployment/kappa-decode"):
        assert child in named, (child, events)
    untouched = [key for key in first if key not in {
        ("Service", "kappa-router"), ("ConfigMap", "kappa-router-config"),
        ("Deployment", "kappa-decode")}]
    time.sleep(2.5)  # two more resyncs
    for kind, name in untouched:
        assert f"{kind}/{name}" not in named
        assert len(env.history(kind, name)) == 1, f"{kind}/{name} was written again"


def test_a_spec_the_schema_cannot_catch_is_reported_and_recovers(env: Env) -> None:
    """kvCacheMemory "1.5" matches the CRD's pattern, but is neither a fraction in (0, 1] nor
    whole bytes: PermanentError, conditions Ready=False / Degraded=True (InvalidSpec) with
    the reason, nothing deployed; fixing the spec deploys it."""
    bad = {"model": {"uri": "SmolLM2-135M-Instruct"},
           "decode": {"engine": {"kvCacheMemory": "1.5"}}}
    env.create("zeta", bad)
    ready = wait_for(lambda: condition(env.isvc("zeta"), "Ready"), what="a Ready condition")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "kvCacheMemory" in ready["message"]
    degraded = condition(env.isvc("zeta"), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert env.status("zeta")["observedGeneration"] == 1
    assert env.get("Deployment", "zeta-worker") is None
    env.patch("zeta", {"decode": {"engine": {"kvCacheMemory": "0.5"}}})
    wait_for(lambda: env.get("Deployment", "zeta-worker"), what="the fixed spec deployed")
    wait_for(lambda: condition(env.isvc("zeta"), "Degraded")["status"] == "False")


def test_api_failures_are_retried_with_a_condition(env: Env) -> None:
    """While Deployments cannot be written: TemporaryError, Degraded=True (ApplyFailed, the
    API's answer); once they can, the retry deploys everything."""
    env.cluster.set_faults(deployments=503)
    try:
        env.create("eta", PD)
        degraded = wait_for(lambda: condition(env.isvc("eta"), "Degraded"))
        assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
        assert "503" in degraded["message"]
    finally:
        env.cluster.set_faults()
    wait_for(lambda: env.get("Deployment", "eta-decode"), what="the retry")
    wait_for(lambda: condition(env.isvc("eta"), "Degraded")["status"] == "False")


def test_autoscaler_scales_up_at_once_and_down_after_the_window(env: Env) -> None:
    """waitingRequests, target 4 per replica, window 2 s: 12 waiting on one replica → 3 at
    once (Deployment, status.desiredReplicas, an Event); noise around the target changes
    nothing; a model change keeps the autoscaler's count; no load → back to 1, not before
    the window has passed. Replica history: 1, 3, 1 (no flapping)."""
    spec = {"model": {"uri": "SmolLM2-135M-Instruct"},
            "decode": {"replicas": 1, "autoscaling": {
                "minReplicas": 1, "maxReplicas": 5, "signal": "waitingRequests", "target": 4,
                "scaleDownStabilizationSeconds": 2}}}
    metric = "vllm:num_requests_waiting"
    env.create("theta", spec)
    wait_for(lambda: env.status("theta").get("observedGeneration") == 1)
    env.metrics.set("theta-worker", a={metric: 12.0})
    # generous timeouts: on a loaded 2-core CI box the operator's first scrape can lag
    wait_for(lambda: env.get("Deployment", "theta-worker")["spec"]["replicas"] == 3,
             timeout=30)
    st = wait_for(lambda: env.status("theta")["decode"].get("desiredReplicas") == 3
                  and env.status("theta"), timeout=30)
    assert st["decode"]["lastScaleTime"]
    env.patch("theta", {"model": {"sha256": SHA}})  # a rollout keeps the scaled count
    wait_for(lambda: env.status("theta").get("observedGeneration") == 2)
    assert env.get("Deployment", "theta-worker")["spec"]["replicas"] == 3
    for value in (4.3, 3.7, 4.2, 3.8, 4.1):  # within the 10 % band: no change
        env.metrics.set("theta-worker", a={metric: value}, b={metric: value},
                        c={metric: value})
        n = len(env.metrics.calls)
        wait_for(lambda n=n: len(env.metrics.calls) > n + 1)
    assert env.get("Deployment", "theta-worker")["spec"]["replicas"] == 3
    quiet = time.monotonic()
    env.metrics.set("theta-worker", a={metric: 0.0}, b={metric: 0.0}, c={metric: 0.0})
    wait_for(lambda: env.get("Deployment", "theta-worker")["spec"]["replicas"] == 1,
             timeout=10)
    assert time.monotonic() - quiet >= 1.5, "scaled down inside the stabilization window"
    counts = [v["spec"]["replicas"] for v in env.history("Deployment", "theta-worker") if v]
    assert [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]] == [1, 3, 1]
    scaled = wait_for(lambda: [e["message"] for e in env.cluster.objects("v1/events")
                               if e.get("reason") == "Scaled" and "theta" in e["message"]])
    assert scaled[0] == ("theta-worker: 1 -> 3 replicas (waitingRequests 12 per replica, "
                         "target 4)"), scaled


def test_a_keda_pool_is_left_to_its_scaled_object(env: Env) -> None:
    """P/D, both pools in autoscaling.mode keda from zero: a ScaledObject per pool with
    exactly the rendered content, workloads without replicas, and the operator's own
    autoscaler never reads (nor patches) them, whatever their load; switching decode to
    operator mode deletes its ScaledObject (a Removed event) and the operator sets its count
    again, while prefill stays KEDA's."""
    keda = {"mode": "keda", "minReplicas": 0, "maxReplicas": 4, "target": 4}
    spec = {"model": {"uri": "pvc://models/llama", "sha256": SHA},
            "prefill": {"replicas": 1, "autoscaling": dict(keda)},
            "decode": {"replicas": 1, "autoscaling": dict(keda)}}
    env.create("kedapd", spec)
    want = {(d["kind"], d["metadata"]["name"]): d for d in wait_for(
        lambda: env.isvc("kedapd")["metadata"]["uid"] and expected(env, "kedapd", spec))}
    for pool in ("prefill", "decode"):
        got = wait_for(lambda pool=pool: env.get("ScaledObject", f"kedapd-{pool}"),
                       what=f"ScaledObject kedapd-{pool}")
        assert server_side(got) == want[("ScaledObject", f"kedapd-{pool}")]
        assert "replicas" not in env.get("Deployment", f"kedapd-{pool}")["spec"]
    wait_for(lambda: env.status("kedapd").get("observedGeneration") == 1)
    load = {"vllm:num_requests_waiting": 50.0}
    env.metrics.set("kedapd-decode", a=load)
    env.metrics.set("kedapd-prefill", a=load)
    time.sleep(1.5)  # over seven autoscaler intervals (0.2 s here)
    assert not [s for _, s in env.metrics.calls if s.startswith("kedapd-")]
    for pool in ("prefill", "decode"):
        counts = [v["spec"].get("replicas") for v in env.history("Deployment", f"kedapd-{pool}")
                  if v]
        assert counts and set(counts) == {None}, (pool, counts)
    env.patch("kedapd", {"decode": {"autoscaling": {"mode": "operator", "minReplicas": 1}}})
    wait_for(lambda: env.get("ScaledObject", "kedapd-decode") is None,
             what="the decode ScaledObject removed")
    assert env.get("ScaledObject", "kedapd-prefill") is not None
    dep = wait_for(lambda: env.get("Deployment", "kedapd-decode")["spec"].get("replicas")
                   and env.get("Deployment", "kedapd-decode"))
    assert dep["spec"]["replicas"] >= 1
    wait_for(lambda: [e for e in env.cluster.objects("v1/events") if e.get("reason") ==
                      "Removed" and "ScaledObject/kedapd-decode" in e["message"]],
             what="a Removed event")
    # now the operator's: its autoscaler reads the decode pool (50 waiting → 4, the max)
    wait_for(lambda: env.get("Deployment", "kedapd-decode")["spec"]["replicas"] == 4,
             timeout=30, what="the operator scaling decode")
    assert not [s for _, s in env.metrics.calls if s == "kedapd-prefill"]


def test_the_tandem_operator_process(tmp_path) -> None:
    """`tandem operator` as the chart runs it (--standalone --all-namespaces --liveness, the
    children's image from TANDEM_IMAGE / TANDEM_IMAGE_PULL_POLICY) against its own emulator:
    it deploys, answers its liveness probe, and exits 0 on SIGTERM."""
    cluster = FakeCluster(RESOURCES, tmp_path)
    port = free_port()
    envvars = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
               "TANDEM_IMAGE": "registry.example/tandem:proc",
               "TANDEM_IMAGE_PULL_POLICY": "Always"}
    proc = subprocess.Popen(
        [str(TANDEM), "operator", "--standalone", "--all-namespaces",
         f"--liveness=http://127.0.0.1:{port}/healthz"], env=envvars,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        api = CustomObjectsApi(ApiClient(Configuration(host=cluster.url)))
        api.create_namespaced_custom_object(
            "tandem.dev", "v1alpha1", "team", "inferenceservices",
            {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "proc", "namespace": "team"},
             "spec": {"model": {"uri": "SmolLM2-135M-Instruct"}}})
        dep = wait_for(lambda: (cluster.history("apps/v1/deployments", "team", "proc-worker")
                                or [None])[-1], timeout=30, what="the worker Deployment")
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert (container["image"], container["imagePullPolicy"]) == (
            "registry.example/tandem:proc", "Always")
        health = wait_for(lambda: urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2),
                          what="liveness", errors=(URLError, OSError))
        assert health.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        cluster.stop()
    assert proc.returncode == 0, out[-3000:]




EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "charts" / "tandem" / "examples")
                  .glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_tandem_render_prints_what_the_operator_applies(env: Env, example: Path) -> None:
    """`tandem render -f` (a real process) with the operator's namespace, image and the
    InferenceService's uid prints exactly the objects the running operator wrote, in a
    cluster's view (the operator's random worker-auth key aside: a placeholder there)."""
    import yaml

    from tandem.operator.dryrun import PLACEHOLDER_VALUE

    source = yaml.safe_load(example.read_text())
    name = source["metadata"]["name"]
    env.create(name, source["spec"])
    uid = wait_for(lambda: env.isvc(name)["metadata"]["uid"])
    wait_for(lambda: env.status(name).get("observedGeneration") == 1, what="the apply")
    proc = subprocess.run([str(TANDEM), "render", "-f", str(example), "-n", NS, "--uid", uid,
                           "--image", IMAGE, "--image-pull-policy", "IfNotPresent",
                           "--release=", "--operator-namespace=",  # not the chart's
                           "--set", "redis.enabled=true"],  # as this operator has Redis
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = [d for d in yaml.safe_load_all(proc.stdout) if d]
    plural = {info["kind"]: key for key, info in RESOURCES.items()}
    live_names = {(info["kind"], o["metadata"]["name"]) for key, info in RESOURCES.items()
                  if info["kind"] not in ("InferenceService", "Event")
                  for o in env.cluster.objects(key) if o["metadata"].get("ownerReferences")
                  and o["metadata"]["ownerReferences"][0]["uid"] == uid}
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == live_names
    for doc in rendered:
        live = server_side(env.cluster.history(plural[doc["kind"]], NS,
                                               doc["metadata"]["name"])[-1])
        if doc["kind"] == "Secret":
            assert set(doc["data"].values()) == {PLACEHOLDER_VALUE}
            live["data"] = dict.fromkeys(live["data"], PLACEHOLDER_VALUE)
        assert live == doc, f"{doc['kind']}/{doc['metadata']['name']}"
