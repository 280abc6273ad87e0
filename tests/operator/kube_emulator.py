"""kmock's Kubernetes emulator, extended as far as the operator's tests need, and served on a
local port from a thread (`FakeCluster`), with a kubeconfig that points at it.

What kmock 0.8 lacks and `Emulator` adds: `metadata.uid`, `resourceVersion`, `generation`
(bumped when anything but metadata and status changes) and `creationTimestamp`; the status
subresource (`/status` writes only `status`, the main resource never does); server-side
apply (`application/apply-patch+yaml`: creates a missing object, else replaces all but the
server's fields and the status — exact for a single field manager); no-op writes that change
nothing (no new version, no watch event, as the API server does); 422 for a JSON patch whose
`test` fails (kopf's optimistic concurrency); `generateName` (kopf's Events); equality
`labelSelector`s; watches that start at the list's `resourceVersion` and lose no write
between snapshot and stream (kopf stalls on a replayed stale object); the garbage collector's
background cascade (deleting an object deletes those whose `ownerReferences` name its uid);
injected write failures (`faults`); PUT (a replace, refused with 409 when its
`metadata.resourceVersion` is not the live one: leader election's optimistic concurrency);
and a log of every write with the client's Authorization header (`writes`: which of several
operators, each with a kubeconfig token of its own, wrote what). kmock's 500 on
`GET /api/v1/namespaces` is left as it is: the tests run kopf cluster-wide, which never lists
namespaces.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml

APPLY = "application/apply-patch+yaml"
SERVER_META = ("uid", "resourceVersion", "generation", "creationTimestamp",
               "deletionTimestamp", "finalizers")


@dataclass
class Write:
    """One write request as the emulator received it (`status`: its answer)."""

    at: float  # time.monotonic()
    auth: str  # the Authorization header: which client (kubeconfig token) wrote
    method: str
    plural: str
    namespace: str | None
    name: str | None
    status: int = 0


@dataclass
class _Replaced:
    """A PUT's body, for `_update` as if it were a JSON merge patch replacing everything."""

    data: dict[str, Any]
    subresource: None = None
    headers: dict[str, str] = field(default_factory=dict)


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(target: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386; strategic merge patches are taken as such too)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-joined."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            ok = labels.get(k.strip()) != v.strip()
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            ok = labels.get(k.strip()) == v.strip()
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


