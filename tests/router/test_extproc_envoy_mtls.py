"""Through a real Envoy (`test_extproc_envoy`'s configuration): the endpoint picker's port
under mutual TLS with an allowed client identity, Envoy's ext_proc cluster presenting its
client certificate (an UpstreamTlsContext: certificate, key and the picker's CA) for the
ext_proc stream and its gRPC health check alike; and a worker that drops every request
before its status line is answered 503 by Envoy itself, an answer the picker sees in the
response phase and counts against that worker's circuit breaker, so the next picks skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
import yaml

from tandem.router.extproc.settings import ExtProcSettings
from tandem.router.workers import BreakerState
from tests.protocol.certs import CA
from tests.router.extproc_client import EppRouter
from tests.router.stub_worker import StubWorker
from tests.router.test_extproc_envoy import (  # noqa: F401 (envoy_bin: a fixture)
    CONFIG,
    TYPES,
    envoy_bin,
    running_envoy,
)
from tests.serving.helpers import free_port

ENVOY_ID = "spiffe://cluster.local/ns/gateway/sa/envoy"


class DroppingWorker:
    """`/ready` as a Tandem worker answers it; any other request: the connection closed
    before a status line (as a worker that crashed mid-request)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve() -> None:
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            started.set()
            with contextlib.suppress(asyncio.CancelledError):  # closed by `stop`
                await self.server.serve_forever()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),),
                                       daemon=True)
        self.thread.start()
        assert started.wait(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        if head.startswith(b"GET /ready "):
            body = json.dumps({"status": "ready", "role": "both", "model": "stub-model",
                               "block_size": 16, "max_model_len": 400}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
        else:
            self.dropped += 1
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)


def _config(listen: int, epp: int, tls: dict[str, str]) -> str:
    """The extension chart's Envoy, its ext_proc cluster over mutual TLS."""
    doc = yaml.safe_load(CONFIG.format(listen=listen, epp=epp, types=TYPES))
    (cluster,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "ext_proc"]
    cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": f"{TYPES}.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": "localhost",
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "tls_certificates": [{"certificate_chain": {"filename": tls["cert"]},
                                  "private_key": {"filename": tls["key"]}}],
            "validation_context": {"trusted_ca": {"filename": tls["ca"]}}}}}
    return yaml.safe_dump(doc)


@pytest.fixture(scope="module")
def mtls_gateway(envoy_bin, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("envoy-mtls")
    ca = CA("epp-mtls-ca")
    files = {"ca.crt": ca.pem}
    files["epp.crt"], files["epp.key"] = ca.issue("epp")
    files["envoy.crt"], files["envoy.key"] = ca.issue("envoy", sans=(ENVOY_ID,))
    for name, data in files.items():
        (d / name).write_bytes(data)
    good, dropping = StubWorker(free_port()), DroppingWorker()
    router = EppRouter([good.url, dropping.url], ext=ExtProcSettings(
        port=0, host="127.0.0.1", tls_cert=str(d / "epp.crt"), tls_key=str(d / "epp.key"),
        tls_client_ca=str(d / "ca.crt"), allowed_clients=(ENVOY_ID,)))
    router.wait_routable(2)
    listen = free_port()
    path = d / "envoy.yaml"
    path.write_text(_config(listen, router.port, {"cert": str(d / "envoy.crt"),
                                                  "key": str(d / "envoy.key"),
                                                  "ca": str(d / "ca.crt")}))
    try:
        with running_envoy(envoy_bin, path, listen) as url:
            yield url, good, dropping, router
    finally:
        router.stop()
        good.stop()
        dropping.stop()


def _post(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": "stub-model", "prompt": prompt, "max_tokens": 5})


def test_envoy_with_a_client_certificate_uses_the_picker_and_skips_a_failing_worker(
        mtls_gateway) -> None:
    url, good, dropping, router = mtls_gateway
    breaker = router.ra.router.workers[dropping.url].breaker
    deadline = time.monotonic() + 15
    while True:  # until Envoy's health check (over mutual TLS) has found the picker
        resp = _post(url, "warm up")
        if "no healthy upstream" not in resp.text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    statuses = [resp.status_code]
    for i in range(40):
        if breaker.state is BreakerState.OPEN:
            break
        statuses.append(_post(url, f"spread {i} " * 3).status_code)
    # Envoy's own 503s for the dropped requests opened the dropping worker's breaker
    assert breaker.state is BreakerState.OPEN, statuses
    assert statuses.count(503) == dropping.dropped == breaker.threshold, statuses
    assert set(statuses) == {200, 503} and len(good.bodies) == statuses.count(200)
    for i in range(6):  # the next picks skip it
        assert _post(url, f"after {i} " * 3).status_code == 200
    assert dropping.dropped == breaker.threshold
    streams = router.metric("tandem_router_extproc_streams_total")
    assert streams == len(statuses) + 6  # every request went through the picker, over mTLS
