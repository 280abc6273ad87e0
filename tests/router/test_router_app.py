"""The router app in-process against stub OpenAI servers (no KV events: approximate mode),
and its auth, over real sockets."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tandem.protocol.http_server import LeanServer, ServerLimits
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey, verify
from tandem.protocol.web import FastPaths
from tandem.router.app import RouterServerSettings, build_app
from tandem.router.auth import ApiKeys, tenant_cache_salt
from tandem.router.core import Router, RouterSettings
from tandem.router.monitor import MonitorSettings
from tandem.router.proxy import ProxySettings
from tests.serving.helpers import WORKER_KEY, free_port, worker_key_file


class Served:
    """An ASGI app on a real port, in a thread: a `FastPaths` app on the lean server the
    router runs in production (`protocol.http_server`), anything else on uvicorn."""

    def __init__(self, app, lean: bool | None = None,
                 limits: ServerLimits | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if lean if lean is not None else isinstance(app, FastPaths):
            self.server = LeanServer(app, "127.0.0.1", self.port, limits)
            self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),),
                                           daemon=True)
        else:
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                        log_level="warning"))
            self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def stop(self) -> None:
        if isinstance(self.server, LeanServer):
            self.server.loop.call_soon_threadsafe(self.server.stop)
        else:
            self.server.should_exit = True
        self.thread.join(timeout=10)


signed: list[tuple[bytes, str | None]] = []  # (body, x-tandem-signature) stubs received


def stub_base() -> FastAPI:
    """A stock OpenAI server's /health and /v1/models (serving `stub-model`), as the router
    probes them; no /ready and no KV events."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    return app


