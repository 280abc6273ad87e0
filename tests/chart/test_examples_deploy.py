"""The chart's defaults and its examples work together as the examples say to apply them:
`helm install tandem charts/tandem -n tandem-system --set redis.enabled=true`, then `kubectl
apply -f examples/NAME.yaml` into `default`.

Each example's objects are what the operator, configured by the chart's rendered environment,
writes (`reconcile.apply`, its own path, against a recorder instead of a cluster). Every
Secret a router or worker pod references (env secretKeyRef, envFrom, secret and projected
volumes, image pull secrets) exists in the pod's namespace before it starts: created by the
operator there (the worker-auth key, the Redis user's URL), written by a cert-manager
Certificate the operator renders, or one the example's own comments tell the user to create
(`kubectl create secret ...`). A missing one would leave the pod in CreateContainerConfigError.
The routers reach the chart's Redis across namespaces (both NetworkPolicies allow it), at the
address the URL Secret names; every example's router has resources."""

from __future__ import annotations

import argparse
import base64
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tandem.operator.cli import add_operator_args, config_from
from tandem.operator.reconcile import apply
from tandem.operator.redis_acl import RedisAcl
from tandem.operator.render import Owner
from tandem.operator.render.multinode import pod_templates
from tandem.operator.spec import parse_spec
from tests.chart.conftest import CHART, NAMESPACE, RELEASE, Helm, by_kind, one
from tests.chart.test_network_policies import chart_env
from tests.operator.netpol import Pod, connects, pods_of

EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
USER_NS = "default"
WORKLOADS = ("Deployment", "LeaderWorkerSet")


class Recorder:
    """A cluster with none of the InferenceService's children yet: every write recorded."""

    def __init__(self) -> None:
        self.docs: list[dict[str, Any]] = []

    def list_owned(self, kind: str, namespace: str, owner: str, uid: str) -> list[dict]:
        return []

    def apply(self, doc: dict[str, Any], manager: str = "") -> dict[str, Any]:
        self.docs.append(doc)
        return doc

    def create(self, doc: dict[str, Any]) -> bool:
        self.docs.append(doc)
        return True


class NoAcl(RedisAcl):
    def ensure_user(self, owner: Owner) -> None:  # no Redis to talk to here
        pass


@pytest.fixture(scope="module")
def chart(helm: Helm) -> list[dict[str, Any]]:
    return helm.render(sets=("redis.enabled=true",))


def operator_writes(chart: list[dict], example: Path, tmp_path: Path) -> list[dict[str, Any]]:
    env = chart_env(chart)
    password = tmp_path / "redis-admin-password"
    password.write_text("admin-password")
    env["TANDEM_REDIS_ADMIN_PASSWORD_FILE"] = str(password)  # the mounted Secret
    p = argparse.ArgumentParser()
    add_operator_args(p)
    config = config_from(p.parse_args(["--all-namespaces"]), env)
    assert config.redis is not None  # redis.enabled: the operator manages Redis users
    config.redis = NoAcl(config.redis.redis)
    out = []
    for doc in yaml.safe_load_all(example.read_text()):
        if not doc:
            continue
        recorder = Recorder()
        owner = Owner(doc["metadata"]["name"], USER_NS, "uid-1")
        apply(recorder, parse_spec(doc["spec"]), owner, config)  # type: ignore[arg-type]
        out += recorder.docs
    return out


def referenced_secrets(pod: dict[str, Any]) -> set[str]:
    names = {s["name"] for s in pod.get("imagePullSecrets", [])}
    for c in pod["containers"] + pod.get("initContainers", []):
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        names |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
    for v in pod.get("volumes", []):
        if "secret" in v:
            names.add(v["secret"]["secretName"])
        for src in (v.get("projected") or {}).get("sources", []):
            if "secret" in src:
                names.add(src["secret"]["name"])
    return names


def user_created(example: Path) -> set[str]:
    """Secrets the example's comments tell the user to create first."""
    return set(re.findall(r"kubectl create secret (?:generic|docker-registry|tls) ([-.a-z0-9]+)",
                          example.read_text()))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_secret_a_pod_needs_exists_in_its_namespace(chart, example, tmp_path) -> None:
    docs = operator_writes(chart, example, tmp_path)
    assert {d["metadata"]["namespace"] for d in docs} == {USER_NS}
    created = {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    created |= {d["spec"]["secretName"] for d in by_kind(docs, "Certificate")}
    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        for template in pod_templates(workload) if workload["kind"] != "Deployment" else [
                workload["spec"]["template"]]:
            missing = referenced_secrets(template["spec"]) - created - user_created(example)
            assert not missing, (f"{example.name}: {workload['metadata']['name']} needs "
                                 f"Secrets nothing creates in {USER_NS}: {sorted(missing)}")


@pytest.mark.parametrize("name", ["aggregated.yaml", "disaggregated.yaml"])
def test_the_quickstart_examples_need_no_secret_of_the_users(name) -> None:
    assert user_created(CHART / "examples" / name) <= {"qwen-api-keys"}  # optional, commented


def test_the_routers_reach_the_charts_redis_at_the_address_of_their_url(chart,
                                                                         tmp_path) -> None:
    example = CHART / "examples" / "disaggregated.yaml"
    docs = operator_writes(chart, example, tmp_path)
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "qwen-pd-redis"]
    url = urlsplit(base64.b64decode(secret["data"]["url"]).decode())
    service = one(chart, "Service", f"{RELEASE}-redis")
    assert (url.hostname, url.port) == (f"{RELEASE}-redis.{NAMESPACE}.svc",
                                        service["spec"]["ports"][0]["port"])
    policies = by_kind(chart, "NetworkPolicy") + by_kind(docs, "NetworkPolicy")
    (redis,) = [p for p in pods_of(chart, NAMESPACE) if p.name.endswith("-redis")]
    (router,) = [p for p in pods_of(docs, USER_NS) if p.name.endswith("-router")]
    assert connects(policies, router, redis, url.port)
    stranger = Pod(f"{USER_NS}/stranger", USER_NS, {"app": "stranger"})
    assert not connects(policies, stranger, redis, url.port)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_examples_router_has_requests_and_limits(chart, example, tmp_path) -> None:
    docs = operator_writes(chart, example, tmp_path)
    for d in by_kind(docs, "Deployment"):
        if d["metadata"]["name"].endswith("-router"):
            res = d["spec"]["template"]["spec"]["containers"][0].get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), example.name
            assert "memory" in res.get("limits", {}), example.name
