"""The readiness probes over the router's own upstream pool (`probe.UpstreamProbe`), against
raw asyncio servers on real sockets: answers, keep-alive reuse, the timeout, the size bound,
and `WorkerMonitor.probe` through it (a Tandem `/ready`, a stock server's fallback, a hung
worker)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.router import probe as probe_mod
from tandem.router.index import PrefixIndex
from tandem.router.monitor import MonitorSettings, WorkerMonitor
from tandem.router.probe import ProbeAnswer, UpstreamProbe
from tandem.router.routes import RouterApp
from tandem.router.upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from tandem.router.workers import Worker
from tests.router.test_upstream import read_request, serve


def answer(status: str, payload: object) -> bytes:
    body = json.dumps(payload).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def routes(table: dict[str, bytes], seen: list[bytes]):
    """A keep-alive handler answering each request line's path from `table` (404 else)."""
    async def handler(reader, writer):
        while True:
            line, _, body = await read_request(reader)
            seen.append(line)
            assert body == b""
            path = line.split(b" ")[1].decode()
            writer.write(table.get(path, answer("404 Not Found", {"detail": "Not Found"})))
            await writer.drain()
    return handler


READY = {"status": "ready", "role": "decode", "model": "m", "models": ["m", "alias"],
         "block_size": 32, "max_model_len": 4096}


def test_probes_answer_status_and_json_over_one_kept_alive_connection():
    async def main():
        seen: list[bytes] = []
        table = {"/ready": answer("200 OK", READY),
                 "/ready?x=1": answer("503 Service Unavailable", {"status": "loading"})}
        async with serve(routes(table, seen)) as (url, accepted):
            pool = UpstreamPool()
            probe = UpstreamProbe(pool)
            got = [await probe.get(f"{url}/ready", timeout=2) for _ in range(3)]
            assert got == [ProbeAnswer(200, json.dumps(READY).encode())] * 3
            assert got[0].json() == READY
            loading = await probe.get(f"{url}/ready?x=1", timeout=2)
            assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
            missing = await probe.get(f"{url}/nope", timeout=2)
            assert missing.status_code == 404
            assert seen == [b"GET /ready HTTP/1.1"] * 3 + [b"GET /ready?x=1 HTTP/1.1",
                                                           b"GET /nope HTTP/1.1"]
            assert len(accepted) == 1 and pool.opened == 1  # one keep-alive connection
            await pool.close()

    asyncio.run(main())


def test_a_hung_or_oversized_answer_fails_and_its_connection_is_not_reused(monkeypatch):
    async def main():
        async def hang(reader, writer):
            await read_request(reader)
            await asyncio.sleep(30)

        async with serve(hang) as (url, accepted):
            pool = UpstreamPool()
            t = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamTimeout, match="took over 0.2 s"):
                await UpstreamProbe(pool).get(f"{url}/ready", timeout=0.2)
            assert 0.15 < asyncio.get_running_loop().time() - t < 1.5
            assert pool._idle.get(pool._target(url)[:2], []) == []  # closed, not pooled
            await pool.close()

        monkeypatch.setattr(probe_mod, "MAX_PROBE_BYTES", 1000)
        seen: list[bytes] = []
        big = answer("200 OK", {"data": "x" * 2000})
        async with serve(routes({"/v1/models": big}, seen)) as (url, accepted):
            pool = UpstreamPool()
            with pytest.raises(UpstreamError, match="over 1000 bytes"):
                await UpstreamProbe(pool).get(f"{url}/v1/models", timeout=2)
            assert pool._idle.get(pool._target(url)[:2], []) == []
            await pool.close()

        with pytest.raises(UpstreamError, match="cannot connect"):
            await UpstreamProbe(UpstreamPool()).get("http://127.0.0.1:1/ready", timeout=2)

    asyncio.run(main())


def test_the_monitor_probes_through_the_upstream_pool():
    async def main():
        seen: list[bytes] = []
        pool = UpstreamPool()
        async with serve(routes({"/ready": answer("200 OK", READY)}, seen)) as (url, _):
            w = Worker(id=url)
            mon = WorkerMonitor(w, PrefixIndex(), UpstreamProbe(pool), MonitorSettings())
            await mon.probe()
            assert (w.ready, w.model, w.aliases, w.role, w.block_size, w.max_model_len) == (
                True, "m", frozenset({"alias"}), "decode", 32, 4096)
        # a stock server (no /ready): /health and /v1/models, approximate mode
        models = {"object": "list", "data": [{"id": "stock", "max_model_len": 2048}]}
        table = {"/health": answer("200 OK", {}), "/v1/models": answer("200 OK", models)}
        async with serve(routes(table, seen)) as (url, _):
            w = Worker(id=url)
            await WorkerMonitor(w, PrefixIndex(), UpstreamProbe(pool), MonitorSettings()).probe()
            assert (w.ready, w.model, w.max_model_len) == (True, "stock", 2048)
            assert seen[-3:] == [b"GET /ready HTTP/1.1", b"GET /health HTTP/1.1",
                                 b"GET /v1/models HTTP/1.1"]

        async def hang(reader, writer):
            await read_request(reader)
            await asyncio.sleep(30)

        async with serve(hang) as (url, _):
            w = Worker(id=url, ready=True)
            mon = WorkerMonitor(w, PrefixIndex(), UpstreamProbe(pool),
                                MonitorSettings(probe_timeout_s=0.2))
            await mon.probe()
            assert not w.ready  # a probe that timed out marks it unready
            since = w.unreachable_since  # ... and unreachable (no answer at all), from then
            assert since is not None
            await mon.probe()
            assert w.unreachable_since == since
        # a draining worker answers (503): unready, but reachable
        draining = answer("503 Service Unavailable", {"status": "draining", "model": "m"})
        async with serve(routes({"/ready": draining}, seen)) as (url, _):
            w = Worker(id=url, ready=True, unreachable_since=1.0)
            await WorkerMonitor(w, PrefixIndex(), UpstreamProbe(pool), MonitorSettings()).probe()
            assert not w.ready and w.unreachable_since is None
        await pool.close()

    asyncio.run(main())


def test_the_router_app_gives_its_monitors_the_upstream_prober():
    from tandem.router.app import RouterServerSettings
    from tandem.router.core import Router, RouterSettings

    ra = RouterApp(Router(RouterSettings(seed=0), lambda model: None), RouterServerSettings())
    ra.upstream = UpstreamPool()
    prober = ra.membership.http()
    assert isinstance(prober, UpstreamProbe) and prober.pool is ra.upstream
