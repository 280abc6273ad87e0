"""Leader election for `tandem operator --leader-elect`: several replicas, one of which runs
the handlers and timers (every write), the others standing by to take over.

A `coordination.k8s.io/v1` Lease (default `tandem-operator` in the operator's namespace),
with client-go's algorithm: the holder renews it every `retry_s`; a candidate takes it when
its record has not changed for the Lease's `leaseDurationSeconds` by the candidate's own
clock (never by comparing clocks across machines), with an optimistic-concurrency replace
(the `resourceVersion` it read: of two candidates, one wins, the other gets 409). The holder
stops trusting its lease `renew_deadline_s` after the start of its last successful renewal,
earlier than any candidate can take it over (`duration_s` after it saw that renewal): the gap
is the time the old leader has to stop its handlers. `Elector.leading` is also the fence of
the operator's own writes (`kube.Kube(fence=...)`). A clean stop releases the Lease (holder
emptied) so a standby takes over at its next retry; a leader that loses its Lease exits.

Why not kopf's peering: peers of equal priority all pause (kopf 1.45: "Possibly conflicting
operators with the same priority"), and kopf states it takes no per-object locks, so it
cannot make identical replicas into one leader and standbys. Why not the `kubernetes`
client's `leaderelection`: it uses the global default configuration, cannot be stopped
(no stop flag; blocking sleeps), calls `sys.exit` on bad settings and takes whole seconds only.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tandem.operator.kube import KubeError, describe

logger = logging.getLogger(__name__)
JITTER = 0.2  # a candidate's retry period is stretched by up to 20 % (no lockstep)


@dataclass(frozen=True)
class LeaseConfig:
    """Where the Lease is, who this replica is, and the timings (client-go's defaults)."""

    name: str
    namespace: str
    identity: str
    duration_s: int = 15  # leaseDurationSeconds: a silent lease is free after this long
    renew_deadline_s: float = 10.0  # the holder gives up after this long without a renewal
    retry_s: float = 2.0  # renewals and candidates' attempts

    def __post_init__(self) -> None:
        if not self.duration_s > self.renew_deadline_s > self.retry_s * (1 + JITTER) > 0:
            raise ValueError("leader election needs lease duration > renew deadline > "
                             f"{1 + JITTER:g} x retry period > 0 (got {self.duration_s}, "
                             f"{self.renew_deadline_s}, {self.retry_s})")


class LeaseNotLeader(RuntimeError):
    """A write attempted by a replica whose lease is not (or no longer) valid."""


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeLease:
    """Get, create and replace one Lease, as plain dicts (None: not there / lost a race)."""

    def __init__(self, api_client: client.ApiClient, config: LeaseConfig) -> None:
        self.api, self.config = client.CoordinationV1Api(api_client), config
        self.timeout_s = config.renew_deadline_s  # a hung request cannot outlive the lease

    def get(self) -> dict[str, Any] | None:
        try:
            resp = self.api.read_namespaced_lease(self.config.name, self.config.namespace,
                                                  _preload_content=False,
                                                  _request_timeout=self.timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return self._write(self.api.create_namespaced_lease, self.config.namespace, body)

    def replace(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return self._write(self.api.replace_namespaced_lease, self.config.name,
                           self.config.namespace, body)

    def _write(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout_s)
        except ApiException as exc:
            if exc.status == 409:  # another replica wrote it first
                return None
            raise
        return json.loads(resp.data)


class Elector:
    """One replica's view of the Lease. `acquire` until leader, then `keep` it."""

    def __init__(self, lease: KubeLease, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease, self.config, self.clock = lease, lease.config, clock
        self._observed: tuple[Any, ...] | None = None  # the Lease record last seen
        self._observed_at = 0.0  # when it was first seen (this replica's clock)
        self._renewed_at: float | None = None  # start of the last successful acquire/renew

    def leading(self) -> bool:
        """Whether this replica may act as the leader right now."""
        return (self._renewed_at is not None
                and self.clock() - self._renewed_at < self.config.renew_deadline_s)

    def fence(self) -> None:
        """For writes: raise `LeaseNotLeader` unless `leading()`."""
        if not self.leading():
            raise LeaseNotLeader(f"{self.config.identity} does not hold the lease "
                                 f"{self.config.namespace}/{self.config.name}")

    def _attempt(self) -> bool:
        """One try to take or renew the Lease (blocking I/O)."""
        start, me = self.clock(), self.config.identity
        lease = self.lease.get()
        stamp = _now()
        if lease is None:
            spec = {"holderIdentity": me, "leaseDurationSeconds": self.config.duration_s,
                    "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0}
            created = self.lease.create({"apiVersion": "coordination.k8s.io/v1",
                                         "kind": "Lease", "metadata": {
                                             "name": self.config.name,
                                             "namespace": self.config.namespace},
                                         "spec": spec})
            return self._won(created, start)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"),
                  spec.get("acquireTime"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        if holder is not None and holder != me:
            self._renewed_at = None  # someone else holds it: certainly not us
            duration = spec.get("leaseDurationSeconds") or self.config.duration_s
            if self.clock() < self._observed_at + duration:
                return False
            logger.info("lease %s/%s held by %s expired: taking it over",
                        self.config.namespace, self.config.name, holder)
        elif holder is None and self._renewed_at is not None:
            self._renewed_at = None  # released under us (by hand): acquire it afresh
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != me)
        new = {**spec, "holderIdentity": me, "leaseDurationSeconds": self.config.duration_s,
               "renewTime": stamp, "leaseTransitions": transitions,
               "acquireTime": spec.get("acquireTime") if holder == me else stamp}
        return self._won(self.lease.replace({**lease, "spec": new}), start)

    def _won(self, lease: dict[str, Any] | None, start: float) -> bool:
        if lease is None:
            return False
        spec = lease["spec"]
        self._observed = (spec.get("holderIdentity"), spec.get("renewTime"),
                          spec.get("leaseDurationSeconds"), spec.get("acquireTime"))
        self._observed_at, self._renewed_at = self.clock(), start
        return True

    async def _try(self) -> bool:
        try:
            return await asyncio.to_thread(self._attempt)
        except KubeError as exc:
            logger.warning("lease %s/%s: %s", self.config.namespace, self.config.name,
                           describe(exc))
            return False

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Until this replica holds the Lease (True) or `stop` is set (False)."""
        logger.info("%s: standing by for lease %s/%s", self.config.identity,
                    self.config.namespace, self.config.name)
        while not stop.is_set():
            if await self._try():
                logger.info("%s: leading (lease %s/%s)", self.config.identity,
                            self.config.namespace, self.config.name)
                return True
            await _wait(stop, self.config.retry_s * (1 + random.uniform(0, JITTER)))
        return False

    async def keep(self, stop: asyncio.Event) -> bool:
        """Renew every retry period: True once `stop` is set, False when the lease is lost
        (the renew deadline passed without a renewal, or another replica holds it)."""
        while True:
            if await _wait(stop, self.config.retry_s):
                return True
            if not await self._try() and not self.leading():
                logger.error("%s: lost lease %s/%s", self.config.identity,
                             self.config.namespace, self.config.name)
                return False

    async def release(self) -> None:
        """Hand the Lease back (holder emptied, 1 s duration): a standby takes it at once.
        Call it after the work it guarded has stopped. The server's record decides, not the
        local renew clock (the work may take longer to stop than a renew deadline): only a
        Lease still naming this replica is written, with optimistic concurrency, so one a
        standby took meanwhile is left alone."""

        def give_back() -> None:
            lease = self.lease.get()
            spec = (lease or {}).get("spec") or {}
            if lease is None or spec.get("holderIdentity") != self.config.identity:
                return
            stamp = _now()
            self.lease.replace({**lease, "spec": {
                **spec, "holderIdentity": None, "leaseDurationSeconds": 1,
                "acquireTime": stamp, "renewTime": stamp}})

        self._renewed_at = None
        try:
            await asyncio.to_thread(give_back)
        except KubeError as exc:
            logger.warning("lease not released (it expires instead): %s", describe(exc))
        else:
            logger.info("%s: released lease %s/%s", self.config.identity,
                        self.config.namespace, self.config.name)


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `stop`; whether `stop` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


Work = Callable[[threading.Event], Awaitable[None]]  # runs until its flag is set


async def lead(elector: Elector, work: Work, stop: asyncio.Event,
               liveness: str | None = None) -> bool:
    """Stand by until this replica holds the Lease, run `work` while it does, then stop it.
    True: stopped (by `stop`, or `work` ended: the Lease is released); False: the Lease was
    lost while leading (`work` stopped; the caller should exit non-zero, as client-go's
    controllers do). `liveness`: a URL like http://0.0.0.0:8080/healthz served throughout
    (standby and leader), 200 while this loop and the work run."""
    health = await _serve_health(liveness, elector) if liveness else None
    try:
        if not await elector.acquire(stop):
            return True
        work_stop = threading.Event()
        task = asyncio.create_task(work(work_stop))
        # renewals go on until the work has stopped (however long that takes), so no
        # standby takes over while it may still write
        done_keeping = asyncio.Event()
        keeper = asyncio.create_task(elector.keep(done_keeping))
        stopping = asyncio.create_task(stop.wait())
        if health is not None:
            health.work = task
        await asyncio.wait({task, keeper, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        work_stop.set()
        try:
            await task
        finally:
            done_keeping.set()
            kept = await keeper  # False: the lease was lost (the fence stopped the writes)
            if kept:
                await elector.release()
        return kept
    finally:
        if health is not None:
            await health.runner.cleanup()


@dataclass
class _Health:
    runner: Any
    work: asyncio.Task | None = None


async def _serve_health(url: str, elector: Elector) -> _Health:
    from aiohttp import web

    parsed = urlsplit(url)
    health = _Health(runner=None)

    async def healthz(_: web.Request) -> web.Response:
        if health.work is not None and health.work.done():
            return web.json_response({"ok": False, "leader": False}, status=503)
        return web.json_response({"ok": True, "leader": elector.leading(),
                                  "identity": elector.config.identity})

    app = web.Application()
    app.router.add_get(parsed.path or "/", healthz)
    health.runner = web.AppRunner(app, access_log=None)
    await health.runner.setup()
    await web.TCPSite(health.runner, parsed.hostname, parsed.port or 80).start()
    return health
