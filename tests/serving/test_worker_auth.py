"""The worker plane's runtime security, with real processes on real sockets: a worker acts
on a prefill target or a tenant salt only when the router signed the request (else 403,
and no connection is ever opened to the named target); a router re-reads its API keys
file, so a revoked key stops working within the stated bound."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from tandem.protocol.bundled import BUNDLED_NAME
from tandem.protocol.signing import SIGNATURE_HEADER, sign, signed_headers
from tandem.router.auth import RELOAD_INTERVAL_S
from tandem.serving.api_server import ServerSettings, build_app
from tests.protocol.test_signing import kube_secret
from tests.router.test_router_integration import RouterProcess, _metric
from tests.serving.helpers import WORKER_KEY, free_port, signed, start_worker, wait_for

pytestmark = pytest.mark.slow
OTHER_KEY = b"not-the-cluster-key-0123456789abcdef"
PROMPT = list(range(1000, 1000 + 40))  # 2 blocks and change: a P/D request would fetch


def payload(**extra) -> dict:
    return {"model": BUNDLED_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    """A decode worker with the test key; a failed remote prefill is recomputed in 3 s."""
    tmp = tmp_path_factory.mktemp("auth")
    w = start_worker(tmp, "--role", "decode", "--grpc-port", str(free_port()),
                     "--num-threads", "1", "--num-kv-blocks", "128",
                     "--kv-transfer-timeout", "3", wait_ready=False)
    try:
        wait_for(w, "/ready", 200, timeout=240)
        yield w
    finally:
        w.stop()


@pytest.fixture()
def listener():
    """A TCP port a forged target names: the test sees every connection attempt."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=16)
    yield sock, f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def dialed(sock: socket.socket, within: float) -> bool:
    """A connection reached `sock` within `within` seconds (accepted and closed)."""
    ready, _, _ = select.select([sock], [], [], within)
    if ready:
        conn, _ = sock.accept()
        conn.close()
    return bool(ready)


def refused(r: httpx.Response, cause: str) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == 403 and err["type"] == "permission_error"
    assert err["param"] == SIGNATURE_HEADER and cause in err["message"], err


def post(url: str, body: bytes, headers: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, content=body, timeout=120,
                      headers={"Content-Type": "application/json", **headers})


