"""Pure render functions: a parsed InferenceService spec -> the manifests (plain dicts) of
its children, each owned by the InferenceService. No I/O, no Kubernetes client."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.operator.render.common import DEFAULT_IMAGE, Owner, image_from_env, labels
from tandem.operator.render.gateway import Member, attached, gateway_children, label_group
from tandem.operator.render.keda import scaled_objects, scaling_workloads
from tandem.operator.render.monitoring import hpa, router_metrics_service, service_monitor
from tandem.operator.render.multinode import pod_templates
from tandem.operator.render.pod import apply_pod_settings
from tandem.operator.render.router import (
    front_door_name,
    render_router,
    router_endpoint,
    router_name,
)
from tandem.operator.render.security import OperatorPeer, certificates, network_policies
from tandem.operator.render.workers import (
    pool_config_hash,
    pool_image,
    pool_selector,
    render_workers,
)
from tandem.operator.render.workload import (
    Pool,
    Workload,
    pool_name,
    pool_workloads,
    pools,
)
from tandem.operator.spec import InferenceServiceSpec, check_name
from tandem.protocol.labels import ROUTER_COMPONENT

__all__ = ["DEFAULT_IMAGE", "OperatorPeer", "Owner", "Pool", "Workload", "image_from_env",
           "pool_config_hash", "pool_name", "pool_selector", "pool_workloads", "pools",
           "render_all", "router_endpoint", "router_name", "front_door_name"]


def render_all(spec: InferenceServiceSpec, owner: Owner, *, image: str | None = None,
               image_pull_policy: str | None = None,
               replicas: Mapping[str, int] | None = None,
               operator: OperatorPeer | None = None,
               image_pull_secrets: Sequence[str] = (),
               router_image: str | None = None, worker_image: str | None = None,
               worker_cuda_image: str | None = None,
               members: Sequence[tuple[str, InferenceServiceSpec]] = ()) -> list[dict[str, Any]]:
    """Every child manifest, in an order that can be applied front to back (RBAC and config
    before the pods that use them). `image` is the operator's default (spec.image wins; see
    `image_from_env`), `router_image` the routers' (the torch-free control image; default
    `image`; spec.image and router.image win over it), `worker_image` the CPU pools' and
    `worker_cuda_image` the GPU pools' (default `image`; spec.image and the pool's image win
    over them); `replicas` (pool name -> count)
    overrides the spec's, as an autoscaler decides; `operator` (its namespace and release)
    labels the routers and joins the workers' NetworkPolicy as a metrics scraper.
    NetworkPolicies and the gRPC Certificate come first: no pod runs before its policy
    exists. `image_pull_secrets` (the operator's) go to every pod, ahead of each pool's own;
    the pods' user settings (`render.pod`) are merged last. A multi-node tensor-parallel pool
    is a LeaderWorkerSet (`render.multinode`) where the others are Deployments: each pool's
    `Workload`, decided once here, is what every renderer reads. Pools in
    `autoscaling.mode: hpa` get a HorizontalPodAutoscaler, in `keda` a KEDA ScaledObject
    (`render.keda`, with the routers' metrics Service it reads /scaling through).
    `members` (name, spec): the InferenceServices attached to this one
    (`router.attachTo`), by name, whose tokenizers its router fetches too."""
    check_name(owner.name, spec)
    img = spec.image or image or DEFAULT_IMAGE
    cpu_img = spec.image or worker_image or img
    cuda_img = spec.image or worker_cuda_image or img
    workloads = pool_workloads(spec, owner)
    out = network_policies(spec, owner, operator, workloads,
                           [m for _, m in members]) + certificates(spec, owner)
    if not attached(spec):  # (attached: served by another InferenceService's router)
        group = [Member(name, m, pool_image(pools(m)[-1], m.image or worker_image or img,
                                            m.image or worker_cuda_image or img))
                 for name, m in sorted(members, key=lambda x: x[0])]
        out += render_router(spec, owner, spec.image or router_image or img, operator,
                             worker_image=pool_image(workloads[-1].pool, cpu_img, cuda_img),
                             members=group)
        out += gateway_children(spec, owner)  # mode gateway: InferencePool, HTTPRoute
    workers = render_workers(spec, owner, cpu_img, replicas, cuda_img, workloads)
    label_group(workers, spec, owner, workloads)
    out += workers
    # (kind, name) -> pod settings, their spec field, every pod the workload runs
    front = front_door_name(spec, owner)
    settings = {("Deployment", front): (spec.router.pod, "router",
                                        labels(owner, ROUTER_COMPONENT))} if front else {}
    settings |= {(w.kind, w.name): (w.pool.spec.pod, "prefill" if w.role == "prefill" else
                                    "decode", w.pod_selector) for w in workloads}
    running = [d for d in out if (d["kind"], d["metadata"]["name"]) in settings]
    for doc in running:
        pod, where, selector = settings[doc["kind"], doc["metadata"]["name"]]
        apply_pod_settings(doc, pod, where, selector, image_pull_secrets)
    if image_pull_policy:
        for doc in running:
            for template in pod_templates(doc):
                pod = template["spec"]
                for c in pod["containers"] + pod.get("initContainers", []):
                    c["imagePullPolicy"] = image_pull_policy
    for w in workloads:
        auto = w.pool.spec.autoscaling
        if auto is not None and auto.mode == "hpa":
            out.append(hpa(owner, w, auto))
    out += scaled_objects(spec, owner, workloads)  # autoscaling.mode: keda
    # KEDA and the operator's autoscaler (on demand) read /scaling through it; members'
    # pools read this router's
    readers = any(scaling_workloads(pool_workloads(m, Owner(n, owner.namespace, "")))
                  for n, m in members)
    if front and (spec.service_monitor or scaling_workloads(workloads) or readers):
        out.append(router_metrics_service(owner))
    if spec.service_monitor:
        out.append(service_monitor(spec, owner))
    return out
