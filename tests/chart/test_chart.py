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

import base64
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
    # what the endpoint picker's Role grants (gateway mode): its pool's InferenceObjectives
    ("inference.networking.x-k8s.io", "inferenceobjectives"): {"list", "watch"},
    ("autoscaling", "horizontalpodautoscalers"): CHILD,
    ("monitoring.coreos.com", "servicemonitors"): CHILD,
    ("networking.k8s.io", "networkpolicies"): CHILD,
    ("cert-manager.io", "certificates"): CHILD,
    ("cert-manager.io", "issuers"): CHILD,  # kvTransfer.tlsOwnCA
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): CHILD,  # multi-node pools
    ("inference.networking.k8s.io", "inferencepools"): CHILD,  # router.mode gateway
    ("gateway.networking.k8s.io", "httproutes"): CHILD,  # its example route
    ("keda.sh", "scaledobjects"): CHILD,  # autoscaling.mode: keda
    ("", "secrets"): {"create"},  # the worker-auth key, created once: no Secret is readable
    ("", "events"): {"create"},
}
CRD_RULES = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
FULLNAME = RELEASE  # the release name contains the chart name
LEADER_ROLE = f"{FULLNAME}-leader-election"


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
    (("replicaCount=1",), "replicaCount"),  # gone: operator.replicas
    (("operator.replicas=-1",), "replicas"),
    (("operator.replicas=one",), "replicas"),
    (("operator.leaderElection.leaseDuration=1",), "leaseDuration"),
    (("operator.leaderElection.retryPeriod=0",), "retryPeriod"),
    (("nosuchkey=1",), "nosuchkey"),
    (("image.registry=x",), "registry"),
    (("image.pullPolicy=Sometimes",), "pullPolicy"),
    (("image.digest=sha256:abc",), "digest"),
    (("watchNamespaces[0]=Team_A",), "watchNamespaces"),
    (("operator.health.port=80",), "port"),
    (("redis.maxmemory=lots",), "maxmemory"),
    (("redis.maxmemoryPolicy=whatever",), "maxmemoryPolicy"),
    (("redis.auth.existingSecret=Not_A_Name",), "existingSecret"),
    (("redis.auth.urlSecretNamespaces={team-a}",), "urlSecretNamespaces"),  # removed
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
    # namespaced: only leader election's (its own test below)
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == [LEADER_ROLE]
    assert [b["metadata"]["name"] for b in by_kind(docs, "RoleBinding")] == [LEADER_ROLE]


def test_rbac_rules_are_exactly_the_listed_ones(helm: Helm) -> None:
    docs = helm.render()
    operator = one(docs, "ClusterRole", f"{FULLNAME}-operator")
    assert rule_table(operator["rules"]) == OPERATOR_RULES
    crds = one(docs, "ClusterRole", f"{FULLNAME}-crd-observer")
    assert rule_table(crds["rules"]) == CRD_RULES
    for role in [*by_kind(docs, "ClusterRole"), *by_kind(docs, "Role")]:
        if role["metadata"]["name"] == LEADER_ROLE:  # its own test below
            continue
        text = json.dumps(role["rules"])
        assert "*" not in text, f"wildcard in {role['metadata']['name']}"
        for verb in ("update", "deletecollection", "escalate", "bind", "impersonate"):
            assert f'"{verb}"' not in text, f"{verb} in {role['metadata']['name']}"
        assert "pods" not in text
        secrets = [r for r in role["rules"] if "secrets" in r["resources"]]
        assert all(r["resources"] == ["secrets"] and r["verbs"] == ["create"] for r in secrets)


def test_rbac_covers_every_custom_kind_the_operator_applies() -> None:
    """Each custom resource in the operator's client (LeaderWorkerSet, ServiceMonitor,
    Certificate) has its child rule: a kind added there without RBAC would fail to apply."""
    from tandem.operator.kube import KINDS

    custom = {(k.group, k.plural) for k in KINDS.values() if k.group}
    assert ("leaderworkerset.x-k8s.io", "leaderworkersets") in custom
    assert ("keda.sh", "scaledobjects") in custom
    assert {key: OPERATOR_RULES.get(key) for key in custom} == dict.fromkeys(custom, CHILD)


