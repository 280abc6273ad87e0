"""What the kopf handlers do, without kopf: apply an InferenceService's rendered children and
delete the ones it no longer renders, read their workloads (Deployments, and the
LeaderWorkerSets of multi-node pools) for status, and run one autoscaler tick for a pool.
API errors propagate (`kube.KubeError`); handlers decide."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.operator import autoscale
from tandem.operator.admission import AdmissionPolicy, admit
from tandem.operator.kube import FIELD_MANAGER, KINDS, WORKLOADS, Kube, applies_field
from tandem.operator.metrics import (
    MetricsSource,
    ScalingError,
    ScalingSource,
    combine,
    counters,
    per_replica,
)
from tandem.operator.redis_acl import RedisAcl, url_secret
from tandem.operator.render import (
    DEFAULT_IMAGE,
    OperatorPeer,
    Owner,
    Pool,
    Workload,
    pool_workloads,
    pools,
    render_all,
)
from tandem.operator.render.security import worker_auth_secret
from tandem.operator.spec import InferenceServiceSpec, SpecError, signal_for
from tandem.operator.spec_autoscaling import DEMAND

logger = logging.getLogger(__name__)
AUTOSCALER = "tandem-autoscaler"  # the field manager of the replicas the autoscaler sets
HANDOVER = "tandem-handover"  # holds a pool's replicas while an HPA takes them over


@dataclass
class OperatorConfig:
    """What `tandem operator` passes its handlers (through kopf's memo)."""

    image: str = DEFAULT_IMAGE  # the children's default image (TANDEM_IMAGE)
    image_pull_policy: str | None = None  # TANDEM_IMAGE_PULL_POLICY
    router_image: str | None = None  # the routers' (TANDEM_ROUTER_IMAGE); None: `image`
    worker_image: str | None = None  # CPU pools' (TANDEM_WORKER_IMAGE); None: `image`
    worker_cuda_image: str | None = None  # GPU pools' (TANDEM_WORKER_CUDA_IMAGE); None: `image`
    image_pull_secrets: tuple[str, ...] = ()  # every child pod's (TANDEM_IMAGE_PULL_SECRETS)
    status_interval_s: float = 10.0
    resync_interval_s: float = 300.0  # full re-apply: children deleted or edited by hand
    autoscale_interval_s: float = 15.0
    backoff_s: float = 5.0  # the first retry after an API failure; doubles up to 300 s
    metrics: MetricsSource | None = None  # None: HttpMetricsSource on the operator's client
    scaling: ScalingSource | None = None  # the routers' /scaling; None: HttpScalingSource
    operator: OperatorPeer | None = None  # TANDEM_OPERATOR_NAMESPACE / TANDEM_OPERATOR_RELEASE
    fence: Callable[[], None] | None = None  # leader election: raises unless still leading
    # the chart's Redis (TANDEM_REDIS_ADDRESS + admin password file): `router.managedRedis`
    redis: RedisAcl | None = None
    admission: AdmissionPolicy = AdmissionPolicy()  # the chart's `security` values


@dataclass
class PoolState:
    """The autoscaler's memory of one pool (lost on restart: then the window starts anew)."""

    history: autoscale.History = ()
    previous: dict[str, tuple[float, float]] = field(default_factory=dict)


def owner_of(body: Mapping[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(meta["name"], meta["namespace"], meta["uid"])


def operator_scaled(spec: InferenceServiceSpec) -> list[Pool]:
    return [p for p in pools(spec)
            if p.spec.autoscaling is not None and p.spec.autoscaling.mode == "operator"]


def by_name(owned: Mapping[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The workloads among `owned` (kind -> objects as listed) by name, each with its `kind`
    (list items come without)."""
    return {o["metadata"]["name"]: {**o, "kind": kind}
            for kind in WORKLOADS for o in owned.get(kind, [])}


def workloads(kube: Kube, owner: Owner) -> dict[str, dict[str, Any]]:
    """What runs the InferenceService's pools and router by name: Deployments and the
    LeaderWorkerSets of multi-node pools, each with its `kind`."""
    return by_name({k: kube.list_owned(k, owner.namespace, owner.name, owner.uid)
                    for k in WORKLOADS})


@dataclass
class Applied:
    """One apply's effect on the children, each named `Kind/name`."""

    before: dict[str, str]  # the owned children before it -> their resourceVersion
    after: dict[str, str]  # the rendered children after it -> their resourceVersion
    removed: list[str]  # owned children no longer rendered, deleted

    @property
    def changed(self) -> list[str]:
        """Rendered children the apply created or wrote (same content: same version)."""
        return [k for k, rv in self.after.items() if self.before.get(k) != rv]


def manifests(spec: InferenceServiceSpec, owner: Owner, config: OperatorConfig,
              replicas: Mapping[str, int] | None = None,
              members: Sequence[tuple[str, InferenceServiceSpec]] = ()) -> list[dict[str, Any]]:
    """Every child `apply` writes, in apply order: the one list both the operator and
    `tandem render` (`dryrun`) use. `replicas`: the live counts of operator-scaled pools;
    `members`: the InferenceServices attached to this one's router."""
    return render_all(spec, owner, image=config.image, router_image=config.router_image,
                      worker_image=config.worker_image,
                      worker_cuda_image=config.worker_cuda_image,
                      image_pull_policy=config.image_pull_policy, replicas=replicas,
                      operator=config.operator, image_pull_secrets=config.image_pull_secrets,
                      members=members)


def ensure_worker_auth(kube: Kube, spec: InferenceServiceSpec, owner: Owner) -> bool:
    """Create `<isvc>-worker-auth` (a fresh random key, owned by the InferenceService, so the
    garbage collector removes it with it) unless it exists, which is then left untouched and
    unread: a key rotated by hand stays. Nothing with `security.workerAuthSecretName` set.
    True when this call created it."""
    if spec.security.worker_auth_secret_name:
        return False
    created = kube.create(worker_auth_secret(owner))
    if created:
        logger.info("%s/%s: created Secret %s-worker-auth", owner.namespace, owner.name,
                    owner.name)
    return created


def check_environment(spec: InferenceServiceSpec, owner: Owner, config: OperatorConfig) -> None:
    """What the spec asks of this operator's installation: `SpecError` when it lacks it or
    its admin does not allow it (`admission`). The change handler's (`main.apply`), before
    `apply`; `tandem render`'s too (`dryrun.admit`)."""
    admit(spec, owner.namespace, config.admission)
    if spec.router.managed_redis and config.redis is None:
        raise SpecError("router.managedRedis: this operator has no Redis (install the chart "
                        "with redis.enabled=true), or name your own in "
                        "router.redisUrlSecretRef")


def ensure_redis_user(kube: Kube, spec: InferenceServiceSpec, owner: Owner,
                      config: OperatorConfig) -> None:
    """`router.managedRedis`: the URL Secret `<isvc>-redis` (created once, owned by the
    InferenceService) and its ACL user, set again on every call (a restarted Redis forgets
    it). `redis_acl.RedisAclError` when Redis refuses."""
    if not spec.router.managed_redis or config.redis is None:
        return
    if kube.create(url_secret(config.redis.redis, owner)):
        logger.info("%s/%s: created Secret %s-redis", owner.namespace, owner.name, owner.name)
    config.redis.ensure_user(owner)


def apply(kube: Kube, spec: InferenceServiceSpec, owner: Owner, config: OperatorConfig,
          members: Sequence[tuple[str, InferenceServiceSpec]] = ()) -> Applied:
    """Apply every child (server-side apply), then delete owned children the spec no longer
    renders (e.g. the prefill pool when prefill.replicas drops to 0, or the Deployment of a
    pool that became multi-node). One list per kind,
    before the writes, gives both: the live workloads, from which a pool the autoscaler
    drives keeps its replica count (and a pool newly under an HPA hands its count over),
    and the versions `Applied` compares."""
    owned = {kind: kube.list_owned(kind, owner.namespace, owner.name, owner.uid)
             for kind in KINDS}
    live = by_name(owned)
    before = {f"{kind}/{obj['metadata']['name']}": obj["metadata"].get("resourceVersion", "")
              for kind, objs in owned.items() for obj in objs}
    scaled = {p.name for p in operator_scaled(spec)}
    keep = {w.pool.name: live[w.name]["spec"]["replicas"] for w in pool_workloads(spec, owner)
            if w.pool.name in scaled and "replicas" in (live.get(w.name) or {}).get("spec", {})}
    docs = manifests(spec, owner, config, keep, members)
    ensure_worker_auth(kube, spec, owner)  # before the pods that mount it
    ensure_redis_user(kube, spec, owner, config)
    hand_over_replicas(kube, spec, owner, live)
    after = {}
    for doc in docs:
        out = kube.apply(doc)
        after[f"{doc['kind']}/{doc['metadata']['name']}"] = (
            out.get("metadata", {}).get("resourceVersion", ""))
    removed = [key for key in before if key not in after]
    for key in removed:
        kind, name = key.split("/", 1)
        kube.delete(kind, owner.namespace, name)
    if removed:
        logger.info("%s/%s: removed %s", owner.namespace, owner.name, ", ".join(removed))
    return Applied(before, after, removed)


def hand_over_replicas(kube: Kube, spec: InferenceServiceSpec, owner: Owner,
                       live: Mapping[str, Mapping[str, Any]]) -> None:
    """Before a pool's first apply under an HPA (which renders no replicas; KEDA's
    ScaledObject drives one too, `autoscaling.mode: keda`): where this
    operator's apply still owns the live Deployment's replicas, apply that count under
    `HANDOVER` first. Dropping a field its only applier owned would reset the pool to one
    replica; with a second owner the count stays until the HPA's first scale takes it
    (Kubernetes' documented server-side-apply ownership transfer)."""
    for w in pool_workloads(spec, owner):
        auto = w.pool.spec.autoscaling
        dep = live.get(w.name)
        if auto is None or auto.mode not in ("hpa", "keda") or dep is None:
            continue
        replicas = dep.get("spec", {}).get("replicas")
        if replicas is None or not applies_field(dep, FIELD_MANAGER, "spec", "replicas"):
            continue
        if dep.get("kind", "Deployment") != w.kind:
            continue  # the pool changes kind: its new workload starts under the HPA
        kube.apply({"apiVersion": w.api_version, "kind": w.kind,
                    "metadata": {"name": w.name, "namespace": owner.namespace},
                    "spec": {"replicas": replicas}}, manager=HANDOVER)
        logger.info("%s/%s: %s keeps %d replicas while its HPA takes over", owner.namespace,
                    owner.name, w.name, replicas)


@dataclass(frozen=True)
class Scaled:
    pool: Pool
    current: int
    desired: int
    value: float


def scale_pool(kube: Kube, source: MetricsSource, owner: Owner, pool: Pool,
               dep: Mapping[str, Any] | None, state: PoolState,
               now: float | None = None, scaling: ScalingSource | None = None,
               urls: Sequence[str] = ()) -> Scaled | None:
    """One autoscaler tick for one pool: read the signal, decide, and patch the workload's
    replicas (nothing else: a Deployment's pods, a LeaderWorkerSet's groups, whose leaders
    report) when the decision differs from what runs. None: no change. `dep` is the live
    workload named by the pool's `Workload` (`workloads`), patched as the kind it is.
    `signal: demand` reads the router's answers at `urls` (`render.keda.scaling_urls`: one
    per served name) from `scaling` instead of the workers, `combine`d: their demand per
    running replica (all of it at zero,
    which wakes the pool), 0 only when nothing is queued, running or waiting, so a pool
    reaches zero once idle for the whole stabilization window; a failed read changes
    nothing (logged) and counts as a recommendation of what runs, so a scale-down (to zero
    too) needs a whole window of readings after it."""
    auto = pool.spec.autoscaling
    if auto is None or dep is None:
        return None
    now = time.time() if now is None else now
    name = Workload.of(owner, pool).name
    current = int(dep["spec"].get("replicas", 1))
    if auto.signal == DEMAND:
        value = router_demand(scaling, urls, name, current)
    else:
        signal = signal_for(auto.signal, pool.role)
        samples = source.scrape(owner.namespace, name)
        value = per_replica(signal, samples, current, now, state.previous)
        state.previous = counters(signal, samples, now)
    if not state.history:  # after a (re)start, the window begins at what runs
        state.history = ((now, current),)
    window = auto.scale_down_stabilization_seconds
    if value is None:  # no data counts as what runs: a scale-down needs a whole window of
        state.history = autoscale.remember(state.history, now, current, window)  # readings
        return None
    desired = autoscale.desired_replicas(current, auto.min_replicas, auto.max_replicas, value,
                                         auto.target, state.history, window, now)
    rec = autoscale.recommend(current, value, auto.target, auto.min_replicas,
                              auto.max_replicas)
    state.history = autoscale.remember(state.history, now, rec, window)
    if desired == current:
        return None
    kube.patch(dep.get("kind", "Deployment"), owner.namespace, name,
               {"spec": {"replicas": desired}}, manager=AUTOSCALER)
    logger.info("%s: %d -> %d replicas (%s %.3g per replica, target %g)", name, current,
                desired, auto.signal, value, auto.target)
    return Scaled(pool, current, desired, value)


def router_demand(scaling: ScalingSource | None, urls: Sequence[str], name: str,
                  current: int) -> float | None:
    """The router's demand for the pool per running replica (the whole demand at zero), its
    answers for each served name `combine`d (each name's queue apart, the same workers);
    None when one cannot be read."""
    if scaling is None or not urls:
        logger.warning("%s: signal demand without a /scaling source", name)
        return None
    try:
        answer = combine([scaling.read(url) for url in urls])
    except ScalingError as exc:
        logger.warning("%s: no autoscaling decision, the router's /scaling unread: %s", name,
                       exc)
        return None
    return answer.demand / max(current, 1)
