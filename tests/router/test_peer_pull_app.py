"""Tier credits and peer pulls through the router app, in-process, against stub workers on
real sockets: each answers `/ready` as a Tandem worker (gRPC port, KV transfer backend, KV
dtype), streams KV events with media and reports measured load costs over gRPC
(`stub_worker.StubKV`), and checks the router's signature over the KV peer it is named
(`web.forward_target`), as a Tandem worker does."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from tandem.protocol import worker_pb2
from tandem.protocol.kv_events import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST
from tandem.protocol.signing import SIGNATURE_HEADER, SignatureError, WorkerKey, verify
from tandem.protocol.web import PEER_BLOCKS_HEADER, PEER_HEADER, forward_target
from tandem.router import prompt as prompts
from tandem.router.core import Router, RouterSettings
from tests.router.stub_worker import StubKV
from tests.router.test_pd_app import counter
from tests.router.test_router_app import Served, router_app
from tests.serving.helpers import WORKER_KEY, worker_key_file

BLOCKS = 16


def load(**kw: object) -> worker_pb2.Load:
    return worker_pb2.Load(prefill_s_per_token=1e-3, decode_step_s=1e-3, num_total_blocks=1000,
                           host_load_s_per_block=1e-3, disk_load_s_per_block=8e-3,
                           kv_block_bytes=1 << 20, **kw)


def worker_app(name: str, kv: StubKV, seen: list) -> FastAPI:
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> dict:
        return {"status": "ready", "role": "both", "model": "m", "grpc_port": kv.port,
                "kv_transfer_backend": "grpc", "kv_cache_dtype": "auto", "block_size": 16}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        peer = request.headers.get(PEER_HEADER)
        seen.append((name, peer, request.headers.get(PEER_BLOCKS_HEADER)))
        try:  # as `worker_auth.check_signature` does
            verify([WORKER_KEY], request.headers.get(SIGNATURE_HEADER), await request.body(),
                   forward_target(None, peer))
        except SignatureError as exc:
            return Response(str(exc), status_code=403)
        return Response(f'{{"choices": [{{"index": 0, "text": "{name}"}}]}}',
                        media_type="application/json")

    return app


@pytest.fixture()
def fleet(tmp_path):
    seen: list = []
    kvs = {n: StubKV(load()) for n in ("a", "b", "c")}
    servers = {n: Served(worker_app(n, kv, seen)) for n, kv in kvs.items()}
    core = Router(RouterSettings(policy="cost", seed=0, peer_pull=True), lambda model: None)
    router = router_app([s.url for s in servers.values()], router=core,
                        worker_key=WorkerKey(worker_key_file(tmp_path)))
    ids = {n: s.url for n, s in servers.items()}
    deadline = time.monotonic() + 60  # generous: a loaded CI worker starts servers slowly
    while not all(w.events_connected and w.load.kv_block_bytes
                  for w in core.workers.values()) or len(core.workers) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield router, core, kvs, ids, seen
    router.stop()
    for s in servers.values():
        s.stop()
    for kv in kvs.values():
        kv.stop()


def prompt(seed: int) -> tuple[list[int], list[bytes]]:
    ids = [seed * 1000 + i for i in range(BLOCKS * 16)]
    parsed = prompts.parse("completions", {"model": "m", "prompt": ids}, None)
    return ids, prompts.block_hashes(parsed, "m", 16)


def wait_indexed(router: Served, core: Router, chain: list[bytes],
                 want: dict[str, tuple]) -> None:
    """Until the router's index holds `want`, read on the router's own event loop: the index
    is written there and is not safe to read from another thread mid-write."""
    async def held() -> dict[str, tuple]:
        return {w: tuple(h) for w, h in core.index.match_media(chain, 0.0).items()}

    deadline = time.monotonic() + 60  # events cross two sockets: slow under a loaded suite
    while (got := asyncio.run_coroutine_threadsafe(held(), router.server.loop).result(10)) \
            != want:
        assert time.monotonic() < deadline, got
        time.sleep(0.02)


def post(router: Served, ids: list[int]) -> str:
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": ids,
                                                          "max_tokens": 1}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_media_events_and_measured_load_costs_order_host_over_disk(fleet):
    router, core, kvs, ids, seen = fleet
    assert core.workers[ids["b"]].load.host_load_s_per_block == pytest.approx(1e-3)
    tokens, chain = prompt(1)
    kvs["a"].send("stored", chain)  # on a's device, then evicted to its disk tier
    kvs["a"].send("removed", chain, MEDIUM_DEVICE)
    kvs["a"].send("stored", chain, MEDIUM_DISK)
    kvs["b"].send("stored", chain, MEDIUM_HOST)
    wait_indexed(router, core, chain, {ids["a"]: (0, 0, BLOCKS), ids["b"]: (0, BLOCKS, 0)})
    assert post(router, tokens) == "b"
    tokens, chain = prompt(2)
    kvs["b"].send("stored", chain, MEDIUM_HOST)
    kvs["c"].send("stored", chain)
    wait_indexed(router, core, chain, {ids["b"]: (0, BLOCKS, 0), ids["c"]: (BLOCKS, 0, 0)})
    assert post(router, tokens) == "c"
    assert all(peer is None for _, peer, _ in seen)  # every holder was free: no pull


def test_a_saturated_holder_is_named_as_the_signed_kv_peer(fleet):
    router, core, kvs, ids, seen = fleet
    kvs["a"].load = load(num_running=40, pending_prefill_tokens=100_000)
    deadline = time.monotonic() + 10
    while core.workers[ids["a"]].load.num_running != 40:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    tokens, chain = prompt(3)
    kvs["a"].send("stored", chain)
    wait_indexed(router, core, chain, {ids["a"]: (BLOCKS, 0, 0)})
    before = counter(router.url, "tandem_router_peer_pulls_total", 'medium="device"')
    name = post(router, tokens)
    assert name in ("b", "c")  # not the saturated holder, and signed: the stub said 200
    assert seen[-1] == (name, kvs["a"].target, str(BLOCKS))
    assert counter(router.url, "tandem_router_peer_pulls_total",
                   'medium="device"') == before + 1
    core.settings.peer_pull = False  # --no-peer-pull (or no worker key): no peer named
    assert post(router, prompt(4)[0]) in ("a", "b", "c") and seen[-1][1:] == (None, None)
