"""Which workers the router routes to: discovery's sets applied to `core.Router`, one
`WorkerMonitor` per worker that discovery reports ready.

Discovery calls `on_discovery` with its complete set; a worker it reports not ready leaves
routing at once, the rest is reconciled in order (one set at a time) by `sync_workers`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from tandem.protocol.signing import WorkerKey
from tandem.router.core import Router
from tandem.router.discovery import WorkerEndpoint
from tandem.router.index_store import RedisIndexStore
from tandem.router.monitor import MonitorSettings, WorkerMonitor
from tandem.router.probe import UpstreamProbe
from tandem.router.startup import StartupState
from tandem.router.workers import Worker


class Membership:
    """The router's workers and their monitors, kept in step with discovery.

    `http` gives the probes' client (it exists once the app has started); `monitors` maps a
    worker id to its monitor (only workers discovery reports ready are monitored)."""

    def __init__(self, router: Router, startup: StartupState, monitor: MonitorSettings,
                 http: Callable[[], httpx.AsyncClient | UpstreamProbe],
                 index_store: RedisIndexStore | None,
                 worker_key: WorkerKey | None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.router = router
        self.on_change = on_change  # workers or their state changed (flow control's kick)
        self.startup = startup
        self.monitor = monitor
        self.http = http
        self.index_store = index_store
        self.worker_key = worker_key
        self.monitors: dict[str, WorkerMonitor] = {}
        self.lock = asyncio.Lock()  # discovery's sets apply one at a time, in order
        self.syncing: set[asyncio.Task] = set()

    def add_worker(self, url: str, role: str = "both", monitored: bool = True) -> None:
        """Into routing (not routable until its monitor's probe says ready)."""
        w = Worker(id=url.rstrip("/"), role=role)
        self.router.add_worker(w)
        if monitored:
            self.monitors[w.id] = m = WorkerMonitor(w, self.router.index, self.http(),
                                                    self.monitor, self.index_store,
                                                    self.worker_key, self.on_change)
            m.start()

    async def remove_worker(self, worker_id: str) -> None:
        """Out of routing at once, then its monitor stops (its index entries go with both)."""
        self.router.remove_worker(worker_id)
        m = self.monitors.pop(worker_id, None)
        if m is not None:
            await m.stop()

    def on_discovery(self, endpoints: dict[str, WorkerEndpoint]) -> None:
        """Discovery's complete set: a worker reported not ready leaves routing at once, the
        rest is reconciled in order by `sync_workers`."""
        for ep in endpoints.values():
            w = self.router.workers.get(ep.url.rstrip("/"))
            if w is not None and not ep.ready:
                w.ready = False
        task = asyncio.create_task(self.sync_workers(endpoints))
        self.syncing.add(task)
        task.add_done_callback(self.syncing.discard)

    async def sync_workers(self, endpoints: dict[str, WorkerEndpoint]) -> None:
        """Add new workers (role from discovery, probed only once ready), remove vanished
        ones. While discovery says not ready a worker is kept but not probed (its probe must
        not bring it back); ready again, it rejoins as a fresh worker."""
        want = {ep.url.rstrip("/"): ep for ep in endpoints.values()}
        router, monitors = self.router, self.monitors
        async with self.lock:
            self.startup.observe(router.workers.values())  # models served before, kept
            for wid in [wid for wid in router.workers if wid not in want]:
                await self.remove_worker(wid)
            for wid, ep in want.items():
                w = router.workers.get(wid)
                if w is not None and ep.ready and wid not in monitors:
                    await self.remove_worker(wid)
                    w = None
                if w is None:
                    self.add_worker(wid, ep.role, monitored=ep.ready)
                elif not ep.ready and wid in monitors:
                    await monitors.pop(wid).stop()
                    w.ready = False  # a probe may have answered meanwhile
            self.startup.synced = True
        if self.on_change is not None:
            self.on_change()

    async def stop(self, watcher: asyncio.Task) -> None:
        """Cancel discovery's `watcher` and any pending sync, then stop every monitor."""
        for task in (watcher, *self.syncing):
            task.cancel()
        await asyncio.gather(watcher, *self.syncing, return_exceptions=True)
        await asyncio.gather(*(m.stop() for m in self.monitors.values()))
