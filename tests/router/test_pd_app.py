"""P/D through the router app, in-process, against stub workers that answer `/ready` like
Tandem workers (roles, gRPC port, KV transfer backend): the header, the metrics, retries."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from tandem.protocol.signing import SIGNATURE_HEADER, SignatureError, WorkerKey, verify
from tandem.router.core import Router, RouterSettings
from tests.router.test_router_app import Served, router_app
from tests.serving.helpers import WORKER_KEY, free_port, worker_key_file

LONG = "The quick brown fox jumps over the lazy dog. " * 20  # ~225 tokens by text length


def stub_worker(name: str, role: str, seen: list, status: int = 200) -> tuple[FastAPI, str]:
    """A stub worker and its gRPC target (nothing listens there: no KV events, no load)."""
    app = FastAPI()
    grpc_port = free_port()

    @app.get("/ready")
    async def ready() -> dict:
        return {"status": "ready", "role": role, "model": "stub-model", "grpc_port": grpc_port,
                "kv_transfer_backend": "grpc", "block_size": 16}

    @app.post("/v1/completions")
    async def completions(body: dict, request: Request) -> Response:
        target = request.headers.get("x-tandem-prefill")
        seen.append((name, target))
        signature = request.headers.get(SIGNATURE_HEADER)
        if signature is not None or target is not None:  # as a Tandem worker checks it
            try:
                verify([WORKER_KEY], signature, await request.body(), target)
            except SignatureError as exc:
                return Response(str(exc), status_code=403)
        if status != 200:
            return Response(status_code=status)
        return Response(f'{{"choices": [{{"index": 0, "text": "{name}"}}]}}',
                        media_type="application/json")

    return app, f"127.0.0.1:{grpc_port}"


def counter(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture()
def cluster(request, tmp_path):
    """Stub workers behind a router app; `request.param`: RouterSettings fields, and
    `unsigned: True` for a router without a worker key."""
    params = dict(getattr(request, "param", {}))
    unsigned = params.pop("unsigned", False)
    seen: list = []
    apps = {"busy": stub_worker("busy", "decode", seen, status=503),
            "decode": stub_worker("decode", "decode", seen),
            "p1": stub_worker("p1", "prefill", seen), "p2": stub_worker("p2", "prefill", seen)}
    servers = {name: Served(app) for name, (app, _) in apps.items()}
    core = Router(RouterSettings(seed=0, **params), lambda model: None)
    key = None if unsigned else WorkerKey(worker_key_file(tmp_path))
    router = router_app([s.url for s in servers.values()], router=core, worker_key=key)
    router.core = core
    deadline = time.monotonic() + 10
    while httpx.get(router.url + "/ready", timeout=5).json().get("ready_workers", 0) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield router, seen, {name: target for name, (_, target) in apps.items()}
    router.stop()
    for s in servers.values():
        s.stop()


def post(router: Served, prompt: str) -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", timeout=10,
                      json={"model": "stub-model", "prompt": prompt, "max_tokens": 1})


def test_long_prompts_go_disaggregated_and_retries_keep_the_prefill_worker(cluster):
    router, seen, targets = cluster
    prefill_targets = {targets["p1"], targets["p2"]}
    retried = 0
    for n in range(1, 41):  # until "busy" (503) has been tried first a few times
        seen.clear()
        r = post(router, f"{n} {LONG}")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode"
        headers = [h for _, h in seen]
        assert headers[0] in prefill_targets
        assert all(h == headers[0] for h in headers), seen  # a retry keeps the prefill pick
        retried += len(seen) > 1
        if retried >= 2:
            break
    assert retried >= 2
    assert counter(router.url, "tandem_router_disaggregated_requests_total",
                   'backend="grpc"') == n
    assert counter(router.url, "tandem_router_aggregated_requests_total") == 0


def test_short_prompts_stay_aggregated(cluster):
    router, seen, _ = cluster
    for i in range(3):
        seen.clear()
        assert post(router, f"hi {i}").status_code == 200
        assert all(h is None for _, h in seen)
    assert counter(router.url, "tandem_router_aggregated_requests_total") == 3
    assert counter(router.url, "tandem_router_disaggregated_requests_total") == 0


@pytest.mark.parametrize("cluster", [{"pd_max_prefill_queue": 2}], indirect=True)
def test_a_saturated_prefill_pool_is_passed_over_then_served_aggregated(cluster):
    router, seen, _ = cluster
    workers = [w for w in router.core.workers.values() if w.role == "prefill"]
    assert len(workers) == 2  # their gRPC ports are closed: no GetLoad overwrites these
    workers[0].load.num_waiting = 5  # at the bound: passed over
    seen.clear()
    assert post(router, f"a {LONG}").status_code == 200
    assert {h for _, h in seen} == {workers[1].grpc_target}
    workers[1].load.num_running = 2  # now every prefill worker is at the bound
    seen.clear()
    assert post(router, f"b {LONG}").status_code == 200
    assert all(h is None for _, h in seen)
    assert counter(router.url, "tandem_router_aggregated_requests_total",
                   'reason="prefill_busy"') == 1


@pytest.mark.parametrize("cluster", [{"unsigned": True}], indirect=True)
def test_a_router_without_a_worker_key_never_names_a_prefill_worker(cluster):
    """Workers act on no unsigned prefill target, so an unsigned router serves long prompts
    aggregated, and says why."""
    router, seen, _ = cluster
    seen.clear()
    for n in range(3):
        assert post(router, f"{n} {LONG}").status_code == 200
    assert seen and all(h is None for _, h in seen)
    assert counter(router.url, "tandem_router_aggregated_requests_total",
                   'reason="unsigned"') == 3
    assert counter(router.url, "tandem_router_disaggregated_requests_total") == 0
