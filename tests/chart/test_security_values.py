"""The chart's `security` values reach the operator as its admission policy (the env
`tandem.operator.admission.policy_from_env` reads), and `security.allowedNamespaces` limits a
cluster-wide operator's writes: a Role per allowed namespace, a ClusterRole that only watches
InferenceServices and patches their status."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator.admission import AdmissionPolicy, policy_from_env
from tests.chart.conftest import NAMESPACE, RELEASE, Helm, by_kind, one

FULLNAME = f"{RELEASE}"


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    dep = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    (c,) = dep[0]["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


def test_defaults_are_the_operators_defaults(helm: Helm) -> None:
    assert policy_from_env(operator_env(helm.render())) == AdmissionPolicy()


def test_values_become_the_admission_policy(helm: Helm) -> None:
    docs = helm.render(sets=("security.allowHostPath=true",
                             "security.allowedRuntimeClasses={kata,nvidia}",
                             "security.allowedSecrets={team-ml-*}",
                             "security.allowedRegistries={registry.example.com/ml}",
                             "security.allowedNamespaces={ml,serving}"))
    assert policy_from_env(operator_env(docs)) == AdmissionPolicy(
        True, ("kata", "nvidia"), ("team-ml-*",), ("registry.example.com/ml",),
        ("ml", "serving"), ())


def test_allowed_namespaces_limit_a_cluster_wide_operators_writes(helm: Helm) -> None:
    docs = helm.render(sets=("security.allowedNamespaces={ml,serving}",))
    names = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
             for d in docs if d["kind"] in ("ClusterRole", "Role")}
    assert ("ClusterRole", None, f"{FULLNAME}-operator") not in names
    assert {("Role", "ml", f"{FULLNAME}-operator"),
            ("Role", "serving", f"{FULLNAME}-operator")} <= names
    watch = one(docs, "ClusterRole", f"{FULLNAME}-operator-watch")
    granted = {(g, r, v) for rule in watch["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {("tandem.dev", "inferenceservices", v)
                       for v in ("get", "list", "watch", "patch")} | {
        ("tandem.dev", "inferenceservices/status", "patch"), ("", "events", "create")}
    binding = one(docs, "ClusterRoleBinding", f"{FULLNAME}-operator-watch")
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    dep = one(docs, "Deployment", f"{FULLNAME}-operator")
    assert "--all-namespaces" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    # without the value: the ClusterRole as before, no watch-only one
    plain = helm.render()
    assert one(plain, "ClusterRole", f"{FULLNAME}-operator")
    assert not [d for d in plain if d["metadata"]["name"].endswith("-operator-watch")]


@pytest.mark.parametrize("bad", ["security.allowedNamespaces={Bad_NS}",
                                 "security.allowHostPath=maybe",
                                 "security.allowedRegistries={-x}"])
def test_the_schema_refuses_bad_security_values(helm: Helm, bad: str) -> None:
    proc = helm.run(*helm.template_args(sets=(bad,)), check=False)
    assert proc.returncode != 0 and "security" in proc.stderr