def test_watch_namespaces_use_namespaced_roles(helm: Helm) -> None:
    docs = helm.render(sets=("watchNamespaces={team-a,team-b}",))
    # cluster-wide: only the CRD watch
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == [
        f"{FULLNAME}-crd-observer"]
    assert rule_table(by_kind(docs, "ClusterRole")[0]["rules"]) == CRD_RULES
    assert len(by_kind(docs, "ClusterRoleBinding")) == 1
    roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] != LEADER_ROLE]
    bindings = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] != LEADER_ROLE]
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
    assert dep["spec"]["replicas"] == 2  # a leader and a standby
    # leader election makes an overlap safe: the new pod stands by until the old one releases
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": 1, "maxUnavailable": 0}}
    c = operator_container(docs)
    # the torch-free control image, at the chart's appVersion
    assert c["image"] == "ghcr.io/tandem-llm/tandem-control:0.1.0"
    assert c["command"] == ["tandem", "--log-level", "INFO", "operator"]
    assert c["args"] == ["--standalone", "--leader-elect", f"--lease-name={FULLNAME}-operator",
                         "--lease-duration=15", "--renew-deadline=10", "--retry-period=2",
                         "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    env = env_of(c)
    # the workers' default (CPU torch) and the routers' (the control image)
    assert env["TANDEM_IMAGE"] == "ghcr.io/tandem-llm/tandem:0.1.0"
    assert env["TANDEM_ROUTER_IMAGE"] == c["image"]
    assert env["TANDEM_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["TANDEM_OPERATOR_RELEASE"] == RELEASE  # routers labelled with it (Redis policy)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["tandem.dev/operator-release"] == RELEASE  # the workers' policies admit it
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_image_comes_from_values(helm: Helm) -> None:
    docs = helm.render(sets=("image.repository=registry.example.com/ml/tandem",
                             "image.tag=1.2.3", "image.pullPolicy=Always"))
    c = operator_container(docs)
    assert c["image"] == "ghcr.io/tandem-llm/tandem-control:0.1.0"  # controlImage's
    assert c["imagePullPolicy"] == "Always"
    assert env_of(c)["TANDEM_IMAGE"] == "registry.example.com/ml/tandem:1.2.3"
    assert env_of(c)["TANDEM_IMAGE_PULL_POLICY"] == "Always"
    digest = "sha256:" + "ab" * 32
    c = operator_container(helm.render(sets=("image.tag=1.2.3", f"image.digest={digest}")))
    assert env_of(c)["TANDEM_IMAGE"] == f"ghcr.io/tandem-llm/tandem@{digest}"
    c = operator_container(helm.render(sets=("controlImage.repository=",
                                             f"image.digest={digest}")))
    assert c["image"] == f"ghcr.io/tandem-llm/tandem@{digest}"  # no control image: image


def test_health_endpoint_can_be_turned_off(helm: Helm) -> None:
    c = operator_container(helm.render(sets=("operator.health.enabled=false",
                                             "operator.extraArgs={--resync-interval=60}")))
    assert not any(a.startswith("--liveness") for a in c["args"])
    assert "livenessProbe" not in c and "readinessProbe" not in c and "ports" not in c
    assert c["args"][-1] == "--resync-interval=60"


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
    # only the routers of this release's operator get in, from any namespace
    rule, operator = one(docs, "NetworkPolicy", f"{FULLNAME}-redis")["spec"]["ingress"]
    assert operator["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "operator"}}}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/component": "router",
                                                  "tandem.dev/operator-release": RELEASE}
    assert peer["podSelector"]["matchExpressions"] == [
        {"key": "tandem.dev/inference-service", "operator": "Exists"}]
    off = helm.render(sets=("redis.enabled=true", "redis.networkPolicy.enabled=false"))
    assert not by_kind(off, "NetworkPolicy")


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's `$(VAR)` expansion of container args."""
    import re

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a)
            for a in args]


