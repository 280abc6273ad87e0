"""Multi-node tensor-parallel pools (tensor a multiple of the GPUs per pod): a LeaderWorkerSet
valid against the published LWS CRD (and its pod templates as core PodTemplateSpecs), one
group of tensor / GPUs-per-pod pods per replica; the leader runs the Ray head then `tandem
worker --distributed-executor-backend ray`, followers join it; only the leader is selected by
the pool's Service (so by the routers and the autoscaler's scrape); pod settings, hardening,
mounts on both templates; HPA, status, the autoscaler and apply know the kind."""

from __future__ import annotations

import copy
import shlex
from typing import Any

import pytest

from tandem.operator import reconcile
from tandem.operator.kube import KINDS
from tandem.operator.render import pool_selector, pools
from tandem.operator.render.multinode import LWS_NAME_LABEL, pod_templates
from tandem.operator.spec import SpecError, parse_spec
from tandem.operator.status import observed, rollout
from tandem.protocol.labels import ROLE_LABEL
from tests.operator.lws import lws_errors, validate
from tests.operator.manifests import OWNER, arg, by_kind, matches, one, render
from tests.operator.samples import SHA

GPU8 = {"limits": {"nvidia.com/gpu": 8, "memory": "1024Gi"}, "requests": {"cpu": "32"}}


def tp16(**decode: Any) -> dict[str, Any]:
    """P/D: prefill TP=16 over two 8-GPU pods (multi-node), decode TP=8 on one."""
    return {"model": {"uri": "pvc://models/llama-70b", "sha256": SHA, "dtype": "bfloat16"},
            "prefill": {"replicas": 2, "parallelism": {"tensor": 16},
                        "resources": copy.deepcopy(GPU8)},
            "decode": {"replicas": 1, "parallelism": {"tensor": 8},
                       "resources": copy.deepcopy(GPU8), **decode}}


def lws(docs: list[dict], name: str = "demo-prefill") -> dict:
    return one(docs, "LeaderWorkerSet", name)


def leader(doc: dict) -> dict:
    return doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]


def follower(doc: dict) -> dict:
    return doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]


def main(template: dict) -> dict:
    return template["spec"]["containers"][0]


def pod_labels(doc: dict, template: dict, index: int) -> dict[str, str]:
    """A pod's labels as the LWS controller makes them from `template`."""
    return {**template["metadata"]["labels"], LWS_NAME_LABEL: doc["metadata"]["name"],
            "leaderworkerset.sigs.k8s.io/worker-index": str(index)}


