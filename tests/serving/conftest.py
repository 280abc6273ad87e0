"""Real worker processes on real ports, driven by real HTTP clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tandem.serving.ports import free_port

__all__ = ["free_port"]  # tests import it from here


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


def start_worker(tmp_path, *args: str, wait_ready: bool = True) -> WorkerProcess:
    port = free_port()
    log_path = str(tmp_path / f"worker-{port}.log")
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


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[WorkerProcess]:
    w = start_worker(tmp_path_factory.mktemp("worker"), "--max-n", "4")
    yield w
    assert w.stop() == 0, w.log()
