"""The shared prefix index in a real redis-server: ordered idempotent writes from several
replicas, snapshot repair, millisecond fallback, and a fresh router warm from Redis alone."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from tandem.protocol.block_hash import HashKeys, hash_block_chain
from tandem.router.app import RouterServerSettings, build_app
from tandem.router.core import Router, RouterSettings
from tandem.router.index import block_key
from tandem.router.index_store import IndexEvent, IndexView, KVWrite, RedisIndexStore
from tandem.router.monitor import MonitorSettings
from tandem.router.proxy import ProxySettings
from tests.serving.helpers import free_port

from .test_router_app import Served, _wait_ready, stub_openai

A = hash_block_chain(list(range(96)), 16)  # 6 blocks
B = hash_block_chain(list(range(500, 596)), 16)


def _run(coro):
    return asyncio.run(coro)


def _events(start: int, *evs: tuple[str, list[bytes]]) -> list[IndexEvent]:
    return [IndexEvent(start + i, kind, hs) for i, (kind, hs) in enumerate(evs)]


def test_replicas_writing_one_stream_at_different_times_converge(redis_url):
    async def run() -> None:
        r1 = RedisIndexStore(redis_url, prefix="t-conv:")
        r2 = RedisIndexStore(redis_url, prefix="t-conv:")
        try:
            snap = KVWrite("w1", "inst-a", 10, snapshot=A[:2])
            batch1 = KVWrite("w1", "inst-a", 12, events=_events(11, ("stored", A[2:4]),
                                                                  ("removed", [A[0]])))
            batch2 = KVWrite("w1", "inst-a", 13, events=_events(13, ("stored", A[:1])))
            assert await r1._write(snap) == 1
            assert await r1._write(batch1) == 1
            assert await r1._write(batch2) == 1
            # the slow replica replays the same stream late: every write is a no-op
            assert await r2._write(snap) == 0
            assert await r2._write(batch1) == 0
            # a batch overlapping the applied seq is applied from the first new event only
            both = KVWrite("w1", "inst-a", 14, events=_events(13, ("stored", A[:1]),
                                                                ("stored", A[4:6])))
            assert await r2._write(both) == 1
            for store in (r1, r2):
                assert await store.match(A, ["w1"]) == {"w1": 6}
            # a gap or an unknown instance asks for a snapshot instead of guessing
            gap = KVWrite("w1", "inst-a", 20, events=_events(20, ("removed", A[:1])))
            assert await r1._write(gap) == -1
            other = KVWrite("w1", "inst-b", 1, events=_events(1, ("cleared", [])))
            assert await r1._write(other) == -1
            # a restarted worker (new instance) replaces everything through its snapshot
            assert await r1._write(KVWrite("w1", "inst-b", 0, snapshot=B)) == 1
            assert await r2.match(A, ["w1"]) == {}
            assert await r2.match(B, ["w1", "w2"]) == {"w1": 6}
            cleared = KVWrite("w1", "inst-b", 1, events=_events(1, ("cleared", [])))
            assert await r2._write(cleared) == 1
            assert await r1.match(B, ["w1"]) == {}
        finally:
            await r1.close()
            await r2.close()

    _run(run())


def test_match_counts_leading_blocks_per_worker_and_filters_workers(redis_url):
    async def run() -> None:
        s = RedisIndexStore(redis_url, prefix="t-match:")
        try:
            await s._write(KVWrite("w1", "i", 0, snapshot=A[:3]))
            await s._write(KVWrite("w2", "i", 0, snapshot=[A[0], A[2], A[3]]))  # a hole
            await s._write(KVWrite("w3", "i", 0, snapshot=A))
            assert await s.match(A, ["w1", "w2", "w3"]) == {"w1": 3, "w2": 1, "w3": 6}
            assert await s.match(A, ["w1", "w2"]) == {"w1": 3, "w2": 1}
            assert await s.match(B, ["w1", "w2", "w3"]) == {}
        finally:
            await s.close()

    _run(run())


def test_writer_repairs_lost_writes_from_the_in_memory_view(redis_url):
    """Writes that hit a gap are replaced by the memory index's current view of the worker."""

    async def run() -> None:
        s = RedisIndexStore(redis_url, prefix="t-repair:")
        view = {"w1": IndexView("inst", 42, {block_key(h) for h in B[:4]})}
        s.start(view.get)
        try:
            s.publish(KVWrite("w1", "inst", 42, events=_events(40, ("stored", A))))  # a gap
            await s.flush()
            assert await s.match(B, ["w1"]) == {"w1": 4}
            assert await s.match(A, ["w1"]) == {}
            assert s.stats["rewrites"] == 1
        finally:
            await s.close()

    _run(run())


class _Silent:
    """A TCP server that accepts connections and never answers: a hung Redis."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("kind", ["refused", "hung"])
def test_a_dead_or_hung_redis_costs_milliseconds_then_is_skipped(kind):
    silent = _Silent() if kind == "hung" else None
    port = silent.port if silent else free_port()

    async def run() -> None:
        s = RedisIndexStore(f"redis://127.0.0.1:{port}/0", lookup_timeout_s=0.005,
                            retry_after_s=30)
        try:
            t = time.perf_counter()
            assert await s.match(A, ["w1"]) is None
            first = time.perf_counter() - t
            t = time.perf_counter()
            assert await s.match(A, ["w1"]) is None  # skipped during the back-off
            second = time.perf_counter() - t
        finally:
            await s.close()
        assert first < 0.05, first  # the 5 ms budget plus scheduling, never a stall
        assert second < 0.001, second

    try:
        _run(run())
    finally:
        if silent:
            silent.close()


@pytest.mark.parametrize("holder", [0, 1])
def test_a_fresh_router_routes_on_the_shared_index_before_hearing_any_worker(redis_url, holder):
    """Workers without KV streams (stubs) would be cold for a new router; with the shared
    store it sends a known prefix straight to the worker Redis says holds it (either one:
    a cold pick can be right for only one of the two cases)."""
    seen_a: list = []
    seen_b: list = []
    a, b = Served(stub_openai("stub", seen_a)), Served(stub_openai("stub", seen_b))
    if holder == 0:
        a, b, seen_a, seen_b = b, a, seen_b, seen_a
    prompt = list(range(1000, 1000 + 160))  # 10 blocks of 16
    chain = hash_block_chain(prompt, 16, HashKeys(model_id="stub-model"))

    async def seed() -> None:  # what another replica wrote from b's event stream
        s = RedisIndexStore(redis_url, prefix=f"t-fresh{holder}:")
        await s._write(KVWrite(b.url, "inst", 0, snapshot=chain[:8]))
        await s.close()

    _run(seed())
    router = None
    try:
        store = RedisIndexStore(redis_url, prefix=f"t-fresh{holder}:", lookup_timeout_s=0.05)
        core = Router(RouterSettings(seed=0), lambda model: None)
        router = Served(build_app(core, RouterServerSettings(
            worker_urls=[a.url, b.url], index_store=store,
            monitor=MonitorSettings(probe_interval_s=0.1),
            proxy=ProxySettings(debug_headers=True))))  # x-tandem-worker
        _wait_ready(router.url, 2)
        for _ in range(3):
            r = httpx.post(router.url + "/v1/completions", timeout=10, json={
                "model": "stub-model", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-tandem-worker"] == b.url
        assert len(seen_b) == 3 and not seen_a
        metrics = httpx.get(router.url + "/metrics", timeout=5).text
        assert 'tandem_router_index_store_lookups_total{result="ok"} 3.0' in metrics
    finally:
        if router:
            router.stop()
        a.stop()
        b.stop()
