"""The kopf handlers of `tandem operator`, thin: the work is in `reconcile`, `status` and
`autoscale`. `registry(config)` registers them (timer intervals come from the config).

* login / startup: one set of credentials (in-cluster, else $KUBECONFIG) for kopf and for
  the `kubernetes` client that applies the children.
* create / resume / update of an InferenceService: parse (`SpecError` → `PermanentError` and
  an `InvalidSpec` condition), apply the children, delete those no longer rendered, write
  status; an API failure → `TemporaryError` with exponential backoff (`ApplyFailed`).
* status timer: replicas and conditions from the workloads (Deployments; LeaderWorkerSets of
  multi-node pools); re-applies a missing one.
* resync timer: applies every child again, so one deleted or edited by hand (a Service, a
  ConfigMap, a Deployment's image...) is back to its rendered form within the interval; a
  `Repaired` Warning Event names each child it had to write. Unchanged children cost one
  no-op apply each (the API server keeps them as they are).
* autoscale timer: pools with `autoscaling.mode: operator` (the workers' metrics, or the
  router's `/scaling` on `signal: demand`, → `autoscale`); pools in
  `hpa` or `keda` mode are their HorizontalPodAutoscaler's (KEDA's), never touched here.

Deletion needs no handler for the children: every child carries a controller owner reference,
so the garbage collector removes them with the InferenceService (kopf's finalizer, there for
the timers, is lifted once they stop). With the chart's Redis, a delete handler removes the
InferenceService's Redis ACL user (`redis_acl`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kopf
from kubernetes.client import ApiClient

from tandem.operator import kube, reconcile
from tandem.operator.metrics import HttpMetricsSource, HttpScalingSource
from tandem.operator.redis_acl import RedisAclError
from tandem.operator.render import Owner, front_door_name, pool_name, pools
from tandem.operator.render.common import API_VERSION
from tandem.operator.render.keda import scaling_urls
from tandem.operator.spec import InferenceServiceSpec, SpecError, check_name, parse_spec
from tandem.operator.status import STATUS_KEY, failed, merge_patch, now_iso, observed

GROUP, VERSION = API_VERSION.split("/")
RESOURCE = (GROUP, VERSION, kube.PLURAL)
log = logging.getLogger(__name__)
REDIS_DELETE_RETRIES = 5


def login(**_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(**kube.connection(kube.load_config()))


def startup(memo: kopf.Memo, **_: Any) -> None:
    memo.kube = kube.Kube(ApiClient(kube.load_config()), fence=memo.config.fence)
    memo.metrics = memo.config.metrics or HttpMetricsSource(memo.kube.api_client)
    memo.scaling = memo.config.scaling or HttpScalingSource()


def _spec(body: kopf.Body) -> InferenceServiceSpec:
    check_name(body["metadata"]["name"])
    spec = parse_spec(dict(body.get("spec") or {}))
    check_name(body["metadata"]["name"], spec)  # a multi-node pool's LeaderWorkerSet name
    return spec


def _admitted(body: kopf.Body, memo: kopf.Memo) -> InferenceServiceSpec:
    """The spec, parsed and checked against this operator's installation and admin policy
    (`reconcile.check_environment`); `SpecError` otherwise."""
    spec = _spec(body)
    reconcile.check_environment(spec, reconcile.owner_of(body), memo.config)
    return spec


def attached_to(body: kopf.Body, **_: Any) -> dict[tuple[str, str], tuple[str, dict]] | None:
    """kopf index `members`: (namespace, router.attachTo) -> (name, spec) of every
    InferenceService attached to another's router."""
    spec = body.get("spec")
    to = (spec.get("router") or {}).get("attachTo") if isinstance(spec, dict) else None
    if not isinstance(to, str):
        return None
    return {(body["metadata"]["namespace"], to): (body["metadata"]["name"], dict(spec))}


def routed_by(body: kopf.Body, **_: Any) -> dict[tuple[str, str], str]:
    """kopf index `services`: (namespace, name) -> its router.attachTo ("" for none) of
    every InferenceService."""
    spec = body.get("spec")
    to = (spec.get("router") or {}).get("attachTo") if isinstance(spec, dict) else None
    return {(body["metadata"]["namespace"], body["metadata"]["name"]):
            to if isinstance(to, str) else ""}