def test_redis_arguments_and_probes_work_on_a_real_redis_server(helm: Helm, tmp_path) -> None:
    """The rendered `redis-server` flags (the password expanded from the Secret's env, as the
    kubelet does) start Debian's redis-server with the intended settings; it refuses clients
    without the password, and the rendered probe commands pass with the pod's REDISCLI_AUTH
    and fail without it."""
    import shutil
    import subprocess
    import time

    import redis

    from tests.serving.helpers import free_port

    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (Debian: apt-get install redis-server; .ci/run does)"
    assert shutil.which("redis-cli"), "redis-cli is required (it comes with redis-server)"
    docs = helm.render(sets=("redis.enabled=true",))
    (c,) = one(docs, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    secret = one(docs, "Secret", f"{FULLNAME}-redis")
    password = base64.b64decode(secret["data"]["password"]).decode()
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert refs == {"REDIS_PASSWORD": {"name": f"{FULLNAME}-redis", "key": "password"},
                    "REDISCLI_AUTH": {"name": f"{FULLNAME}-redis", "key": "password"}}
    assert password not in json.dumps([d for d in docs if d["kind"] != "Secret"])
    args = _expand(list(c["args"]), {"REDIS_PASSWORD": password})
    assert args[0] == "redis-server"
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    proc = subprocess.Popen([exe, *args[1:], "--dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, password=password, decode_responses=True)
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
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong").ping()
        # the operator, with the address and the admin password file the chart gives it,
        # creates an InferenceService's ACL user, whose URL works as the routers get it
        from tandem.operator.redis_acl import RedisAcl, managed_redis_from_env, url_secret
        from tandem.operator.render.common import Owner

        op = operator_container(docs)
        operator_env = env_of(op)
        assert operator_env["TANDEM_REDIS_ADDRESS"] == f"{FULLNAME}-redis.{NAMESPACE}.svc:6379"
        spec = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "redis-admin"]
        (mount,) = [m for m in op["volumeMounts"] if m["name"] == "redis-admin"]
        assert vol["secret"]["secretName"] == secret["metadata"]["name"]
        assert vol["secret"]["items"] == [{"key": "password", "path": "password"}]
        assert operator_env["TANDEM_REDIS_ADMIN_PASSWORD_FILE"] == f"{mount['mountPath']}/password"
        (tmp_path / "password").write_text(password)
        managed = managed_redis_from_env({"TANDEM_REDIS_ADDRESS": f"127.0.0.1:{port}",
                                          "TANDEM_REDIS_ADMIN_PASSWORD_FILE":
                                              str(tmp_path / "password")})
        owner = Owner("alpha", "team-a", "uid")
        RedisAcl(managed).ensure_user(owner)
        url = base64.b64decode(url_secret(managed, owner)["data"]["url"]).decode()
        assert redis.Redis.from_url(url).ping()
        for probe in ("livenessProbe", "readinessProbe"):
            command = [a.replace(" -p 6379 ", f" -p {port} ") for a in c[probe]["exec"]["command"]]
            env = {"PATH": "/usr/bin:/bin"}
            ok = subprocess.run(command, env={**env, "REDISCLI_AUTH": password}, timeout=10)
            assert ok.returncode == 0, probe
            for bad in ({}, {"REDISCLI_AUTH": "wrong"}):
                assert subprocess.run(command, env={**env, **bad}, timeout=10,
                                      capture_output=True).returncode != 0, (probe, bad)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_password_is_generated_per_render_or_taken_from_your_secret(helm: Helm) -> None:
    """No cluster: `lookup` finds nothing, so each render generates a fresh 32-character
    password (an install; an upgrade reads the live Secret back). It stays in the release
    namespace (no URL, no copy in a watched namespace: the operator gives each
    InferenceService an ACL user of its own); with existingSecret the chart writes none and
    Redis and the operator read your key."""
    import re

    def password(docs: list[dict[str, Any]]) -> str:
        secret = one(docs, "Secret", f"{FULLNAME}-redis")
        return base64.b64decode(secret["data"]["password"]).decode()

    a = password(helm.render(sets=("redis.enabled=true",)))
    b = password(helm.render(sets=("redis.enabled=true",)))
    assert re.fullmatch(r"[A-Za-z0-9]{32}", a) and a != b
    docs = helm.render(sets=("redis.enabled=true", "watchNamespaces={team-a,team-b}"))
    secrets = {s["metadata"]["namespace"]: s["data"] for s in by_kind(docs, "Secret")}
    assert list(secrets) == [NAMESPACE] and set(secrets[NAMESPACE]) == {"password"}
    peer = one(docs, "NetworkPolicy", f"{FULLNAME}-redis")["spec"]["ingress"][0]["from"][0]
    assert peer["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]}
    own = helm.render(sets=("redis.enabled=true", "redis.auth.existingSecret=my-redis",
                            "redis.auth.existingSecretPasswordKey=pw"))
    assert not by_kind(own, "Secret")
    (c,) = one(own, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}["REDIS_PASSWORD"] == {
        "name": "my-redis", "key": "pw"}
    spec = one(own, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert {"name": "redis-admin", "secret": {"secretName": "my-redis", "defaultMode": 0o440,
            "items": [{"key": "pw", "path": "password"}]}} in spec["volumes"]


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
    # the image the operator really runs (the control image), and its log level
    assert "image ghcr.io/tandem-llm/tandem-control:0.1.0\n  (log level INFO)" in notes_text
    assert f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0" in notes_text
    assert "watching all namespaces" in notes_text
    assert "kubectl apply -f charts/tandem/examples/" in notes_text


# ---------------------------------------------------------------------------------------------
# operator availability and the Kubernetes version


def test_leader_election_rbac_is_its_one_lease_in_its_own_namespace(helm: Helm) -> None:
    docs = helm.render()
    role = one(docs, "Role", LEADER_ROLE)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [f"{FULLNAME}-operator"], "verbs": ["get", "update"]}]
    binding = one(docs, "RoleBinding", LEADER_ROLE)
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"]["name"] == LEADER_ROLE
    sa = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"][
        "serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa,
                                    "namespace": NAMESPACE}]
    lease_name = next(a for a in operator_container(docs)["args"]
                      if a.startswith("--lease-name=")).split("=", 1)[1]
    assert role["rules"][1]["resourceNames"] == [lease_name]


