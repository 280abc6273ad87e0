"""What runs each worker pool, decided once: a `Workload` per pool (`pool_workloads`), a
Deployment or, for a multi-node tensor-parallel pool (`Layout.multinode`), a LeaderWorkerSet
of `group_size`-pod groups. The renderers (workers, multinode, security, monitoring, pod
settings) and reconcile's hand-over and scale paths read its kind, names and selectors
instead of deciding again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.render.common import Owner, labels
from tandem.operator.spec import InferenceServiceSpec, PoolSpec
from tandem.operator.spec_parallel import Layout
from tandem.protocol.labels import COMPONENT_LABEL, SERVICE_LABEL, WORKER_COMPONENT

DEPLOYMENT_KIND = "Deployment"
DEPLOYMENT_API_VERSION = "apps/v1"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # set by LWS on every pod of the set
KIND_API = {DEPLOYMENT_KIND: DEPLOYMENT_API_VERSION, LWS_KIND: LWS_API_VERSION}


@dataclass(frozen=True)
class Pool:
    name: str  # "prefill" | "decode" | "worker"
    role: str  # "prefill" | "decode" | "both"
    spec: PoolSpec


def pools(spec: InferenceServiceSpec) -> list[Pool]:
    return [Pool(*p) for p in spec.worker_pools()]


def pool_name(owner: Owner, pool: Pool) -> str:
    return f"{owner.name}-{pool.name}"


def group_selector(owner_name: str, name: str) -> dict[str, str]:
    """Every pod of LeaderWorkerSet `name`'s groups, leaders and followers."""
    return {SERVICE_LABEL: owner_name, COMPONENT_LABEL: WORKER_COMPONENT, LWS_NAME_LABEL: name}


@dataclass(frozen=True)
class Workload:
    """The workload that runs one pool (`Workload.of`).

    `name` (NAME-POOL) names it, the pool's Service, PodDisruptionBudget and HPA.
    `selector`: the pool's serving pods (role label; a LeaderWorkerSet's leaders only), what
    its Service, a Deployment's `spec.selector` and the scale subresource's `status.selector`
    select. `pod_selector`: every pod it runs (a LeaderWorkerSet's followers too), what its
    PodDisruptionBudget and its default topology spread select. `group_size`: pods per
    replica (1 for a Deployment)."""

    pool: Pool
    name: str
    kind: str  # DEPLOYMENT_KIND | LWS_KIND
    selector: Mapping[str, str]
    pod_selector: Mapping[str, str]
    group_size: int
    layout: Layout

    @classmethod
    def of(cls, owner: Owner, pool: Pool) -> Workload:
        name, layout = pool_name(owner, pool), pool.spec.layout
        selector = labels(owner, WORKER_COMPONENT, pool.role)
        if layout.multinode:
            return cls(pool, name, LWS_KIND, selector, group_selector(owner.name, name),
                       layout.nodes, layout)
        return cls(pool, name, DEPLOYMENT_KIND, selector, dict(selector), 1, layout)

    @property
    def role(self) -> str:
        return self.pool.role

    @property
    def multinode(self) -> bool:
        return self.kind == LWS_KIND

    @property
    def api_version(self) -> str:
        return KIND_API[self.kind]

    @property
    def target(self) -> dict[str, Any]:
        """The reference to it (an HPA's `scaleTargetRef`)."""
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name}

    @property
    def selector_string(self) -> str:
        """`selector` as a string (the scale subresource's `status.selector`)."""
        return ",".join(f"{k}={v}" for k, v in self.selector.items())


def pool_workloads(spec: InferenceServiceSpec, owner: Owner) -> list[Workload]:
    """One `Workload` per pool, in `pools` order."""
    return [Workload.of(owner, p) for p in pools(spec)]