def router_problem(spec: InferenceServiceSpec, owner: Owner, services: Any) -> str | None:
    """Why nothing routes to an attached InferenceService (None: its router exists, or it
    is not attached): its router.attachTo names no InferenceService, or one that is itself
    attached (a chain is not followed)."""
    to = spec.router.attach_to
    if to is None or services is None:
        return None
    found = list(services.get((owner.namespace, to), []))
    if not found:
        return (f"router.attachTo {to}: no InferenceService {to} in {owner.namespace}; "
                "nothing routes to this one")
    if found[0]:
        return (f"router.attachTo {to}: {to} is itself attached to {found[0]} (attach to "
                f"{found[0]}); nothing routes to this one")
    return None


def _members(index: Any, owner: Owner) -> list[tuple[str, InferenceServiceSpec]]:
    """The valid InferenceServices attached to `owner` (an invalid one's own handler says
    why), whose tokenizers its router fetches; a new one reaches it on the next re-apply
    (the resync timer)."""
    out = []
    for name, raw in (index or {}).get((owner.namespace, owner.name), []):
        try:
            out.append((name, parse_spec(raw)))
        except SpecError:
            continue
    return out


def apply(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int,
          members: Any = None, services: Any = None, **_: Any) -> None:
    owner, now = reconcile.owner_of(body), now_iso()
    generation, status = body["metadata"].get("generation", 0), dict(body.get("status") or {})
    try:
        spec = _admitted(body, memo)
    except SpecError as exc:
        patch.status.update(merge_patch(status, failed(status, generation, "InvalidSpec",
                                                       str(exc), now)))
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(exc))
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    try:
        with _writer(memo, owner, generation, newest=True):
            removed = reconcile.apply(memo.kube, spec, owner, memo.config,
                                      _members(members, owner)).removed
        live = reconcile.workloads(memo.kube, owner)
    except (*kube.KubeError, RedisAclError) as exc:
        reason = kube.describe(exc)
        patch.status.update(merge_patch(status, failed(status, generation, "ApplyFailed",
                                                       reason, now)))
        delay = min(memo.config.backoff_s * 2**retry, 300.0)
        raise kopf.TemporaryError(f"apply failed: {reason}", delay=delay) from exc
    new = observed(spec, owner, status, live, generation, now,
                   router_problem(spec, owner, services))
    patch.status.update(merge_patch(status, new | {"observedGeneration": generation}))
    if removed:
        kopf.event(body, type="Normal", reason="Removed",
                   message=f"no longer rendered: {', '.join(removed)}")


def refresh(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, members: Any = None,
            services: Any = None, **_: Any) -> None:
    """Status from the workloads; one deleted by hand is applied again."""
    owner, generation = reconcile.owner_of(body), body["metadata"].get("generation", 0)
    status = dict(body.get("status") or {})
    if status.get("observedGeneration") != generation:
        return  # the change handler has not finished with this generation (or failed)
    try:
        spec = _admitted(body, memo)
        live = reconcile.workloads(memo.kube, owner)
        front = front_door_name(spec, owner)  # NAME-router, NAME-epp; none when attached
        names = [pool_name(owner, p) for p in pools(spec)] + ([front] if front else [])
        if missing := [n for n in names if n not in live]:
            log.warning("%s/%s: re-applying, missing %s", owner.namespace, owner.name, missing)
            _reapply(memo, spec, owner, generation, _members(members, owner))
            live = reconcile.workloads(memo.kube, owner)
    except SpecError:
        return
    except (*kube.KubeError, RedisAclError) as exc:
        log.warning("%s/%s: status not refreshed: %s", owner.namespace, owner.name,
                    kube.describe(exc))
        return
    patch.status.update(merge_patch(status, observed(
        spec, owner, status, live, generation, now_iso(), router_problem(spec, owner, services))))


def resync(body: kopf.Body, memo: kopf.Memo, members: Any = None, **_: Any) -> None:
    """Apply the current generation's children again; report what that had to write."""
    owner, generation = reconcile.owner_of(body), body["metadata"].get("generation", 0)
    if (body.get("status") or {}).get("observedGeneration") != generation:
        return  # the change handler owns this generation until it has applied it
    try:
        done = _reapply(memo, _admitted(body, memo), owner, generation,
                        _members(members, owner))
    except SpecError:
        return
    except (*kube.KubeError, RedisAclError) as exc:
        log.warning("%s/%s: resync failed: %s", owner.namespace, owner.name,
                    kube.describe(exc))
        return
    if done is not None and (repaired := done.changed + done.removed):
        log.warning("%s/%s: drift repaired: %s", owner.namespace, owner.name,
                    ", ".join(repaired))
        kopf.event(body, type="Warning", reason="Repaired",
                   message=f"re-applied after a change outside the spec: {', '.join(repaired)}")