def test_standbys_get_a_disruption_budget_and_spread_over_nodes(helm: Helm) -> None:
    docs = helm.render(sets=("operator.replicas=3",))
    dep = one(docs, "Deployment", f"{FULLNAME}-operator")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    pdb = one(docs, "PodDisruptionBudget", f"{FULLNAME}-operator")
    assert pdb["spec"]["minAvailable"] == 1
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector == dep["spec"]["selector"]["matchLabels"]
    assert all(pod_labels[k] == v for k, v in selector.items())
    (term,) = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == selector
    single = helm.render(sets=("operator.replicas=1",))
    assert not by_kind(single, "PodDisruptionBudget")
    assert "affinity" not in one(single, "Deployment", f"{FULLNAME}-operator")["spec"][
        "template"]["spec"]
    own = helm.render(sets=("affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuring"
                            "Execution.nodeSelectorTerms[0].matchExpressions[0].key=pool",))
    affinity = one(own, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"][
        "affinity"]
    assert list(affinity) == ["nodeAffinity"]  # the user's affinity replaces the default


def test_inconsistent_lease_timings_are_refused(helm: Helm) -> None:
    proc = helm.run(*helm.template_args(sets=("operator.leaderElection.renewDeadline=20",)),
                    check=False)
    assert proc.returncode != 0
    assert "leaseDuration > renewDeadline > 1.2 x retryPeriod" in proc.stderr


def test_kubernetes_1_29_is_refused(helm: Helm) -> None:
    """The children's preStop hooks use the sleep action: beta and on by default from
    Kubernetes 1.30 (alpha, off, in 1.29). The chart says so before installing anything."""
    args = helm.template_args()
    at = args.index("--kube-version") + 1
    args[at] = "1.29.9"
    proc = helm.run(*args, check=False)
    assert proc.returncode != 0
    assert "chart requires kubeVersion: >=1.30.0-0" in proc.stderr, proc.stderr
    args[at] = "1.30.0"
    assert helm.run(*args).returncode == 0
