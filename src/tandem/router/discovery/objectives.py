"""The InferenceObjectives of the router's InferencePool, listed then watched.

The Gateway API Inference Extension's `InferenceObjective`
(`inference.networking.x-k8s.io/v1alpha2`, namespaced) names a pool (`spec.poolRef`) and a
`priority` (higher is more important; unset counts as 0, as the reference endpoint picker
reads it). With `--discovery kubernetes`, the endpoint picker on and `--inference-pool NAME`,
the router keeps those of its namespace whose `poolRef` is the InferencePool NAME (group
`inference.networking.k8s.io`, kind `InferencePool`, their defaults) as a name -> priority
map, the band of a request naming one in `x-gateway-inference-objective`.

Same pattern as `discovery.k8s`: a daemon thread lists, watches from the list's
resourceVersion (with bookmarks) and hands every new complete map to the event loop; a 410
Gone re-lists at once; any other failure (the CRD not installed: 404) retries after a
jittered backoff while the last known map stands. At most `MAX_OBJECTIVES` are held (the
rest are dropped with a warning, by name order); names are Kubernetes object names (at most
253 characters). `kubernetes` is imported only when `run` starts.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.router.discovery.k8s import follow, follow_in_thread, kube_client, raise_watch_error

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, CustomObjectsApi

logger = logging.getLogger(__name__)
GROUP = "inference.networking.x-k8s.io"
VERSION = "v1alpha2"
PLURAL = "inferenceobjectives"
POOL_GROUP = "inference.networking.k8s.io"
POOL_KIND = "InferencePool"
MAX_OBJECTIVES = 4096  # held per router; more are dropped (by name order) with a warning
MAX_NAME = 253  # a Kubernetes object name
PRIORITY_BOUND = 1 << 31  # an int32, as router.yaml `objectives` bounds it
Objectives = dict[str, int]  # InferenceObjective name -> priority
OnObjectives = Callable[[Objectives], None]


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def valid_pool_name(name: str) -> bool:
    """`name` can name an InferencePool (a DNS subdomain, at most 253 characters)."""
    return len(name) <= MAX_NAME and _DNS_SUBDOMAIN.fullmatch(name) is not None


def pool_priority(obj: dict[str, Any], pool: str) -> int | None:
    """The priority of one InferenceObjective (its JSON) when its `poolRef` is the
    InferencePool `pool`; None when it is another pool's or malformed. No priority: 0."""
    spec = obj.get("spec") or {}
    ref = spec.get("poolRef") or {}
    if (ref.get("name") != pool or (ref.get("group") or POOL_GROUP) != POOL_GROUP
            or (ref.get("kind") or POOL_KIND) != POOL_KIND):
        return None
    p = spec.get("priority", 0)
    if p is None:
        return 0
    if isinstance(p, bool) or not isinstance(p, int) or not -PRIORITY_BOUND <= p < PRIORITY_BOUND:
        logger.warning("InferenceObjective %s: priority %r is no int32; ignored",
                       (obj.get("metadata") or {}).get("name"), p)
        return None
    return p


def entry(obj: dict[str, Any], pool: str) -> tuple[str, int | None]:
    """(name, priority) of one InferenceObjective; priority None: not held (another pool's,
    malformed, or a name longer than `MAX_NAME`)."""
    name = (obj.get("metadata") or {}).get("name") or ""
    if not 0 < len(name) <= MAX_NAME:
        return name, None
    return name, pool_priority(obj, pool)


def apply(held: Objectives, kind: str, obj: dict[str, Any], pool: str) -> bool:
    """One watch event (`ADDED`, `MODIFIED`, `DELETED`; others, e.g. `BOOKMARK`, change
    nothing) applied to `held` in place; True when it may have changed."""
    if kind in ("ADDED", "MODIFIED"):
        name, priority = entry(obj, pool)
        if priority is None:
            held.pop(name, None)  # moved to another pool
        else:
            held[name] = priority
        return True
    if kind == "DELETED":
        held.pop((obj.get("metadata") or {}).get("name"), None)
        return True
    return False