def test_forged_prefill_targets_are_refused_without_a_dial(decode, listener):
    sock, target = listener
    body = json.dumps(payload()).encode()
    other = json.dumps(payload(max_tokens=3)).encode()
    elsewhere = f"127.0.0.1:{free_port()}"
    now = time.time()
    forgeries = {
        "missing": {"x-tandem-prefill": target},
        "malformed": {"x-tandem-prefill": target, SIGNATURE_HEADER: "t=1,v1=beef"},
        "bad": signed_headers(OTHER_KEY, body, target),  # the wrong key
        "bad ": {"x-tandem-prefill": target,  # signed for another body
                 SIGNATURE_HEADER: sign(WORKER_KEY, other, target)},
        "bad  ": {"x-tandem-prefill": target,  # signed for another target
                  SIGNATURE_HEADER: sign(WORKER_KEY, body, elsewhere)},
        "stale": signed_headers(WORKER_KEY, body, target, now=now - 120),
        "stale ": signed_headers(WORKER_KEY, body, target, now=now + 120),  # from the future
    }
    before = {r: _metric(decode.url, "tandem_worker_auth_rejected_total", f'reason="{r}"')
              for r in ("missing", "malformed", "bad", "stale")}
    for cause, headers in forgeries.items():
        refused(post(decode.url, body, headers), cause.strip())
    for path in ("/v1/chat/completions",):  # the chat route checks the same way
        chat = json.dumps({"model": BUNDLED_NAME, "max_tokens": 1,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        refused(post(decode.url, chat, {"x-tandem-prefill": target}, path), "missing")
    assert not dialed(sock, 1.0)  # no forgery made the worker connect anywhere
    after = {r: _metric(decode.url, "tandem_worker_auth_rejected_total", f'reason="{r}"')
             for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "missing": 2, "malformed": 1, "bad": 3, "stale": 2}

    # control: the same request, signed, does dial the target (and, as nothing speaks
    # gRPC there, is recomputed locally within the transfer timeout)
    r = post(decode.url, body, signed_headers(WORKER_KEY, body, target))
    assert r.status_code == 200, r.text
    assert dialed(sock, 5.0)


def test_a_forged_tenant_salt_is_refused(decode):
    for salt in ("tenant=other", "tenant=other;mine"):
        body = json.dumps(payload(cache_salt=salt)).encode()
        refused(post(decode.url, body, {}), "missing")
        refused(post(decode.url, body, signed_headers(OTHER_KEY, body)), "bad")
        r = post(decode.url, *signed(payload(cache_salt=salt)))  # as the router sends it
        assert r.status_code == 200, r.text
    chat = {"model": BUNDLED_NAME, "max_tokens": 1, "cache_salt": "tenant=other",
            "messages": [{"role": "user", "content": "hi"}]}
    refused(httpx.post(decode.url + "/v1/chat/completions", json=chat, timeout=60), "missing")


def test_unsigned_plain_requests_still_work(decode):
    for extra in ({}, {"cache_salt": "mine"}, {"cache_salt": "x;tenant=other"}):
        r = httpx.post(decode.url + "/v1/completions", json=payload(**extra), timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["text"]) > 0
    assert httpx.get(decode.url + "/health", timeout=10).status_code == 200


def test_a_worker_without_a_key_refuses_before_anything_else():
    """No key on this worker: both signed-only inputs are refused (403 naming the flag),
    ahead of the model check and the load state; a plain request gets the usual answer."""
    def load():
        raise RuntimeError("no engine in this test")

    with TestClient(build_app(ServerSettings(served_model_name="m"), load)) as client:
        for target, salt in (("127.0.0.1:1", None), (None, "tenant=a")):
            body, headers = signed({"model": "other", "prompt": "hi", "cache_salt": salt},
                                   target)  # signed, but this worker has no key to check
            r = client.post("/v1/completions", content=body, headers=headers)
            assert r.status_code == 403, r.text
            assert "no --worker-auth-key-file" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hi"}
                           ).status_code == 503  # loading failed: the usual answer


def test_prefill_rpc_without_a_key_serves_no_tenant_salt(tmp_path):
    """The gRPC side of the same rule, over a real socket: a prefill worker without a key
    refuses a Prefill call for a tenant's cache_salt (PERMISSION_DENIED, ahead of its load
    state), while another call gets the usual answer (still loading: UNAVAILABLE); with a
    key, an unsigned call is refused whatever its salt."""
    import asyncio

    import grpc

    from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service
    from tandem.protocol import worker_pb2
    from tandem.protocol.signing import WorkerKey
    from tests.serving.helpers import worker_key_file

    async def codes(key: WorkerKey | None) -> list[grpc.StatusCode]:
        server = grpc.aio.server()
        add_kv_transfer_service(server, KVTransferService(lambda: None, "m", "prefill",
                                                          key=key))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        got = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_stream("/tandem.v1.KVTransfer/Prefill",
                                       request_serializer=worker_pb2.PrefillRequest
                                       .SerializeToString,
                                       response_deserializer=worker_pb2.PageChunk.FromString)
                for salt in ("tenant=a", "", "shared"):
                    req = worker_pb2.PrefillRequest(request_id="r", model_id="m",
                                                    token_ids=[1, 2, 3], cache_salt=salt)
                    try:
                        [_ async for _ in call(req, timeout=10)]
                    except grpc.aio.AioRpcError as exc:
                        got.append(exc.code())
        finally:
            await server.stop(None)
        return got

    P, U = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(codes(None)) == [P, U, U]
    assert asyncio.run(codes(WorkerKey(worker_key_file(tmp_path)))) == [P, P, P]


# -- API keys: reloaded in a running router --------------------------------------------------
def completion_status(router_url: str, key: str) -> int:
    return httpx.post(router_url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": BUNDLED_NAME, "prompt": "hi", "max_tokens": 1}).status_code


def wait_status(router_url: str, key: str, status: int, within: float) -> float:
    """Seconds until `key` gets `status` (asserted within `within`)."""
    t0 = time.monotonic()
    while (got := completion_status(router_url, key)) != status:
        assert time.monotonic() - t0 < within, f"{key}: still {got}"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_rotated_api_keys_take_effect_without_a_restart(decode, tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    kube_secret(secret, "v1", {"api-keys": b"sk-old alpha\nsk-kept beta\n"})
    router = RouterProcess(tmp_path, [decode.url], "--api-keys", str(secret / "api-keys"))
    try:
        router.wait_events(1)  # up, and the worker is known
        wait_status(router.url, "sk-old", 200, within=30)
        assert completion_status(router.url, "sk-new") == 401
        kube_secret(secret, "v2", {"api-keys": b"sk-new alpha\nsk-kept beta\n"})  # rotation
        bound = RELOAD_INTERVAL_S + 1.5  # the reload interval, plus a request's latency
        assert wait_status(router.url, "sk-old", 401, within=bound) <= bound
        assert completion_status(router.url, "sk-new") == 200
        assert completion_status(router.url, "sk-kept") == 200

        kube_secret(secret, "v3", {"api-keys": b"sk-new alpha\nbroken line here\n"})
        deadline = time.monotonic() + RELOAD_INTERVAL_S + 1
        while time.monotonic() < deadline:  # past the interval: the last good keys stay
            assert completion_status(router.url, "sk-new") == 200
            time.sleep(0.2)
        assert _metric(router.url, "tandem_router_file_reload_errors",
                       'file="api_keys"') >= 1
        assert "keeping the last good API keys" in router.log()
    finally:
        router.stop()


def test_a_router_with_tenants_needs_a_worker_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-a alpha\n")
    short = tmp_path / "short.key"
    short.write_bytes(b"tiny")
    for args, message in (
            (["--api-keys", str(keys)], "--api-keys needs --worker-auth-key-file"),
            (["--worker-auth-key-file", str(short)], "at least 16 are needed")):
        proc = subprocess.run([sys.executable, "-m", "tandem.cli", "router", "--port",
                               str(free_port()), "--workers", "http://127.0.0.1:1", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