def stub_openai(name: str, seen: list) -> FastAPI:
    """What a stock vLLM server looks like to the router: `stub_base` and completions."""
    app = stub_base()

    @app.post("/v1/completions")
    async def completions(body: dict, request: Request) -> dict:
        seen.append((name, body))
        signed.append((await request.body(), request.headers.get(SIGNATURE_HEADER)))
        return {"id": "x", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": name, "finish_reason": "length"}]}

    return app


def router_app(workers: list[str], keys: dict[str, str] | None = None,
               router: Router | None = None, worker_key: WorkerKey | None = None,
               debug_headers: bool = False, limits: ServerLimits | None = None,
               **settings) -> Served:
    """The router app on the lean server; `settings`: more `RouterServerSettings` fields."""
    router = router or Router(RouterSettings(seed=0), lambda model: None)  # text hashes
    server = RouterServerSettings(worker_urls=workers, api_keys=ApiKeys(keys or {}),
                                  monitor=MonitorSettings(probe_interval_s=0.1),
                                  worker_key=worker_key,
                                  proxy=ProxySettings(debug_headers=debug_headers), **settings)
    return Served(build_app(router, server), limits=limits)


@pytest.fixture()
def stubs():
    seen: list = []
    servers = [Served(stub_openai(f"stub{i}", seen)) for i in range(3)]
    yield servers, seen
    for s in servers:
        s.stop()


def _wait_ready(url: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(url + "/ready", timeout=5).json().get("ready_workers", 0) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_approximate_mode_keeps_a_prompt_on_one_stock_server(stubs):
    servers, seen = stubs
    router = router_app([s.url for s in servers])
    try:
        _wait_ready(router.url, 3)
        long_a = "Shared system prompt A. " * 60
        long_b = "Another long prefix B! " * 60
        answers_a = {httpx.post(router.url + "/v1/completions", timeout=10, json={
            "model": "stub-model", "prompt": long_a + f"question {i}"}).json()["choices"][0][
            "text"] for i in range(6)}
        answers_b = {httpx.post(router.url + "/v1/completions", timeout=10, json={
            "model": "stub-model", "prompt": long_b + f"question {i}"}).json()["choices"][0][
            "text"] for i in range(6)}
        assert len(answers_a) == 1 and len(answers_b) == 1
        assert len(seen) == 12
        # a body above 32 KiB is parsed off the event loop; it routes the same way
        huge = "A very long shared document. " * 1500
        answers = {httpx.post(router.url + "/v1/completions", timeout=10, json={
            "model": "stub-model", "prompt": huge + f"q{i}"}).json()["choices"][0]["text"]
            for i in range(3)}
        assert len(answers) == 1 and len(seen) == 15
    finally:
        router.stop()


def test_a_dead_backend_is_retried_elsewhere_before_the_first_byte(stubs):
    servers, seen = stubs
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = router_app([dead, servers[0].url], debug_headers=True)
    try:
        _wait_ready(router.url, 1)
        # the dead one never passes readiness, so it is not even tried
        for i in range(4):
            r = httpx.post(router.url + "/v1/completions", timeout=10,
                           json={"model": "stub-model", "prompt": f"p{i}"})
            assert r.status_code == 200 and r.headers["x-tandem-worker"] == servers[0].url
        servers[0].stop()  # now the only ready one dies: a clean 502/503, no hang
        r = httpx.post(router.url + "/v1/completions", timeout=10,
                       json={"model": "stub-model", "prompt": "after"})
        assert r.status_code in (502, 503) and r.json()["error"]["message"]
    finally:
        router.stop()


def test_a_429_is_retried_elsewhere_and_its_worker_is_not_charged(stubs):
    servers, seen = stubs
    busy_seen: list = []
    busy = stub_openai("busy", busy_seen)

    @busy.middleware("http")
    async def always_429(request, call_next):  # noqa: ANN001, ANN202
        if request.url.path == "/v1/completions":
            busy_seen.append(request.url.path)
            return JSONResponse({"error": {"message": "full", "code": 429}}, status_code=429)
        return await call_next(request)

    busy_server = Served(busy)
    router = Router(RouterSettings(seed=0), lambda model: None)
    served = router_app([busy_server.url, servers[0].url], router=router, debug_headers=True)
    try:
        _wait_ready(served.url, 2)
        for i in range(6):  # new prompts: the load tie goes either way, so some hit `busy`
            r = httpx.post(served.url + "/v1/completions", timeout=10,
                           json={"model": "stub-model", "prompt": f"fresh prompt {i} " * 40})
            assert r.status_code == 200 and r.headers["x-tandem-worker"] == servers[0].url
        assert busy_seen  # it was tried, answered 429, and the retry went elsewhere
        now = time.monotonic()
        assert router.churn.value(busy_server.url, now) == 0.0  # charged, then refunded
        assert router.churn.value(servers[0].url, now) > 0
    finally:
        served.stop()
        busy_server.stop()


def test_api_keys_and_tenant_salts(stubs, tmp_path):
    servers, seen = stubs
    with pytest.raises(ValueError, match="need a worker auth key"):
        router_app([servers[0].url], keys={"sk-alpha": "alpha"})
    key = WorkerKey(worker_key_file(tmp_path))
    router = router_app([servers[0].url], keys={"sk-alpha": "alpha", "sk-beta": "beta"},
                        worker_key=key)
    try:
        _wait_ready(router.url, 1)
        body = {"model": "stub-model", "prompt": "hi", "cache_salt": "mine"}
        assert httpx.post(router.url + "/v1/completions", json=body).status_code == 401
        r = httpx.post(router.url + "/v1/completions", json=body,
                       headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(router.url + "/v1/models").status_code == 401
        assert httpx.get(router.url + "/health").status_code == 200  # probes need no key
        deep = httpx.post(router.url + "/v1/completions", content=b"[" * 200_000,
                          headers={"Authorization": "Bearer sk-beta",
                                   "Content-Type": "application/json"})
        assert deep.status_code == 400 and "deeply" in deep.json()["error"]["message"]
        r = httpx.get(router.url + "/metrics")  # with keys, /metrics needs one too
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(router.url + "/metrics",
                         headers={"Authorization": "Bearer sk-beta"}).status_code == 200
        r = httpx.post(router.url + "/v1/completions", json=body,
                       headers={"Authorization": "Bearer sk-beta"})
        assert r.status_code == 200
        salt = tenant_cache_salt("beta", "mine", WORKER_KEY)
        assert salt.startswith("tenant=beta;ns=") and salt.endswith(";mine")
        assert seen[-1][1]["cache_salt"] == salt  # the worker sees the keyed salt
        body, signature = signed[-1]  # signed over the exact bytes the worker got
        verify([WORKER_KEY], signature, body, None)
        assert json.loads(body)["cache_salt"] == salt
    finally:
        router.stop()


def test_tenant_salt_cannot_be_forged():
    k = WORKER_KEY
    assert tenant_cache_salt(None, "x", k) == "x"
    assert tenant_cache_salt("a", None) == "tenant=a"
    # a client of tenant a cannot reach tenant b's namespace with its own salt
    assert tenant_cache_salt("a", "tenant=b", k) != tenant_cache_salt("b", None, k)
    assert not tenant_cache_salt("a", "x;tenant=b", k).startswith("tenant=b")
    # keyed: the same under one key, unrelated under another, never the bare name
    rng = random.Random(3)
    names = {"".join(rng.choice("abcdefgh.-_0") for _ in range(rng.randint(1, 12)))
             for _ in range(500)}
    salts = {tenant_cache_salt(t, None, k) for t in names}
    assert len(salts) == len(names)  # one namespace per tenant
    for t in list(names)[:50]:
        s = tenant_cache_salt(t, None, k)
        assert s == tenant_cache_salt(t, None, k) and s.startswith(f"tenant={t};ns=")
        assert s != tenant_cache_salt(t, None, b"another-key-0123456789")
        assert s != tenant_cache_salt(t, None)  # not computable from the name alone


def test_bad_keys_file_is_rejected(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-1 alpha\n# comment\n\nsk-2 beta  # trailing\n")
    keys = ApiKeys.from_file(f)
    assert keys.tenant("Bearer sk-2") == "beta"
    f.write_text("sk-1 al;pha\n")
    with pytest.raises(ValueError, match="TENANT"):
        ApiKeys.from_file(f)


def test_adapter_loads_need_a_lora_worker_and_an_admin_key(stubs, tmp_path):
    """Through the router: with no worker serving LoRA a load is 400 (not a retry later);
    with API keys on, a tenant key is 403 and a missing key 401."""
    servers, _ = stubs
    router = router_app([s.url for s in servers[:1]])
    try:
        _wait_ready(router.url, 1)
        r = httpx.post(router.url + "/v1/load_lora_adapter", timeout=10,
                       json={"lora_name": "x", "lora_path": "x"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        bad = httpx.post(router.url + "/v1/unload_lora_adapter", timeout=10, json={"x": 1})
        assert bad.status_code == 400 and "lora_name" in bad.json()["error"]["message"]
    finally:
        router.stop()
    keyed = router_app([s.url for s in servers[:1]], keys={"sk-tenant": "acme"},
                       worker_key=WorkerKey(worker_key_file(tmp_path)))
    try:
        for headers, status in (({}, 401), ({"Authorization": "Bearer sk-tenant"}, 403)):
            r = httpx.post(keyed.url + "/v1/load_lora_adapter", timeout=10, headers=headers,
                           json={"lora_name": "x", "lora_path": "x"})
            assert r.status_code == status, r.text
    finally:
        keyed.stop()
