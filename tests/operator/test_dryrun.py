"""`tandem render -f` as a real process: the chart's examples render to objects that pass the
Kubernetes schemas (strict) and are exactly `render_all`'s for the parsed spec (that they are
what the running operator applies: `test_operator_kmock`); a manifest kubectl would refuse
exits 1 naming the problem, a command line it cannot use 2; stdin, several documents and the
runtime flags (namespace, uid, image, replicas). The CRD schema's checks:
test_dryrun_schema.py; the chart's defaults: test_dryrun_chart.py.
"""

from __future__ import annotations

import base64
import binascii
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.operator.dryrun import PLACEHOLDER_UID, PLACEHOLDER_VALUE
from tandem.operator.render import Owner, render_all
from tandem.operator.render.security import OperatorPeer, worker_auth_secret
from tandem.operator.spec import parse_spec
from tests.operator.lws import validate
from tests.operator.manifests import K8S

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "charts" / "tandem" / "examples").glob("*.yaml"))
TANDEM = Path(sys.executable).with_name("tandem")
UID = "6f1c2b0e-7a55-4d8e-9b21-0c3d4e5f6a7b"
ENV = {"PATH": "/usr/bin:/bin", "TANDEM_IMAGE": "registry.example/tandem:env"}


def tandem_render(*args: str, stdin: str | None = None,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TANDEM), "render", *args], input=stdin, capture_output=True,
                          text=True, timeout=60, env=env or ENV, cwd=ROOT)


def documents(out: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(out) if d is not None]


def needs(doc: dict) -> list[str]:
    """The flags a user gives `tandem render` for `doc`: the chart's Redis for
    `router.managedRedis` (the operator refuses it without)."""
    managed = (doc.get("spec") or {}).get("router", {}).get("managedRedis")
    return ["--set", "redis.enabled=true"] if managed else []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_renders_valid_objects_equal_to_render_all(example: Path) -> None:
    source = yaml.safe_load(example.read_text())
    proc = tandem_render("-f", str(example), "--namespace", "ml", "--uid", UID,
                         "--image", "registry.example/tandem:1.0",
                         "--image-pull-policy", "IfNotPresent", *needs(source))
    assert proc.returncode == 0, proc.stderr
    out = documents(proc.stdout)
    secrets = [d for d in out if d["kind"] == "Secret"]
    assert out[:len(secrets)] == secrets  # created first, before the pods that mount them
    secret, *more = secrets
    docs = out[len(secrets):]
    owner = Owner(source["metadata"]["name"], "ml", UID)
    # --image: one image for every child; the operator is the chart's default install
    want = render_all(parse_spec(source["spec"]), owner,
                      image="registry.example/tandem:1.0", image_pull_policy="IfNotPresent",
                      operator=OperatorPeer("tandem-system", "tandem"))
    assert docs == want  # same objects, same (apply) order
    assert "is a placeholder" not in proc.stdout
    assert not re.search(r"[&*]id\d", proc.stdout)  # every place written out, no YAML aliases
    # the key Secret the operator creates once, first, and never with a usable value here
    assert secret == {**worker_auth_secret(owner), "data": {"key": PLACEHOLDER_VALUE}}
    # router.managedRedis: its URL Secret, created once with the ACL user's password
    if source["spec"].get("router", {}).get("managedRedis"):
        (redis_secret,) = more
        assert redis_secret["metadata"]["name"] == f"{owner.name}-redis"
        assert redis_secret["data"] == {"url": PLACEHOLDER_VALUE}
    else:
        assert more == []
    with pytest.raises(binascii.Error):
        base64.b64decode(PLACEHOLDER_VALUE, validate=True)
    assert "created once by the operator with fresh random key material" in proc.stdout
    for doc in [secret, *docs]:
        validate(doc, K8S)  # core kinds strictly, LeaderWorkerSets by their CRD