def test_the_multi_node_pool_is_a_valid_leader_worker_set_and_the_other_a_deployment():
    docs = render(tp16())
    for doc in docs:
        validate(doc)  # core kinds strictly; the LWS by its CRD and as PodTemplateSpecs
    assert [d["metadata"]["name"] for d in by_kind(docs, "LeaderWorkerSet")] == ["demo-prefill"]
    assert {d["metadata"]["name"] for d in by_kind(docs, "Deployment")} == {
        "demo-decode", "demo-router"}
    doc = lws(docs)
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    s = doc["spec"]
    assert s["replicas"] == 2  # groups
    lwt = s["leaderWorkerTemplate"]
    assert (lwt["size"], lwt["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert s["startupPolicy"] == "LeaderCreated"
    assert s["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    # GPU groups: one replaced at a time (a surge group would wait for free GPU nodes)
    assert s["rolloutStrategy"] == {"type": "RollingUpdate", "rollingUpdateConfiguration": {
        "maxSurge": 0, "maxUnavailable": 1}}
    for t in pod_templates(doc):
        assert main(t)["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_the_leader_starts_the_ray_head_waits_for_every_gpu_then_runs_the_worker():
    docs = render(tp16())
    c = main(leader(lws(docs)))
    assert c["command"] == ["/bin/sh", "-c"]
    (script,) = c["args"]
    lines = script.splitlines()
    assert lines[0] == "set -e"
    assert lines[1].startswith("ray start --head --port=6379 --num-gpus=8 ")
    wait = shlex.split(script[script.index("python -c"):script.index("\nexec ")])
    assert wait[:2] == ["python", "-c"]
    assert 'ray.init(address="auto"' in wait[2] and '.get("GPU", 0)) < 16:' in wait[2]
    compile(wait[2], "wait", "exec")  # the wait is valid Python
    worker = shlex.split(lines[-1])
    assert worker[:3] == ["exec", "tandem", "worker"]
    args = worker[2:]
    assert (arg(args, "--tensor-parallel-size"), arg(args, "--distributed-executor-backend"),
            arg(args, "--device"), arg(args, "--role")) == ("16", "ray", "cuda", "prefill")
    assert arg(args, "--model-sha256") == SHA
    # the same engine flags a one-node pool would get, but for the backend
    single = one(render({**tp16(), "prefill": {"replicas": 1, "parallelism": {"tensor": 8},
                                                "resources": GPU8}}), "Deployment", "demo-prefill")
    flat = list(single["spec"]["template"]["spec"]["containers"][0]["args"])
    for flag, value in (("--tensor-parallel-size", "16"),
                        ("--distributed-executor-backend", "ray")):
        flat[flat.index(flag) + 1] = value
    assert args == flat
    assert [p["name"] for p in c["ports"]] == ["http", "grpc"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"


def test_followers_only_join_the_leaders_ray_cluster():
    f = follower(lws(render(tp16())))
    c = main(f)
    assert c["command"] == ["ray"]
    assert c["args"][:3] == ["start", "--address=$(LWS_LEADER_ADDRESS):6379", "--block"]
    assert "--num-gpus=8" in c["args"]
    for key in ("ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle"):
        assert key not in c, key
    assert not any(k.startswith("prometheus.io/") for k in f["metadata"]["annotations"])
    assert ROLE_LABEL not in f["metadata"]["labels"]


def test_only_the_leader_is_selected_by_the_service_the_pdb_covers_the_group():
    docs = render(tp16())
    doc = lws(docs)
    lead, follow = pod_labels(doc, leader(doc), 0), pod_labels(doc, follower(doc), 1)
    svc = one(docs, "Service", "demo-prefill")
    assert matches(svc["spec"]["selector"], lead) and not matches(svc["spec"]["selector"], follow)
    assert svc["metadata"]["labels"][ROLE_LABEL] == "prefill"  # the routers' discovery
    pdb = one(docs, "PodDisruptionBudget", "demo-prefill")["spec"]["selector"]["matchLabels"]
    assert matches(pdb, lead) and matches(pdb, follow)
    prefill = pools(parse_spec(tp16()))[0]
    status_sel = dict(kv.split("=") for kv in pool_selector(OWNER, prefill).split(","))
    assert matches(status_sel, lead) and not matches(status_sel, follow)
    # no other pool's pods are selected by this pool's Service or PDB
    decode = one(docs, "Deployment", "demo-decode")["spec"]["template"]["metadata"]["labels"]
    assert not matches(svc["spec"]["selector"], decode) and not matches(pdb, decode)


def test_network_policies_admit_the_group_to_itself_on_every_port():
    docs = render(tp16())
    doc = lws(docs)
    pods = [pod_labels(doc, leader(doc), 0), pod_labels(doc, follower(doc), 1)]
    workers = one(docs, "NetworkPolicy", "demo-workers")["spec"]["podSelector"]["matchLabels"]
    assert all(matches(workers, p) for p in pods)
    group = one(docs, "NetworkPolicy", "demo-prefill-group")["spec"]
    assert all(matches(group["podSelector"]["matchLabels"], p) for p in pods)
    ((rule,),) = [group["ingress"]]
    assert "ports" not in rule  # Ray's and NCCL's ports are their own
    assert all(matches(rule["from"][0]["podSelector"]["matchLabels"], p) for p in pods)
    decode = one(docs, "Deployment", "demo-decode")["spec"]["template"]["metadata"]["labels"]
    assert not matches(group["podSelector"]["matchLabels"], decode)
    off = render({**tp16(), "security": {"networkPolicy": {"enabled": False}}})
    assert by_kind(off, "NetworkPolicy") == []


def test_pod_settings_hardening_and_mounts_reach_both_templates():
    raw = tp16()
    raw["model"] = {"uri": "hf://meta-llama/Llama-3.3-70B-Instruct@main",
                    "hfTokenSecretRef": {"name": "hf"}, "cache": {"pvc": "models"}}
    raw["prefill"] |= {
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "volumes": [{"name": "nccl", "configMap": {"name": "nccl"}}],
        "volumeMounts": [{"name": "nccl", "mountPath": "/etc/nccl"}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "imagePullSecrets": [{"name": "regcred"}], "runtimeClassName": "nvidia",
        "podLabels": {"team": "ml"},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "DoNotSchedule"}],
        "strategy": {"maxSurge": 0, "maxUnavailable": 1}}
    docs = render(raw, image_pull_policy="Always", image_pull_secrets=("global",))
    doc = lws(docs)
    validate(doc)
    assert doc["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 0, "maxUnavailable": 1}
    for t in pod_templates(doc):
        pod, c = t["spec"], main(t)
        assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"]
        assert {"name": "nccl", "mountPath": "/etc/nccl"} in c["volumeMounts"]
        assert pod["imagePullSecrets"] == [{"name": "global"}, {"name": "regcred"}]
        assert pod["runtimeClassName"] == "nvidia"
        assert t["metadata"]["labels"]["team"] == "ml"
        assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"][
            LWS_NAME_LABEL] == "demo-prefill"
        assert {c["imagePullPolicy"] for c in pod["containers"] + pod["initContainers"]} == {
            "Always"}
        assert [i["name"] for i in pod["initContainers"]] == ["fetch-model"]  # every node
        assert pod["securityContext"]["runAsNonRoot"] and not pod["automountServiceAccountToken"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/cache", "/dev/shm", "/etc/tandem/worker-auth"} <= mounts
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in (
            pod["volumes"])
    with pytest.raises(SpecError, match="prefill.env"):  # collisions: as on Deployments
        raw["prefill"]["env"] = [{"name": "POD_IP", "value": "x"}]
        render(raw)


@pytest.mark.parametrize(("strategy", "replicas", "words"), [
    ({"maxSurge": 0, "maxUnavailable": "25%"}, 2, "both come to 0 groups at 2 replicas"),
    ({"maxSurge": "150%", "maxUnavailable": 0}, 2, "maxSurge: 150% is above 100%"),
])
def test_rollouts_the_lws_webhook_refuses_are_spec_errors(strategy, replicas, words):
    raw = tp16()
    raw["prefill"] |= {"strategy": strategy, "replicas": replicas}
    with pytest.raises(SpecError, match=f"prefill.strategy.*{words}"):
        render(raw)
    raw["prefill"]["replicas"] = 4  # 25% of 4 is one group: accepted
    if "25%" in str(strategy):
        assert lws_errors(lws(render(raw))) == []


def test_an_autoscaled_pools_rollout_is_checked_at_its_fewest_replicas_when_parsed():
    """Percentages grow with the count, so the fewest replicas are the worst case: the
    operator's autoscaler's minReplicas, or for an HPA the webhook's default 1 (its LWS is
    created without a count, so the render could not catch it)."""
    raw = tp16()
    raw["prefill"] |= {"strategy": {"maxSurge": 0, "maxUnavailable": "50%"},
                       "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 4,
                                       "target": 8}}
    with pytest.raises(SpecError, match=r"prefill\.strategy: .*both come to 0 groups at 1 "
                                        r"replicas"):
        parse_spec(raw)
    raw["prefill"]["autoscaling"]["mode"] = "operator"
    raw["prefill"]["autoscaling"]["minReplicas"] = 1
    with pytest.raises(SpecError, match=r"both come to 0 groups at 1 replicas"):
        parse_spec(raw)
    raw["prefill"]["autoscaling"]["minReplicas"] = 2  # 50% of 2 and more: at least one group
    assert lws_errors(lws(render(raw))) == []
    raw["prefill"]["strategy"]["maxUnavailable"] = 1  # a whole number: any count
    raw["prefill"]["autoscaling"]["mode"] = "hpa"
    assert lws_errors(lws(render(raw))) == []


def test_the_lws_check_is_not_vacuous():
    doc = lws(render(tp16()))
    bad = copy.deepcopy(doc)
    bad["spec"]["leaderWorkerTemplate"]["sise"] = 2
    assert lws_errors(bad) == [".spec.leaderWorkerTemplate.sise"]
    bad = copy.deepcopy(doc)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert any("restartPolicy" in e for e in lws_errors(bad))
    bad = copy.deepcopy(doc)
    bad["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] = {"maxSurge": 0,
                                                                    "maxUnavailable": 0}
    assert lws_errors(bad) == ["maxUnavailable must not be 0 when `maxSurge` is 0"]
    bad = copy.deepcopy(doc)
    main(follower(bad))["readinesProbe"] = {}
    with pytest.raises(Exception, match="readinesProbe"):
        validate(bad)


def test_hpa_mode_leaves_the_groups_to_an_hpa_on_the_lws():
    raw = tp16()
    raw["prefill"]["autoscaling"] = {"mode": "hpa", "maxReplicas": 4, "target": 8}
    docs = render(raw)
    assert "replicas" not in lws(docs)["spec"]
    hpa = one(docs, "HorizontalPodAutoscaler", "demo-prefill")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                             "kind": "LeaderWorkerSet", "name": "demo-prefill"}
    for doc in docs:
        validate(doc)


# ---- the operator: kinds, status, the autoscaler, apply ----------------------------------

def test_the_client_knows_the_kind():
    k = KINDS["LeaderWorkerSet"]
    assert (k.group, k.version, k.plural) == ("leaderworkerset.x-k8s.io", "v1",
                                              "leaderworkersets")


def group_set(replicas: int, ready: int, generation: int = 1, observed_gen: int | None = 1,
              updated: int | None = None) -> dict[str, Any]:
    st = {"readyReplicas": ready, "replicas": replicas,
          "updatedReplicas": replicas if updated is None else updated}
    if observed_gen is not None:
        st["observedGeneration"] = observed_gen
    return {"kind": "LeaderWorkerSet", "metadata": {"name": "demo-prefill",
                                                     "generation": generation},
            "spec": {"replicas": replicas}, "status": st}


def test_status_counts_ready_groups():
    assert rollout(group_set(2, 2)) == (2, 2, True)
    assert rollout(group_set(2, 1)) == (2, 1, False)
    assert rollout(group_set(2, 2, generation=2)) == (2, 2, False)
    assert rollout(group_set(2, 2, observed_gen=None)) == (2, 2, True)  # LWS before v0.9
    assert rollout(group_set(2, 2, observed_gen=None, updated=1)) == (2, 2, False)
    spec = parse_spec(tp16())
    dep = {"kind": "Deployment", "metadata": {"generation": 1}, "spec": {"replicas": 1},
           "status": {"observedGeneration": 1, "readyReplicas": 1, "updatedReplicas": 1,
                      "replicas": 1}}
    live = {"demo-prefill": group_set(2, 1), "demo-decode": dep, "demo-router": dep}
    st = observed(spec, OWNER, {}, live, 1, "2026-01-01T00:00:00Z")
    assert (st["prefill"]["replicas"], st["prefill"]["readyReplicas"]) == (2, 1)
    ready = {c["type"]: c for c in st["conditions"]}["Ready"]
    assert ready["status"] == "False" and "demo-prefill: 1/2 ready" in ready["message"]


class FakeKube:
    def __init__(self, live: dict[str, list[dict]]) -> None:
        self.live, self.applied, self.patched, self.deleted = live, [], [], []

    def list_owned(self, kind: str, namespace: str, owner: str, uid: str) -> list[dict]:
        return [{k: v for k, v in o.items() if k != "kind"} for o in self.live.get(kind, [])]

    def apply(self, doc: dict, manager: str = "") -> dict:
        self.applied.append((manager, doc))
        return {"metadata": {"resourceVersion": "2"}}

    def create(self, doc: dict) -> bool:
        return True

    def patch(self, kind: str, namespace: str, name: str, body: dict, manager: str = "") -> dict:
        self.patched.append((kind, name, body, manager))
        return {}

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.deleted.append((kind, name))


class Metrics:
    def scrape(self, namespace: str, service: str) -> dict:
        assert service == "demo-prefill"  # the pool's Service: its leaders
        return {"demo-prefill-0": {"vllm:num_requests_waiting": 40.0},
                "demo-prefill-1": {"vllm:num_requests_waiting": 40.0}}


def test_the_autoscaler_scales_the_groups_of_the_lws():
    raw = tp16()
    raw["prefill"]["autoscaling"] = {"maxReplicas": 6, "target": 10}
    (pool,) = [p for p in pools(parse_spec(raw)) if p.name == "prefill"]
    kube = FakeKube({"LeaderWorkerSet": [group_set(2, 2)]})
    live = reconcile.workloads(kube, OWNER)  # type: ignore[arg-type]
    assert live["demo-prefill"]["kind"] == "LeaderWorkerSet"  # list items come without
    done = reconcile.scale_pool(kube, Metrics(), OWNER, pool, live["demo-prefill"],  # type: ignore[arg-type]
                                reconcile.PoolState(), now=100.0)
    assert done is not None and (done.current, done.desired) == (2, 6)
    assert kube.patched == [("LeaderWorkerSet", "demo-prefill", {"spec": {"replicas": 6}},
                             reconcile.AUTOSCALER)]


def test_apply_replaces_a_pools_deployment_with_its_lws_and_keeps_a_scaled_count():
    raw = tp16()
    raw["prefill"]["autoscaling"] = {"maxReplicas": 6, "target": 10}
    old = {"kind": "Deployment", "metadata": {"name": "demo-prefill", "resourceVersion": "1"},
           "spec": {"replicas": 3}}
    kube = FakeKube({"Deployment": [old]})
    done = reconcile.apply(kube, parse_spec(raw), OWNER, reconcile.OperatorConfig())  # type: ignore[arg-type]
    assert done.removed == ["Deployment/demo-prefill"]
    assert kube.deleted == [("Deployment", "demo-prefill")]
    (doc,) = [d for _, d in kube.applied if d["kind"] == "LeaderWorkerSet"]
    assert doc["spec"]["replicas"] == 3  # the autoscaler's live count, kept
    kinds = [d["kind"] for _, d in kube.applied]
    assert kinds.index("LeaderWorkerSet") < kinds.index("Service", kinds.index("LeaderWorkerSet"))


def test_handover_to_an_hpa_applies_the_lws_replicas_under_the_handover_manager():
    raw = tp16()
    raw["prefill"]["autoscaling"] = {"mode": "hpa", "maxReplicas": 6, "target": 10}
    live = group_set(3, 3)
    live["metadata"]["managedFields"] = [{
        "manager": "tandem-operator", "operation": "Apply",
        "fieldsV1": {"f:spec": {"f:replicas": {}}}}]
    kube = FakeKube({"LeaderWorkerSet": [live]})
    reconcile.apply(kube, parse_spec(raw), OWNER, reconcile.OperatorConfig())  # type: ignore[arg-type]
    manager, first = kube.applied[0]
    assert manager == reconcile.HANDOVER
    assert first == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                     "metadata": {"name": "demo-prefill", "namespace": "ml"},
                     "spec": {"replicas": 3}}
