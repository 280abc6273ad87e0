"""Helpers the tests share: real worker processes on real ports (`start_worker`), the
worker-auth key every test worker and router shares, signed requests and channels, and
/metrics readers. Fixtures stay in the conftest modules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import httpx

from tandem.protocol.signing import (
    SIGNATURE_HEADER,
    WORKER_RPCS,
    rpc_body,
    sign,
    signed_headers,
)
from tandem.serving.ports import free_port

__all__ = ["WORKER_KEY", "WorkerProcess", "free_port", "metric", "signed", "signing_channel",
           "start_worker", "wait_for", "wait_idle", "worker_key_file"]
# the worker-auth key every test worker and router shares (`--worker-auth-key-file`)
WORKER_KEY = b"tandem-tests-worker-auth-key-0123456789abcdef"


def worker_key_file(tmp_path) -> str:
    """`WORKER_KEY` in a 0600 file under `tmp_path` (written once)."""
    path = tmp_path / "worker-auth.key"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_bytes(WORKER_KEY)
    return str(path)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = d.wait_for_ready, d.compression
        self.metadata = metadata


class _SignCalls(grpc.UnaryStreamClientInterceptor, grpc.UnaryUnaryClientInterceptor):
    def __init__(self, key: bytes) -> None:
        self.key = key

    def _signed(self, details, request):  # noqa: ANN001, ANN202
        metadata = list(details.metadata or ())
        target = f"grpc:{details.method}"
        if target in WORKER_RPCS:
            metadata.append((SIGNATURE_HEADER, sign(self.key, rpc_body(request), target)))
        return _Details(details, metadata)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._signed(details, request), request)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._signed(details, request), request)


def signing_channel(channel: grpc.Channel, key: bytes = WORKER_KEY) -> grpc.Channel:
    """`channel` whose `Worker` and `KVTransfer` calls are signed with `key`, as routers
    and decode workers sign them (workers with a key serve no other), each call anew."""
    return grpc.intercept_channel(channel, _SignCalls(key))


def signed(payload: dict, prefill: str | None = None,
           key: bytes = WORKER_KEY) -> tuple[bytes, dict[str, str]]:
    """(body, headers) as the router would send `payload` (with `prefill` as the P/D
    target): pass them as httpx's `content=` and `headers=`."""
    body = json.dumps(payload).encode()
    return body, {"Content-Type": "application/json", **signed_headers(key, body, prefill)}


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def start_worker(tmp_path, *args: str, wait_ready: bool = True,
                 auth: bool = True) -> WorkerProcess:
    """A worker process; with `auth` (unless `args` name one) it has `WORKER_KEY`."""
    port = free_port()
    log_path = str(tmp_path / f"worker-{port}.log")
    if auth and "--worker-auth-key-file" not in args:
        args = ("--worker-auth-key-file", worker_key_file(tmp_path), *args)
    cmd = [sys.executable, "-m", "tandem.cli", "worker", "--port", str(port),
           "--kv-cache-memory", str(256 << 20), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    worker = WorkerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    if wait_ready:
        wait_for(worker, "/ready", 200, timeout=180)
    return worker


def wait_for(worker: WorkerProcess, path: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited early:\n{worker.log()}")
        try:
            if httpx.get(worker.url + path, timeout=2).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{path} never returned {status}:\n{worker.log()}")


def metric(url: str, name: str) -> float:
    """A labelled sample's value from the worker's /metrics."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def wait_idle(url: str, within: float) -> None:
    """No running request and no KV block in use within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if (metric(url, "vllm:num_requests_running") == 0
                and metric(url, "vllm:kv_cache_usage_perc") == 0.0):
            return
        time.sleep(0.05)
    assert metric(url, "vllm:num_requests_running") == 0
    assert metric(url, "vllm:kv_cache_usage_perc") == 0.0