class Emulator(kmock.KubernetesEmulator):
    """The emulator with versions, generations, status, apply and a garbage collector."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = 0  # the last resourceVersion handed out (one counter for all objects)
        self.faults: dict[str, int] = {}  # plural -> HTTP status every write gets (tests)
        self.writes: list[Write] = []  # every write request, in arrival order
        self._in_flight: dict[int, kmock.Request] = {}  # id -> a request not yet answered

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _status_resource(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Serve `request`. kmock logs every request for its DSL's assertions (none here) and
        matches each new one to its reactions by scanning that whole log (quadratic over a
        module's tests): the log keeps only the requests in flight, those being matched."""
        self._in_flight[id(request)] = request
        self._requests[:] = [r for r in self._requests if id(r) in self._in_flight]
        try:
            return await self._answer(request)
        finally:
            del self._in_flight[id(request)]

    async def _answer(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        writes = {kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE}
        put = request.method == kmock.method.PUT and request.name is not None
        if request.resource is None or (request.action not in writes and not put):
            return await super()._handle(request)
        if request.action != kmock.action.CREATE and request.name is None:
            return await super()._handle(request)
        write = Write(time.monotonic(), request.headers.get("Authorization", ""),
                      getattr(request.method, "value", str(request.method)),
                      request.resource.plural, request.namespace,
                      request.name or (request.data or {}).get("metadata", {}).get("name"))
        self.writes.append(write)
        if request.resource.plural in self.faults:
            write.status = self.faults[request.resource.plural]
            return await self._render_error(kmock.KubernetesError(write.status, "Injected",
                                                                  "fault"))
        try:
            async with self._lock:
                status, body = await (self._replace(request) if put else self._write(request))
        except kmock.KubernetesError as exc:  # an answer, not a server fault
            write.status = exc.status
            return await self._render_error(exc)
        write.status = status
        return aiohttp.web.json_response(body, status=status)

    async def _replace(self, request: kmock.Request) -> tuple[int, dict[str, Any]]:
        """PUT: the whole object, if `metadata.resourceVersion` (when given) is the live one
        (optimistic concurrency: else 409 Conflict, as a leader-election race gets)."""
        key = (request.resource, request.namespace, request.name)
        try:
            live = self._objects[key]
        except KeyError:
            live = None
        if live is None or live.deleted:
            raise kmock.KubernetesObjectNotFoundError()
        data = copy.deepcopy(request.data or {})
        rv = data.get("metadata", {}).get("resourceVersion")
        if rv is not None and rv != live.raw["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(409, "Conflict", f"{request.name}: the object has "
                                        "been modified; apply your changes to the latest version")
        merged = {k: v for k, v in data.items() if k != "status"}
        merged["metadata"] = {**data.get("metadata", {}), **{
            k: live.raw["metadata"][k] for k in SERVER_META if k in live.raw["metadata"]}}
        return 200, await self._update(key, _Replaced(merged))

    async def _write(self, request: kmock.Request) -> tuple[int, dict[str, Any]]:
        res = request.resource
        if request.action == kmock.action.CREATE:
            return 201, await self._create(res, request.namespace, request.data or {})
        key = (res, request.namespace, request.name)
        try:
            live = self._objects[key]
        except KeyError:
            live = None
        if live is None or live.deleted:
            if (request.action == kmock.action.UPDATE and request.subresource is None
                    and request.headers.get("Content-Type", "").startswith(APPLY)):
                return 201, await self._create(res, request.namespace, request.data or {})
            raise kmock.KubernetesObjectNotFoundError()
        if request.action == kmock.action.DELETE:
            return 200, await self._delete(key)
        return 200, await self._update(key, request)

    async def _create(self, res: Any, namespace: str | None, body: dict) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        namespace = namespace or meta.get("namespace")
        if namespace:
            meta["namespace"] = namespace
        key = (res, namespace, meta.get("name"))
        if key in self._objects and not self._objects[key].deleted:
            raise kmock.KubernetesError(409, "AlreadyExists", f"{meta.get('name')} exists")
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(),
                    generation=1, creationTimestamp=_now())
        if self._status_resource(res):
            obj.pop("status", None)
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        await self._buses[res].put({"type": "ADDED", "object": obj})
        return obj

    async def _update(self, key: tuple, request: kmock.Request | _Replaced) -> dict:
        res, live = key[0], self._objects[key].raw
        data = request.data if request.data is not None else {}
        if isinstance(request, _Replaced):
            new = copy.deepcopy(data)
        elif request.headers.get("Content-Type", "").startswith(APPLY):
            new = copy.deepcopy(data)
            new.setdefault("metadata", {}).update(
                {k: live["metadata"][k] for k in SERVER_META if k in live["metadata"]})
            new.pop("status", None)
            if "status" in live:
                new["status"] = live["status"]
        elif isinstance(data, list):
            try:
                new = jsonpatch.apply_patch(copy.deepcopy(live), data)
            except jsonpatch.JsonPatchException as exc:  # e.g. kopf's resourceVersion test
                raise kmock.KubernetesError(422, "Invalid", str(exc)) from exc
        else:
            new = merge(copy.deepcopy(live), data)
        new = dict(new)
        if request.subresource == "status":
            new = {**live, "status": new.get("status")}
        elif self._status_resource(res):
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in live:
                new["status"] = live["status"]
        new = {k: v for k, v in new.items() if v is not None}
        if new == live:
            return live
        meta = new["metadata"] = dict(new["metadata"])
        meta["resourceVersion"] = self._next_rv()
        body = {k: v for k, v in new.items() if k not in ("metadata", "status")}
        if body != {k: v for k, v in live.items() if k not in ("metadata", "status")}:
            meta["generation"] = live["metadata"].get("generation", 1) + 1
        self._objects[key].history.append(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return await self._delete(key)
        await self._buses[res].put({"type": "MODIFIED", "object": new})
        return new

    async def _delete(self, key: tuple) -> dict:
        obj = self._objects[key].raw
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                new = {**obj, "metadata": {**meta, "deletionTimestamp": _now(),
                                           "resourceVersion": self._next_rv()}}
                self._objects[key].history.append(new)
                await self._buses[key[0]].put({"type": "MODIFIED", "object": new})
                return new
            return obj
        self._objects[key].delete()
        await self._buses[key[0]].put({"type": "DELETED", "object": obj})
        for other, child in list(self._objects.items()):  # the garbage collector
            if not child.deleted and any(ref.get("uid") == meta.get("uid") for ref in
                                         child.raw["metadata"].get("ownerReferences", [])):
                await self._delete(other)
        return obj

    def _matches(self, request: kmock.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        selector = request.params.get("labelSelector")
        return ((request.namespace is None or meta.get("namespace") == request.namespace)
                and (request.name is None or meta.get("name") == request.name)
                and (not selector or selects(selector, meta.get("labels") or {})))

    def _live(self, request: kmock.Request) -> list[dict[str, Any]]:
        return [o.raw for (res, _, _), o in self._objects.items()
                if res == request.resource and not o.deleted and self._matches(request, o.raw)]

    async def _serve_list(self, request: kmock.Request) -> Any:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            return {"metadata": {"resourceVersion": str(self._rv)}, "items": self._live(request)}

    async def _serve_watch(self, request: kmock.Request) -> Any:
        """From `resourceVersion` (a list's): the objects changed since, then every event; the
        bus is marked with the snapshot, so a write between the two is neither lost nor sent
        twice (kopf stalls on a replayed stale object)."""
        yield b""
        since = int(request.params.get("resourceVersion") or 0)
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            objs = [o for o in self._live(request)
                    if int(o["metadata"].get("resourceVersion", 0)) > since]
        try:
            for obj in objs:
                yield {"type": "ADDED", "object": obj}
            async for event in bus.stream(since=mark):
                if self._matches(request, event.get("object", {})):
                    yield event
        finally:
            await bus.unmark(mark)


class FakeCluster:
    """The emulator on a real port, on its own event loop in a thread, plus a kubeconfig."""

    def __init__(self, resources: dict[str, dict[str, Any]], tmp: Path) -> None:
        self._resources = resources
        started = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(started),),
                                        daemon=True)
        self._thread.start()
        assert started.wait(10), "kmock did not start"
        self.kubeconfig = self.kubeconfig_as("test", tmp / "kubeconfig")

    def kubeconfig_as(self, token: str, path: Path | None = None) -> Path:
        """A kubeconfig for this server with bearer `token` (the write log's `auth`)."""
        path = path or self.kubeconfig.with_name(f"kubeconfig-{token}")
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": token}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
        return path

    def writes(self) -> list[Write]:
        """Every write request so far, in arrival order."""
        async def read() -> list[Write]:
            return list(self.km.writes)

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(5)

    async def _serve(self, started: threading.Event) -> None:
        async with Emulator() as km, kmock.Server(km) as server:
            self.km, self.url = km, str(server.url).rstrip("/")
            self.loop, self._done = asyncio.get_running_loop(), asyncio.Event()
            for name, info in self._resources.items():
                km.resources[name] = kmock.ResourceInfo(**info)
            started.set()
            await self._done.wait()

    def history(self, resource: str, namespace: str, name: str) -> list[dict[str, Any] | None]:
        """Every version of one object (None: deleted), as the emulator stored them."""
        async def read() -> list:
            key = (kmock.resource(resource), namespace, name)
            if key not in self.km.objects:
                return []
            return [None if v is None else v.raw for v in self.km.objects[key].history]

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(5)

    def objects(self, resource: str) -> list[dict[str, Any]]:
        """The live objects of one resource, in every namespace."""
        async def read() -> list:
            res = kmock.resource(resource)
            return [o.raw for (r, _, _), o in self.km.objects.items()
                    if r == res and not o.deleted]

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(5)

    def set_faults(self, **plurals: int) -> None:
        """Every write to these resources (by plural) answers this HTTP status; none: heal."""
        async def put() -> None:
            self.km.faults = dict(plurals)

        asyncio.run_coroutine_threadsafe(put(), self.loop).result(5)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)