def _reapply(memo: kopf.Memo, spec: InferenceServiceSpec, owner: Owner, generation: int,
             members: list[tuple[str, InferenceServiceSpec]] | None = None,
             ) -> reconcile.Applied | None:
    """A timer's apply of `generation`'s children; None when the change handler has taken
    up a newer generation meanwhile (nothing written)."""
    with _writer(memo, owner, generation) as current:
        if not current:
            return None
        return reconcile.apply(memo.kube, spec, owner, memo.config, members or ())


def autoscale(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    owner, generation = reconcile.owner_of(body), body["metadata"].get("generation", 0)
    if (body.get("status") or {}).get("observedGeneration") != generation:
        return
    try:
        spec = _admitted(body, memo)
    except SpecError:
        return
    scaled_pools = reconcile.operator_scaled(spec)
    if not scaled_pools:
        return
    states = memo.setdefault("autoscaler", {})
    try:
        for pool in scaled_pools:
            state = states.setdefault(pool.name, reconcile.PoolState())
            with _writer(memo, owner, generation):  # it patches the replicas it reads
                live = reconcile.workloads(memo.kube, owner)
                done = reconcile.scale_pool(memo.kube, memo.metrics, owner, pool,
                                            live.get(pool_name(owner, pool)), state,
                                            scaling=memo.scaling,
                                            urls=scaling_urls(spec, owner, pool.role))
            if done is not None:
                patch.status[STATUS_KEY[pool.name]] = {"desiredReplicas": done.desired,
                                                       "lastScaleTime": now_iso()}
                kopf.event(body, type="Normal", reason="Scaled", message=(
                    f"{pool_name(owner, pool)}: {done.current} -> {done.desired} replicas "
                    f"({pool.spec.autoscaling.signal} {done.value:.3g} per replica, target "
                    f"{pool.spec.autoscaling.target:g})"))
    except kube.KubeError as exc:
        log.warning("%s/%s: autoscaler tick failed: %s", owner.namespace, owner.name,
                    kube.describe(exc))


def delete_redis_user(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    """A deleted InferenceService's Redis ACL user goes with it (`router.managedRedis`; a
    user that never existed is a no-op). Redis unreachable: retried with backoff, then
    given up after `REDIS_DELETE_RETRIES` (logged) rather than holding the deletion."""
    owner = reconcile.owner_of(body)
    try:
        memo.config.redis.delete_user(owner)
    except RedisAclError as exc:
        if retry >= REDIS_DELETE_RETRIES:
            log.error("%s/%s: Redis ACL user left behind: %s", owner.namespace, owner.name, exc)
            return
        raise kopf.TemporaryError(str(exc), delay=min(memo.config.backoff_s * 2**retry,
                                                      60.0)) from exc


@contextmanager
def _writer(memo: kopf.Memo, owner: Owner, generation: int,
            newest: bool = False) -> Iterator[bool]:
    """One writer at a time per InferenceService (kopf runs handlers and timers in threads
    of their own: a re-apply must not undo a scale between its read and its write). Yields
    whether `generation` is still the newest one the change handler has taken up: a timer's
    body can be older than that handler's, and must not apply a spec it has replaced.
    `newest`: the change handler's own call, which takes `generation` up."""
    lock = memo.setdefault("locks", {}).setdefault(owner.uid, threading.Lock())
    taken = memo.setdefault("generations", {})
    with lock:
        if newest:
            taken[owner.uid] = max(taken.get(owner.uid, generation), generation)
        yield taken.get(owner.uid, generation) <= generation


def registry(config: reconcile.OperatorConfig) -> kopf.OperatorRegistry:
    """A registry with every handler; run it with `memo=kopf.Memo(config=config)`."""
    reg = kopf.OperatorRegistry()
    kopf.on.login(registry=reg)(login)
    kopf.on.startup(registry=reg)(startup)
    kopf.index(*RESOURCE, registry=reg, id="members")(attached_to)
    kopf.index(*RESOURCE, registry=reg, id="services")(routed_by)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(*RESOURCE, registry=reg, id="apply")(apply)
    if config.redis is not None:
        kopf.on.delete(*RESOURCE, registry=reg, id="redis-user")(delete_redis_user)
    kopf.timer(*RESOURCE, registry=reg, interval=config.status_interval_s)(refresh)
    kopf.timer(*RESOURCE, registry=reg, interval=config.autoscale_interval_s)(autoscale)
    kopf.timer(*RESOURCE, registry=reg, interval=config.resync_interval_s,
               initial_delay=config.resync_interval_s)(resync)
    return reg