def test_stdin_environment_defaults_and_a_placeholder_uid() -> None:
    """`-f -`; no flags: the image from $TANDEM_IMAGE (as the operator takes it), the
    document's namespace or "default", and a uid the output calls a placeholder."""
    text = (EXAMPLES[0]).read_text()
    proc = tandem_render("-f", "-", stdin=text)
    assert proc.returncode == 0, proc.stderr
    docs = documents(proc.stdout)
    assert {d["metadata"]["namespace"] for d in docs} == {"default"}
    assert {d["metadata"]["ownerReferences"][0]["uid"] for d in docs} == {PLACEHOLDER_UID}
    assert "# ownerReferences[].uid is a placeholder" in proc.stdout
    images = {c["image"] for d in docs if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example/tandem:env"}
    source = yaml.safe_load(text)
    source["metadata"].update(namespace="team", uid=UID)  # `kubectl get -o yaml` output
    proc = tandem_render("-f", "-", stdin=yaml.safe_dump(source))
    docs = documents(proc.stdout)
    assert {d["metadata"]["namespace"] for d in docs} == {"team"}
    assert {d["metadata"]["ownerReferences"][0]["uid"] for d in docs} == {UID}
    proc = tandem_render("-f", "-", "--namespace", "other", stdin=yaml.safe_dump(source))
    assert proc.returncode == 1 and "'team' does not match --namespace 'other'" in proc.stderr


def test_several_documents_render_each_in_order() -> None:
    text = "\n---\n".join(p.read_text() for p in EXAMPLES)
    proc = tandem_render("-f", "-", "-n", "ml", "--set", "redis.enabled=true", stdin=text)
    assert proc.returncode == 0, proc.stderr
    owners = [d["metadata"]["ownerReferences"][0]["name"] for d in documents(proc.stdout)]
    names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in EXAMPLES]
    assert list(dict.fromkeys(owners)) == names
    assert tandem_render("-f", "-", "--uid", UID, stdin=text).returncode == 2


def test_replicas_of_an_operator_scaled_pool() -> None:
    """The aggregated example's pool is operator-autoscaled (2..6): --replicas worker=5 is
    the count a running operator keeps; outside its bounds it is clamped; a pool the
    operator does not scale is refused."""
    example = ROOT / "charts" / "tandem" / "examples" / "aggregated.yaml"

    def replicas(*flags: str) -> int:
        proc = tandem_render("-f", str(example), *flags)
        assert proc.returncode == 0, proc.stderr
        (dep,) = [d for d in documents(proc.stdout) if d["kind"] == "Deployment"
                  and d["metadata"]["name"].endswith("-worker")]
        return dep["spec"]["replicas"]

    assert replicas() == 2
    assert replicas("--replicas", "worker=5") == 5
    assert replicas("--replicas", "worker=40") == 6
    proc = tandem_render("-f", str(example), "--replicas", "decode=3")
    assert proc.returncode == 2 and "pool 'decode' is not scaled by the operator" in proc.stderr


@pytest.mark.parametrize("text, complaint", [
    ("apiVersion: tandem.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: x}\n"
     "spec: {model: {uri: SmolLM2-135M-Instruct}, decode: {engine: {kvCacheMemory: '1.5'}}}",
     "kvCacheMemory"),
    ("apiVersion: tandem.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: x}\n"
     "spec: {model: {uri: SmolLM2-135M-Instruct}, router: {policy: fastest}}",
     "router.policy"),
    ("apiVersion: tandem.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: x}\n"
     "spec: {model: {uri: pvc://m}, prefill: {replicas: 1, engine: {blockSize: 32}}}",
     "blockSize"),
    ("apiVersion: tandem.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: x}\n"
     "spec: {decode: {replicas: 1}}", "spec.model"),
    ("apiVersion: tandem.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: Bad_Name}\n"
     "spec: {model: {uri: pvc://m}}", "Bad_Name"),
    ("apiVersion: tandem.dev/v1alpha1\nkind: InferenceService\nspec: {model: {uri: pvc://m}}",
     "metadata.name"),
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "not an InferenceService"),
    ("spec: [unclosed\n", "not valid YAML"),
    ("", "no InferenceService"),
])
def test_a_refused_manifest_exits_1_naming_the_problem(text: str, complaint: str) -> None:
    proc = tandem_render("-f", "-", stdin=text)
    assert proc.returncode == 1, proc.stdout
    assert proc.stdout == ""
    assert complaint in proc.stderr and proc.stderr.startswith("tandem render: stdin: "), (
        proc.stderr)
    assert "Traceback" not in proc.stderr


def test_an_unreadable_file_exits_1(tmp_path: Path) -> None:
    proc = tandem_render("-f", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 1 and "cannot read" in proc.stderr
    assert "missing.yaml" in proc.stderr
