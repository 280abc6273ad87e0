"""The Helm chart with the real helm binary.

* `helm lint --strict` passes for the default values and every `ci/*-values.yaml`.
* Everything `helm template` renders (CRDs included) validates against the Kubernetes 1.32
  JSON schemas in strict mode (`kubernetes-validate`: unknown fields are errors).
* The content is what the chart promises: the operator runs as the ServiceAccount the RBAC
  binds, with exactly the listed RBAC rules (no wildcards), hardened, with the image and the
  flags its values ask for; Redis and the dashboard appear only when enabled.
* values.schema.json rejects bad values before anything renders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.chart.conftest import (
    CHART,
    CI_VALUES,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    Helm,
    by_kind,
    one,
)

VALUE_SETS = {
    "default": ((), ()),
    **{p.name.removesuffix("-values.yaml"): ((p,), ()) for p in CI_VALUES},
    "redis+no-dashboards": ((), ("redis.enabled=true", "dashboards.enabled=false")),
}

# Exactly what the operator may do: (apiGroup, resource) -> verbs. Children are applied
# server-side (create, then patch), read back for status and deleted when turned off.
CHILD = {"get", "list", "watch", "create", "patch", "delete"}
OPERATOR_RULES = {
    ("tandem.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("tandem.dev", "inferenceservices/status"): {"patch"},
    ("apps", "deployments"): CHILD,
    ("", "services"): CHILD,
    ("", "configmaps"): CHILD,
    ("", "serviceaccounts"): CHILD,
    ("policy", "poddisruptionbudgets"): CHILD,
    ("rbac.authorization.k8s.io", "roles"): CHILD,
    ("rbac.authorization.k8s.io", "rolebindings"): CHILD,
    ("discovery.k8s.io", "endpointslices"): {"list", "watch"},
    ("autoscaling", "horizontalpodautoscalers"): CHILD,
    ("monitoring.coreos.com", "servicemonitors"): CHILD,
    ("", "events"): {"create"},
}
CRD_RULES = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
FULLNAME = RELEASE  # the release name contains the chart name


def rule_table(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no names, no URLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                verbs = table.setdefault((group, resource), set())
                assert not verbs & set(rule["verbs"]), f"{group}/{resource} granted twice"
                verbs.update(rule["verbs"])
    return table


def pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in by_kind(docs, "Deployment")]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# ---------------------------------------------------------------------------------------------
# lint and schema validation


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "default")
def test_lint_strict(helm: Helm, values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    if values:
        args += ["--values", str(values)]
    proc = helm.run(*args)
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_manifests_validate_against_kubernetes_1_32_strict(helm: Helm,
                                                                   name: str) -> None:
    values, sets = VALUE_SETS[name]
    docs = helm.render(values, sets, crds=True)
    assert docs, "nothing rendered"
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            version = kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {where} is invalid at {path}: {exc.message}", pytrace=False)
        assert version == "1.32", where
        if doc["kind"] != "CustomResourceDefinition":
            labels = doc["metadata"]["labels"]
            assert labels["app.kubernetes.io/managed-by"] == "Helm", where
            assert labels["app.kubernetes.io/instance"] == RELEASE, where


def test_crds_are_installed_from_the_crds_folder(helm: Helm) -> None:
    """Helm installs crds/ before the templates; `--include-crds` shows them, a plain
    template does not (they are not templates, so no value can change them)."""
    with_crds = by_kind(helm.render(crds=True), "CustomResourceDefinition")
    assert [c["metadata"]["name"] for c in with_crds] == ["inferenceservices.tandem.dev"]
    assert not by_kind(helm.render(), "CustomResourceDefinition")
    assert not list((CHART / "templates").glob("*crd*"))


@pytest.mark.parametrize("sets, complaint", [
    (("replicaCount=-1",), "replicaCount"),
    (("replicaCount=2",), "replicaCount"),
    (("replicaCount=one",), "replicaCount"),
    (("nosuchkey=1",), "nosuchkey"),
    (("image.registry=x",), "registry"),
    (("image.pullPolicy=Sometimes",), "pullPolicy"),
    (("image.digest=sha256:abc",), "digest"),
    (("watchNamespaces[0]=Team_A",), "watchNamespaces"),
    (("operator.health.port=80",), "port"),
    (("redis.maxmemory=lots",), "maxmemory"),
    (("redis.maxmemoryPolicy=whatever",), "maxmemoryPolicy"),
    (("resources.limits.memory=1 GB",), "memory"),
    (("dashboards.enabled=yes please",), "enabled"),
])
def test_schema_rejects_bad_values(helm: Helm, sets: tuple[str, ...], complaint: str) -> None:
    proc = helm.run(*helm.template_args(sets=sets), check=False)
    assert proc.returncode != 0, f"--set {sets} rendered"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert complaint in proc.stderr, proc.stderr


def test_values_yaml_matches_its_schema() -> None:
    """The defaults validate, and every key the schema knows has a default (and so a line of
    documentation) in values.yaml."""
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)

    def walk(node: dict[str, Any], vals: dict[str, Any], path: str) -> None:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        for key, sub in node.get("properties", {}).items():
            if key == "global":
                continue
            assert key in vals, f"{path}{key} is in values.schema.json but not in values.yaml"
            if isinstance(vals[key], dict) and node.get("additionalProperties") is False:
                walk(sub, vals[key], f"{path}{key}.")

    walk(schema, values, "")


# ---------------------------------------------------------------------------------------------
# content


def test_operator_runs_as_the_service_account_the_rbac_binds(helm: Helm) -> None:
    docs = helm.render()
    (sa,) = by_kind(docs, "ServiceAccount")
    assert sa["metadata"]["namespace"] == NAMESPACE
    pod = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    bindings = by_kind(docs, "ClusterRoleBinding")
    assert {b["metadata"]["name"] for b in bindings} == {f"{FULLNAME}-operator",
                                                         f"{FULLNAME}-crd-observer"}
    roles = {r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")}
    for b in bindings:
        assert b["roleRef"]["name"] in roles
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                  "namespace": NAMESPACE}]
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")


def test_rbac_rules_are_exactly_the_listed_ones(helm: Helm) -> None:
    docs = helm.render()
    operator = one(docs, "ClusterRole", f"{FULLNAME}-operator")
    assert rule_table(operator["rules"]) == OPERATOR_RULES
    crds = one(docs, "ClusterRole", f"{FULLNAME}-crd-observer")
    assert rule_table(crds["rules"]) == CRD_RULES
    for role in [*by_kind(docs, "ClusterRole"), *by_kind(docs, "Role")]:
        text = json.dumps(role["rules"])
        assert "*" not in text, f"wildcard in {role['metadata']['name']}"
        for verb in ("update", "deletecollection", "escalate", "bind", "impersonate"):
            assert f'"{verb}"' not in text, f"{verb} in {role['metadata']['name']}"
        assert "secrets" not in text and "pods" not in text


def test_watch_namespaces_use_namespaced_roles(helm: Helm) -> None:
    docs = helm.render(sets=("watchNamespaces={team-a,team-b}",))
    # cluster-wide: only the CRD watch
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == [
        f"{FULLNAME}-crd-observer"]
    assert rule_table(by_kind(docs, "ClusterRole")[0]["rules"]) == CRD_RULES
    assert len(by_kind(docs, "ClusterRoleBinding")) == 1
    roles = by_kind(docs, "Role")
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for role in roles:
        assert rule_table(role["rules"]) == OPERATOR_RULES
    for b in bindings:
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                "name": f"{FULLNAME}-operator"}
        assert b["subjects"][0]["namespace"] == NAMESPACE
    args = operator_container(docs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args


def test_rbac_and_service_account_can_be_left_to_the_cluster_admin(helm: Helm) -> None:
    docs = helm.render(sets=("rbac.create=false", "serviceAccount.create=false",
                             "serviceAccount.name=ops-managed"))
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                        "RoleBinding"}
    pod = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ops-managed"
    proc = helm.run(*helm.template_args(sets=("serviceAccount.create=false",)), check=False)
    assert proc.returncode != 0 and "serviceAccount.name is required" in proc.stderr


def test_operator_deployment(helm: Helm) -> None:
    docs = helm.render()
    dep = one(docs, "Deployment", f"{FULLNAME}-operator")
    assert dep["metadata"]["namespace"] == NAMESPACE
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # never two kopf operators
    c = operator_container(docs)
    assert c["image"] == "ghcr.io/tandem-llm/tandem:0.1.0"  # the chart's appVersion
    assert c["command"] == ["tandem", "operator"]
    assert c["args"] == ["--standalone", "--all-namespaces",
                         "--liveness=http://0.0.0.0:8080/healthz"]
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    env = env_of(c)
    assert env["TANDEM_IMAGE"] == c["image"]  # the operator's default for workers and routers
    assert env["TANDEM_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_image_comes_from_values(helm: Helm) -> None:
    docs = helm.render(sets=("image.repository=registry.example.com/ml/tandem",
                             "image.tag=1.2.3", "image.pullPolicy=Always"))
    c = operator_container(docs)
    assert c["image"] == "registry.example.com/ml/tandem:1.2.3"
    assert c["imagePullPolicy"] == "Always"
    assert env_of(c)["TANDEM_IMAGE"] == "registry.example.com/ml/tandem:1.2.3"
    assert env_of(c)["TANDEM_IMAGE_PULL_POLICY"] == "Always"
    digest = "sha256:" + "ab" * 32
    c = operator_container(helm.render(sets=("image.tag=1.2.3", f"image.digest={digest}")))
    assert c["image"] == f"ghcr.io/tandem-llm/tandem@{digest}"


def test_health_endpoint_can_be_turned_off(helm: Helm) -> None:
    c = operator_container(helm.render(sets=("operator.health.enabled=false",
                                             "operator.extraArgs={--verbose}")))
    assert not any(a.startswith("--liveness") for a in c["args"])
    assert "livenessProbe" not in c and "readinessProbe" not in c and "ports" not in c
    assert c["args"][-1] == "--verbose"


def test_every_pod_is_hardened(helm: Helm) -> None:
    docs = helm.render(sets=("redis.enabled=true",))
    assert len(pod_specs(docs)) == 2
    for pod in pod_specs(docs):
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
        assert all("hostPath" not in v for v in pod.get("volumes", []))
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["runAsNonRoot"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert "privileged" not in sc
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
            assert c["livenessProbe"] and c["readinessProbe"]


def test_selectors_match_their_pods(helm: Helm) -> None:
    docs = helm.render(sets=("redis.enabled=true",))
    pods = []
    for dep in by_kind(docs, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        pods.append(labels)
    for svc in by_kind(docs, "Service"):
        matching = [p for p in pods if svc["spec"]["selector"].items() <= p.items()]
        assert len(matching) == 1, svc["metadata"]["name"]
    (policy,) = by_kind(docs, "NetworkPolicy")
    redis_pod = next(p for p in pods if p["app.kubernetes.io/component"] == "redis")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= redis_pod.items()


def test_redis_only_when_enabled(helm: Helm) -> None:
    assert not [d for d in helm.render() if "redis" in d["metadata"]["name"]]
    docs = helm.render(sets=("redis.enabled=true",))
    dep = one(docs, "Deployment", f"{FULLNAME}-redis")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "redis:7.4-alpine"
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    svc = one(docs, "Service", f"{FULLNAME}-redis")
    assert svc["spec"]["ports"][0]["port"] == 6379
    # only Tandem routers get in, from any namespace
    (rule,) = one(docs, "NetworkPolicy", f"{FULLNAME}-redis")["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/component": "router"}
    assert peer["podSelector"]["matchExpressions"] == [
        {"key": "tandem.dev/inference-service", "operator": "Exists"}]
    off = helm.render(sets=("redis.enabled=true", "redis.networkPolicy.enabled=false"))
    assert not by_kind(off, "NetworkPolicy")


def test_redis_arguments_are_accepted_by_a_real_redis_server(helm: Helm, tmp_path) -> None:
    """The rendered `redis-server` flags start Debian's redis-server (the one the router tests
    use) with the intended settings."""
    import shutil
    import subprocess
    import time

    import redis

    from tests.serving.conftest import free_port

    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (Debian: apt-get install redis-server; .ci/run does)"
    docs = helm.render(sets=("redis.enabled=true",))
    (c,) = one(docs, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    args = list(c["args"])
    assert args[0] == "redis-server"
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    proc = subprocess.Popen([exe, *args[1:], "--dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.05)
        conf = {k: client.config_get(k)[k] for k in
                ("maxmemory", "maxmemory-policy", "save", "appendonly", "protected-mode")}
        assert conf == {"maxmemory": str(256 * 1024 * 1024), "maxmemory-policy": "allkeys-lru",
                        "save": "", "appendonly": "no", "protected-mode": "no"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_dashboard_configmap(helm: Helm) -> None:
    docs = helm.render()
    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    dashboard = json.loads(cm["data"]["tandem.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "tandem.json").read_text())
    assert not by_kind(helm.render(sets=("dashboards.enabled=false",)), "ConfigMap")
    moved = helm.render(sets=("dashboards.namespace=monitoring",
                              "dashboards.labels.grafana_folder=Tandem",
                              "dashboards.labels.grafana_dashboard=off"))
    meta = one(moved, "ConfigMap", f"{FULLNAME}-dashboard")["metadata"]
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["grafana_folder"] == "Tandem"
    assert meta["labels"]["grafana_dashboard"] == "1"  # the sidecar's label stays


def test_notes_render(helm: Helm, tmp_path: Path) -> None:
    """NOTES.txt renders (helm prints it after install; `helm install --dry-run` needs a
    cluster, so a copy of the chart renders it into a ConfigMap instead)."""
    import shutil

    chart = tmp_path / "tandem"
    shutil.copytree(CHART, chart)
    notes = chart / "templates" / "NOTES.txt"
    (chart / "templates" / "_notes_under_test.tpl").write_text(
        '{{- define "notesUnderTest" -}}\n' + notes.read_text() + "{{- end }}\n")
    notes.unlink()
    (chart / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-under-test\n"
        'data:\n  notes: {{ include "notesUnderTest" . | quote }}\n')
    args = helm.template_args(sets=("redis.enabled=true",))
    args[2] = str(chart)
    docs = [d for d in yaml.safe_load_all(helm.run(*args).stdout) if d]
    notes_text = one(docs, "ConfigMap", "notes-under-test")["data"]["notes"]
    assert f"deployment/{FULLNAME}-operator" in notes_text
    assert f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0" in notes_text
    assert "watching all namespaces" in notes_text
    assert "kubectl apply -f charts/tandem/examples/" in notes_text
