"""Kubernetes discovery: the worker EndpointSlices of one namespace, listed then watched.

The EndpointSlice controller copies a Service's labels onto its slices, and the operator
labels worker Services with `app.kubernetes.io/component=worker`, `tandem.dev/inference-
service` and `tandem.dev/role`: one label selector finds every worker pod of an
InferenceService, and the role of its pool. The official client is synchronous, so a daemon
thread lists, watches from the list's resourceVersion (with bookmarks) and hands every new
complete set to the event loop. A 410 Gone re-lists at once; any other failure retries after
a jittered backoff while the last known set stands. `kubernetes` is imported only by `run`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from tandem.protocol.labels import (
    COMPONENT_LABEL,
    ROLE_LABEL,
    ROLES,
    ROUTER_GROUP_LABEL,
    SERVICE_LABEL,
    WORKER_COMPONENT,
)
from tandem.router.discovery.base import (
    Discovery,
    DiscoveryConfig,
    OnChange,
    WorkerEndpoint,
    register_discovery,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, DiscoveryV1Api

logger = logging.getLogger(__name__)
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
HTTP_GONE = 410
Slices = dict[str, list[WorkerEndpoint]]  # EndpointSlice name -> its endpoints


def pod_namespace(default: str = "default") -> str:
    """The namespace this pod runs in (its service account's), else `default`."""
    try:
        return NAMESPACE_FILE.read_text().strip() or default
    except OSError:
        return default


_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def worker_selector(inference_service: str | None = None,
                    router_group: str | None = None) -> str:
    """Every Tandem worker's slices; only those of the InferenceServices named in
    `inference_service` (one name, or several comma-separated: `in (a,b)`); only those of
    the worker Services labelled `tandem.dev/router-group=<router_group>`. ValueError for a
    name that is not a Kubernetes label value."""
    parts = [f"{COMPONENT_LABEL}={WORKER_COMPONENT}"]
    names = sorted({n.strip() for n in (inference_service or "").split(",") if n.strip()})
    for name in [*names, *([router_group] if router_group else [])]:
        if not _LABEL_VALUE.fullmatch(name):
            raise ValueError(f"{name!r} is not a Kubernetes label value (at most 63 letters, "
                             "digits, '-', '_' or '.', starting and ending alphanumeric)")
    if len(names) == 1:
        parts.append(f"{SERVICE_LABEL}={names[0]}")
    elif names:
        parts.append(f"{SERVICE_LABEL} in ({','.join(names)})")
    if router_group:
        parts.append(f"{ROUTER_GROUP_LABEL}={router_group}")
    return ",".join(parts)


def slice_endpoints(obj: dict[str, Any], port_name: str = "http",
                    scheme: str = "http") -> list[WorkerEndpoint]:
    """One EndpointSlice (its JSON) -> a worker per address, on the port named `port_name`
    (else the slice's first port); `conditions.ready` null counts as ready."""
    ports = [p for p in obj.get("ports") or [] if p.get("port") is not None]
    port = next((p for p in ports if p.get("name") == port_name), ports[0] if ports else None)
    meta = obj.get("metadata") or {}
    if port is None:
        logger.warning("EndpointSlice %s has no port; skipped", meta.get("name"))
        return []
    role = (meta.get("labels") or {}).get(ROLE_LABEL, "both")
    if role not in ROLES:
        logger.warning("EndpointSlice %s: unknown role %r, taken as 'both'", meta.get("name"), role)
        role = "both"
    out = []
    for ep in obj.get("endpoints") or []:
        ready = (ep.get("conditions") or {}).get("ready") is not False
        for addr in ep.get("addresses") or []:
            host = f"[{addr}]" if ":" in addr else addr  # IPv6
            out.append(WorkerEndpoint(f"{scheme}://{host}:{port['port']}", role, ready))
    return out


def merge(slices: Slices) -> dict[str, WorkerEndpoint]:
    """All slices' endpoints by URL (an address in several slices is ready if one says so)."""
    out: dict[str, WorkerEndpoint] = {}
    for endpoints in slices.values():
        for ep in endpoints:
            seen = out.get(ep.url)
            if seen is None or (ep.ready and not seen.ready):
                out[ep.url] = ep
    return out


def follow(list_once: Callable[[], tuple[str, dict]],
           watch_once: Callable[[str, dict, Callable[[], None]], str],
           merge: Callable[[dict], Any], publish: Callable[[Any], None],
           stop: threading.Event, backoff_min_s: float, backoff_max_s: float,
           what: str, items: str) -> None:
    """A list-then-watch loop for a daemon thread, until `stop`: `list_once()` -> (resource
    version, held objects), then `watch_once(version, held, changed)` (updates `held` in place,
    calls `changed()` after each event, returns the version to resume from); publishes
    `merge(held)` whenever it changes. A 410 Gone re-lists at once; any other failure retries
    after a jittered, doubling backoff while the last published value stands (`what` and
    `items` name them in the log). Imports `kubernetes` itself."""
    from kubernetes.client.exceptions import ApiException

    held: dict = {}
    version: str | None = None  # None: list first
    last: Any = None
    delay = backoff_min_s

    def changed() -> None:
        nonlocal last
        now = merge(held)
        if now != last:
            last = now
            publish(now)

    while not stop.is_set():
        try:
            if version is None:
                version, listed = list_once()
                held.clear()
                held.update(listed)
                changed()
            if stop.is_set():
                return
            version = watch_once(version, held, changed)
            delay = backoff_min_s
            continue
        except ApiException as exc:
            if exc.status == HTTP_GONE:
                logger.info("%s: the watch expired (410); re-listing", what)
                version = None
                continue
            error = f"HTTP {exc.status} {exc.reason}"
        except Exception as exc:  # the thread outlives any failure
            error = repr(exc)
        if stop.is_set():
            return
        pause = delay * (0.5 + random.random())
        logger.warning("%s failed (%s); retrying in %.2fs, keeping the last %d %s", what,
                       error, pause, len(last or {}), items)
        stop.wait(pause)
        delay = min(delay * 2, backoff_max_s)


def kube_client(given: ApiClient | None) -> ApiClient:
    """`given`, else a client from the in-cluster config, else from $KUBECONFIG (read now,
    not at import)."""
    from kubernetes import client, config

    if given is not None:
        return given
    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(os.environ.get("KUBECONFIG"), client_configuration=cfg)
    return client.ApiClient(cfg)


def raise_watch_error(event: dict[str, Any]) -> None:
    """An ERROR event inside a watch stream as the exception `follow` acts on: a 410 Gone
    (the version expired: re-list) as `ApiException`, anything else as RuntimeError."""
    if event["type"] != "ERROR":
        return
    obj = event["raw_object"] or {}
    if obj.get("code") == HTTP_GONE:
        from kubernetes.client.exceptions import ApiException
        raise ApiException(status=HTTP_GONE, reason="Gone")
    raise RuntimeError(f"watch error: {obj.get('message')}")


async def follow_in_thread(target: Callable[[Callable[[Any], None], threading.Event], None],
                           name: str, on_change: Callable[[Any], None],
                           current_watch: Callable[[], Any]) -> None:
    """Run `target(publish, stop)` (a `follow` loop) in a daemon thread named `name`, calling
    `on_change` on this event loop with what it publishes, until cancelled; then stops it
    (`current_watch()`: the live `kubernetes.watch.Watch`, stopped to unblock its read)."""
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def deliver(value: Any) -> None:  # on the loop
        if not stop.is_set():
            on_change(value)

    def publish(value: Any) -> None:  # from the thread
        try:
            loop.call_soon_threadsafe(deliver, value)
        except RuntimeError:  # the loop is closed: nobody listens any more
            stop.set()

    threading.Thread(target=target, args=(publish, stop), daemon=True, name=name).start()
    try:
        await asyncio.Event().wait()
    finally:
        stop.set()
        if (w := current_watch()) is not None:
            w.stop()


@register_discovery
class KubernetesDiscovery(Discovery):
    """`discovery.k8s.io/v1` EndpointSlices matching `label_selector` in `namespace`. The
    client comes from `api_client`, else in-cluster config (`KUBERNETES_SERVICE_HOST` set),
    else kubeconfig (`KUBECONFIG` or the default file). One `run` at a time."""

    name = "kubernetes"

    def __init__(self, namespace: str, label_selector: str | None = None,
                 port_name: str = "http", scheme: str = "http", *,
                 api_client: ApiClient | None = None, watch_timeout_s: float = 300.0,
                 request_timeout_s: float = 30.0, backoff_min_s: float = 0.2,
                 backoff_max_s: float = 30.0) -> None:
        self.namespace = namespace
        self.label_selector = label_selector or worker_selector()
        self.port_name = port_name
        self.scheme = scheme
        self.api_client = api_client
        self.watch_timeout_s = watch_timeout_s  # server-side, spread over [t, 2t)
        self.request_timeout_s = request_timeout_s  # connect; list read; watch read slack
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._watch: Any = None  # the live kubernetes.watch.Watch, stopped on cancel

    @classmethod
    def from_config(cls, cfg: DiscoveryConfig) -> Self:
        selector = cfg.label_selector or worker_selector(cfg.inference_service,
                                                         cfg.router_group)
        return cls(cfg.namespace, selector, cfg.port_name, cfg.scheme)

    async def run(self, on_change: OnChange) -> None:
        api = self._api()  # configuration errors raise here, before the first await
        await follow_in_thread(lambda publish, stop: self._follow(api, publish, stop),
                               f"discovery-{self.namespace}", on_change, lambda: self._watch)

    def _api(self) -> DiscoveryV1Api:
        from kubernetes import client

        return client.DiscoveryV1Api(kube_client(self.api_client))

    def _follow(self, api: DiscoveryV1Api, publish: OnChange, stop: threading.Event) -> None:
        """The thread: list, watch, repeat; publishes each new complete set."""
        follow(lambda: self._list(api),
               lambda version, held, changed: self._watch_once(api, version, held, changed,
                                                                stop),
               merge, publish, stop, self.backoff_min_s, self.backoff_max_s,
               f"EndpointSlice discovery in {self.namespace}", "worker(s)")

    def _endpoints(self, obj: dict[str, Any]) -> list[WorkerEndpoint]:
        return slice_endpoints(obj, self.port_name, self.scheme)

    def _list(self, api: DiscoveryV1Api) -> tuple[str, Slices]:
        resp = api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.label_selector, _preload_content=False,
            _request_timeout=self.request_timeout_s)
        body = json.loads(resp.data)
        slices = {item["metadata"]["name"]: self._endpoints(item)
                  for item in body.get("items") or []}
        return (body.get("metadata") or {}).get("resourceVersion") or "", slices

    def _watch_once(self, api: DiscoveryV1Api, version: str, slices: Slices,
                    changed: Callable[[], None], stop: threading.Event) -> str:
        """One watch request, applied to `slices` until the server ends it; returns the
        last resourceVersion seen (bookmarks included)."""
        from kubernetes import watch
        from urllib3.exceptions import ReadTimeoutError

        timeout = int(self.watch_timeout_s * (1 + random.random())) or 1
        kwargs: dict[str, Any] = {
            "label_selector": self.label_selector, "allow_watch_bookmarks": True,
            "timeout_seconds": timeout,
            "_request_timeout": (self.request_timeout_s, timeout + self.request_timeout_s)}
        if version:
            kwargs["resource_version"] = version
        self._watch = w = watch.Watch(return_type="object")  # plain dicts, no model checks
        if stop.is_set():  # cancelled before `run` could see this watch
            self._watch = None
            return version
        try:
            for event in w.stream(api.list_namespaced_endpoint_slice, self.namespace,
                                  **kwargs):
                if stop.is_set():
                    break
                raise_watch_error(event)
                obj = event["raw_object"]
                meta = obj.get("metadata") or {}
                version = meta.get("resourceVersion") or version
                if event["type"] in ("ADDED", "MODIFIED"):
                    slices[meta["name"]] = self._endpoints(obj)
                elif event["type"] == "DELETED":
                    slices.pop(meta["name"], None)
                else:  # BOOKMARK: only the version moves
                    continue
                changed()
        except ReadTimeoutError:
            pass  # silent past its own timeout: a new watch from the same version
        finally:
            self._watch = None
        return version
