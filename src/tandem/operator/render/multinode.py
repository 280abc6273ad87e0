"""Multi-node tensor-parallel pools (`parallelism.tensor` above the GPUs per pod): a
LeaderWorkerSet (`leaderworkerset.x-k8s.io/v1`, as llm-d and vLLM deploy multi-node serving)
in place of the pool's Deployment, one group per replica.

* `leaderWorkerTemplate.size`: the group's pods (tensor / GPUs per pod); `restartPolicy:
  RecreateGroupOnPodRestart` (a lost rank is a lost worker); `startupPolicy: LeaderCreated`
  (the leader becomes ready only once its followers have joined).
* Leader: the worker's pod template, its container a shell that starts the Ray head
  (`ray start --head --port=6379`), waits until the Ray cluster holds `tensor` GPUs, then
  execs `tandem worker ... --distributed-executor-backend ray`. It alone carries the pool's
  role label, ports and probes: the pool's Service, the routers' discovery, the autoscaler's
  scrape and `status.selector` see one endpoint per group.
* Followers: the same pod (mounts, init containers, security contexts, resources, pod
  settings) whose container only joins the leader's cluster (`ray start
  --address=$(LWS_LEADER_ADDRESS):6379 --block`); no ports, no probes, no role label.
* `networkConfig.subdomainPolicy: UniquePerReplica`: the LWS controller's headless Service per
  group (NAME-POOL-GROUP, not-ready addresses published) resolves LWS_LEADER_ADDRESS before the
  leader is ready, and the pool's own Service NAME-POOL stays the operator's (the Shared
  policy would claim that name).
* The pool's PodDisruptionBudget covers every pod of its groups (`Workload.pod_selector`).

The pool is a LeaderWorkerSet when its `render.workload.Workload` says so (decided there).
"""

from __future__ import annotations

import copy
import shlex
from typing import Any

from tandem.operator.render.common import CONFIG_HASH, Owner, all_labels, metadata
from tandem.operator.render.workload import (
    LWS_API_VERSION,
    LWS_KIND,
    LWS_NAME_LABEL,
    Workload,
    group_selector,
)
from tandem.operator.spec_parallel import Layout
from tandem.protocol.labels import WORKER_COMPONENT

__all__ = ["LWS_API_VERSION", "LWS_KIND", "LWS_NAME_LABEL", "follower_args", "group_selector",
           "leader_script", "leader_worker_set", "pod_templates"]
RAY_PORT = 6379
RAY_WAIT_SECONDS = 5
_DROPPED = ("ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle")


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a rendered workload: a Deployment's one, an LWS's two."""
    if doc["kind"] == LWS_KIND:
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [doc["spec"]["template"]]


def _wait_for_gpus(tensor: int) -> str:
    """Python that returns once the Ray cluster has `tensor` GPUs (the followers joined)."""
    return "\n".join([
        "import time, ray",
        'ray.init(address="auto", logging_level="ERROR")',
        f'while (n := ray.cluster_resources().get("GPU", 0)) < {tensor}:',
        f'    print(f"waiting for the Ray cluster: {{n:g}} of {tensor} GPUs", flush=True)',
        f"    time.sleep({RAY_WAIT_SECONDS})"])


def leader_script(worker: list[str], layout: Layout) -> str:
    """The leader container's `sh -c` script: Ray head, wait for every rank's GPU, the
    worker (`worker`: its command and arguments, each quoted for the shell; Kubernetes
    expands `$(VAR)` references before the shell runs)."""
    return "\n".join([
        "set -e",
        f"ray start --head --port={RAY_PORT} --num-gpus={layout.gpus_per_pod} "
        "--disable-usage-stats --include-dashboard=false",
        f"python -c {shlex.quote(_wait_for_gpus(layout.tensor))}",
        "export RAY_ADDRESS=auto",  # the worker's Ray executor joins this cluster
        "exec " + " ".join(shlex.quote(a) for a in worker)])


def follower_args(layout: Layout) -> list[str]:
    return ["start", f"--address=$(LWS_LEADER_ADDRESS):{RAY_PORT}", "--block",
            f"--num-gpus={layout.gpus_per_pod}", "--disable-usage-stats"]


def _leader(template: dict[str, Any], layout: Layout) -> dict[str, Any]:
    out = copy.deepcopy(template)
    main = out["spec"]["containers"][0]
    main["args"] = [leader_script(main["command"] + main["args"], layout)]
    main["command"] = ["/bin/sh", "-c"]
    return out


def _follower(owner: Owner, template: dict[str, Any], layout: Layout) -> dict[str, Any]:
    pod = copy.deepcopy(template["spec"])
    main = pod["containers"][0]
    for key in _DROPPED:
        main.pop(key, None)
    main |= {"command": ["ray"], "args": follower_args(layout)}
    annotations = {k: v for k, v in template["metadata"]["annotations"].items()
                   if not k.startswith("prometheus.io/")}  # no /metrics: the leader reports
    return {"metadata": {"labels": all_labels(owner, WORKER_COMPONENT),
                         "annotations": annotations}, "spec": pod}


def leader_worker_set(owner: Owner, workload: Workload, template: dict[str, Any],
                      replicas: int | None) -> dict[str, Any]:
    """The pool's LeaderWorkerSet from its worker pod `template` (the Deployment's);
    `replicas` (groups) None leaves the count to an HPA."""
    assert workload.kind == LWS_KIND
    assert CONFIG_HASH in template["metadata"]["annotations"]
    layout = workload.layout
    spec: dict[str, Any] = {
        "leaderWorkerTemplate": {
            "size": workload.group_size, "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": _leader(template, layout),
            "workerTemplate": _follower(owner, template, layout)},
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
            "maxSurge": 1, "maxUnavailable": 0}},
        "networkConfig": {"subdomainPolicy": "UniquePerReplica"}}
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return {"apiVersion": workload.api_version, "kind": workload.kind,
            "metadata": metadata(owner, workload.name, WORKER_COMPONENT, workload.role),
            "spec": spec}