def bounded(objectives: Objectives) -> Objectives:
    """At most `MAX_OBJECTIVES`, the first by name."""
    if len(objectives) <= MAX_OBJECTIVES:
        return dict(objectives)
    kept = sorted(objectives)[:MAX_OBJECTIVES]
    logger.warning("%d InferenceObjectives for this pool; only the first %d by name are used",
                   len(objectives), MAX_OBJECTIVES)
    return {name: objectives[name] for name in kept}


class ObjectiveWatch:
    """The InferenceObjectives of `namespace` whose poolRef is `pool`. The client comes from
    `api_client`, else in-cluster config, else kubeconfig. One `run` at a time."""

    def __init__(self, namespace: str, pool: str, *, api_client: ApiClient | None = None,
                 watch_timeout_s: float = 300.0, request_timeout_s: float = 30.0,
                 backoff_min_s: float = 0.2, backoff_max_s: float = 30.0) -> None:
        self.namespace, self.pool = namespace, pool
        self.api_client = api_client
        self.watch_timeout_s = watch_timeout_s  # server-side, spread over [t, 2t)
        self.request_timeout_s = request_timeout_s
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self._watch: Any = None

    async def run(self, on_change: OnObjectives) -> None:
        """Call `on_change` on the running loop with the complete map: once listed, then on
        every change. Runs until cancelled."""
        api = self._api()
        await follow_in_thread(lambda publish, stop: self._follow(api, publish, stop),
                               f"objectives-{self.namespace}", on_change, lambda: self._watch)

    def _api(self) -> CustomObjectsApi:
        from kubernetes import client

        return client.CustomObjectsApi(kube_client(self.api_client))

    def _entry(self, obj: dict[str, Any]) -> tuple[str, int | None]:
        return entry(obj, self.pool)

    def _follow(self, api: CustomObjectsApi, publish: OnObjectives,
                stop: threading.Event) -> None:
        """The thread: list, watch, repeat (`k8s.follow`); publishes each new bounded map."""
        follow(lambda: self._list(api),
               lambda version, held, changed: self._watch_once(api, version, held, changed,
                                                                stop),
               bounded, publish, stop, self.backoff_min_s, self.backoff_max_s,
               f"InferenceObjective watch in {self.namespace}", "objective(s)")

    def _list(self, api: CustomObjectsApi) -> tuple[str, Objectives]:
        resp = api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, _preload_content=False,
            _request_timeout=self.request_timeout_s)
        body = json.loads(resp.data)
        held: Objectives = {}
        for item in body.get("items") or []:
            name, priority = self._entry(item)
            if priority is not None:
                held[name] = priority
        return (body.get("metadata") or {}).get("resourceVersion") or "", held

    def _watch_once(self, api: CustomObjectsApi, version: str, held: Objectives,
                    changed: Callable[[], None], stop: threading.Event) -> str:
        """One watch request applied to `held` until the server ends it; returns the last
        resourceVersion seen (bookmarks included)."""
        from kubernetes import watch
        from urllib3.exceptions import ReadTimeoutError

        timeout = int(self.watch_timeout_s * (1 + random.random())) or 1
        kwargs: dict[str, Any] = {
            "allow_watch_bookmarks": True, "timeout_seconds": timeout,
            "_request_timeout": (self.request_timeout_s, timeout + self.request_timeout_s)}
        if version:
            kwargs["resource_version"] = version
        self._watch = w = watch.Watch(return_type="object")
        if stop.is_set():
            self._watch = None
            return version
        try:
            for event in w.stream(api.list_namespaced_custom_object, GROUP, VERSION,
                                  self.namespace, PLURAL, **kwargs):
                if stop.is_set():
                    break
                raise_watch_error(event)  # a 410 inside the stream re-lists
                obj = event["raw_object"]
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if apply(held, event["type"], obj, self.pool):
                    changed()
        except ReadTimeoutError:
            pass
        finally:
            self._watch = None
        return version
