"""The operator is no confused deputy: every pod it renders meets the Pod Security Standards'
"restricted" profile (`tests.operator.pss`), and what an InferenceService's pod settings may
add (volumes, runtime class, Secrets, images, namespace) is refused unless the chart's admin
values allow it, each refusal naming the field (`operator.admission`)."""

from __future__ import annotations

import copy

import pytest

from tandem.operator.admission import (
    AdmissionPolicy,
    admit,
    image_allowed,
    normalized_image,
    policy_from_env,
)
from tandem.operator.render.multinode import pod_templates
from tandem.operator.spec import SpecError, parse_spec
from tests.operator.manifests import render
from tests.operator.pss import violations
from tests.operator.samples import SPECS, spec

DEFAULT = AdmissionPolicy()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_rendered_pod_meets_the_restricted_profile(name: str) -> None:
    workloads = [d for d in render(name) if d["kind"] in ("Deployment", "LeaderWorkerSet")]
    assert workloads
    for doc in workloads:
        for template in pod_templates(doc):
            assert violations(template["spec"]) == [], doc["metadata"]["name"]


def test_the_checker_catches_what_the_profile_forbids() -> None:
    (dep,) = [d for d in render("aggregated") if d["kind"] == "Deployment"
              and d["metadata"]["name"] == "demo-router"]
    base = dep["spec"]["template"]["spec"]
    for change, expected in (
            (lambda p: p.update(hostNetwork=True), "hostNetwork"),
            (lambda p: p["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
             "volume root"),
            (lambda p: p["containers"][0]["securityContext"].update(privileged=True),
             "privileged"),
            (lambda p: p["containers"][0]["securityContext"].update(
                capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}), "capabilities.add"),
            (lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
             "allowPrivilegeEscalation"),
            (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile"),
            (lambda p: p["containers"][0]["ports"][0].update(hostPort=80), "hostPort")):
        pod = copy.deepcopy(base)
        change(pod)
        assert any(expected in v for v in violations(pod)), expected


def _with(pool: str, **settings) -> dict:
    raw = spec("disaggregated")
    raw.setdefault(pool, {}).update(settings)
    return raw


@pytest.mark.parametrize(("raw", "field"), [
    (_with("decode", volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
     "decode.volumes[0].hostPath"),
    (_with("router", volumes=[{"name": "n", "nfs": {"server": "x", "path": "/"}}]),
     "router.volumes[0].nfs"),
    (_with("prefill", runtimeClassName="unconfined"), "prefill.runtimeClassName"),
    (_with("decode", envFrom=[{"secretRef": {"name": "demo-worker-auth"}}]),
     "decode.envFrom[0].secretRef"),
    (_with("router", env=[{"name": "K", "valueFrom": {"secretKeyRef": {
        "name": "db", "key": "password"}}}]), "router.env[0].valueFrom.secretKeyRef"),
    (_with("decode", volumes=[{"name": "s", "secret": {"secretName": "other-redis"}}]),
     "decode.volumes[0].secret"),
    (_with("decode", volumes=[{"name": "p", "projected": {"sources": [
        {"configMap": {"name": "c"}}, {"secret": {"name": "db"}}]}}]),
     "decode.volumes[0].projected.sources[1].secret"),
])
def test_each_refusal_names_the_field(raw: dict, field: str) -> None:
    with pytest.raises(SpecError, match=field.replace("[", r"\[").replace("]", r"\]")):
        admit(parse_spec(raw), "ml", DEFAULT)


def test_the_admin_values_allow_them() -> None:
    host = parse_spec(_with("decode", volumes=[{"name": "m", "hostPath": {"path": "/mnt"}}]))
    admit(host, "ml", AdmissionPolicy(allow_host_path=True))
    admit(parse_spec(_with("prefill", runtimeClassName="nvidia")), "ml", DEFAULT)
    admit(parse_spec(_with("prefill", runtimeClassName="kata")), "ml",
          AdmissionPolicy(allowed_runtime_classes=("kata",)))
    env = parse_spec(_with("decode", envFrom=[{"secretRef": {"name": "team-ml-extra"}}]))
    admit(env, "ml", AdmissionPolicy(allowed_secrets=("team-ml-*",)))
    with pytest.raises(SpecError, match="envFrom"):
        admit(env, "ml", AdmissionPolicy(allowed_secrets=("team-ops-*",)))
    admit(parse_spec(spec("disaggregated")), "ml", DEFAULT)  # typed Secret fields stay


def test_images_only_from_the_allowed_registries() -> None:
    policy = AdmissionPolicy(allowed_registries=("registry.example", "docker.io/tandem"))
    assert normalized_image("redis:7") == "docker.io/library/redis:7"
    assert normalized_image("tandem/x:1") == "docker.io/tandem/x:1"
    assert normalized_image("localhost:5000/x") == "localhost:5000/x"
    assert image_allowed("registry.example/tandem:1", policy.allowed_registries)
    assert image_allowed("tandem/worker@sha256:" + "a" * 64, policy.allowed_registries)
    for bad in ("registry.example.evil.io/x:1", "ghcr.io/x/y:1", "redis:7",
                "registry.exampleX/y"):
        assert not image_allowed(bad, policy.allowed_registries), bad
    admit(parse_spec(spec("pods")), "ml", AdmissionPolicy(
        allowed_registries=("registry.example",), allowed_secrets=("team",)))
    raw = {**spec("aggregated"), "image": "ghcr.io/someone/miner:1"}
    with pytest.raises(SpecError, match=r"spec.image: 'ghcr.io/someone/miner:1' is not from"):
        admit(parse_spec(raw), "ml", policy)
    raw = _with("router", image="ghcr.io/someone/miner:1")
    with pytest.raises(SpecError, match=r"router.image"):
        admit(parse_spec(raw), "ml", policy)


def test_namespaces_and_the_environment() -> None:
    policy = policy_from_env({"TANDEM_ALLOWED_NAMESPACES": "ml, serving",
                              "TANDEM_ALLOWED_REGISTRIES": "registry.example/",
                              "TANDEM_ALLOWED_SECRETS": "a-*,b",
                              "TANDEM_ALLOWED_RUNTIME_CLASSES": "",
                              "TANDEM_ALLOW_HOST_PATH": "true"})
    assert policy == AdmissionPolicy(True, (), ("a-*", "b"), ("registry.example",),
                                     ("ml", "serving"))
    assert policy_from_env({}) == DEFAULT
    admit(parse_spec(spec("aggregated")), "serving", policy)
    with pytest.raises(SpecError, match="metadata.namespace: this operator may not deploy "
                                        "into 'kube-system'"):
        admit(parse_spec(spec("aggregated")), "kube-system", policy)


def test_a_cluster_issuer_needs_the_admins_leave() -> None:
    raw = spec("secure")
    assert raw["kvTransfer"]["tlsIssuerRef"]["kind"] == "ClusterIssuer"
    with pytest.raises(SpecError, match="kvTransfer.tlsIssuerRef: ClusterIssuer 'tandem-ca' "
                                        "is not allowed"):
        admit(parse_spec(raw), "ml", DEFAULT)
    admit(parse_spec(raw), "ml", AdmissionPolicy(allowed_cluster_issuers=("tandem-ca",)))
    raw["kvTransfer"]["tlsIssuerRef"] = {"name": "team-ca"}  # a namespaced Issuer: fine
    admit(parse_spec(raw), "ml", DEFAULT)
    assert policy_from_env({"TANDEM_ALLOWED_CLUSTER_ISSUERS": "a,b"}).allowed_cluster_issuers \
        == ("a", "b")
