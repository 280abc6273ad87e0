"""`tandem router --processes 2`: two real router processes share one port (SO_REUSEPORT)
behind a supervisor; both serve, /metrics from either counts every process's requests, and
SIGTERM stops them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi import Request

from tests.router.test_router_app import Served, stub_openai
from tests.serving.helpers import free_port


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def requests_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_router_requests_total{"))


def test_two_processes_share_the_port_and_the_metrics(tmp_path):
    seen: list = []
    peers: list[tuple[str, int]] = []
    app = stub_openai("w0", seen)

    @app.middleware("http")
    async def record_peer(request: Request, call_next):  # noqa: ANN001, ANN202
        if request.url.path == "/v1/completions":
            peers.append(request.client)
        return await call_next(request)

    stub = Served(app)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "router.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "router", "--port", str(port),
                             "--workers", stub.url, "--processes", "2"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        ready = 0
        while ready < 10:  # both children must be up: several fresh connections in a row
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()
            try:
                ok = httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            ready = ready + 1 if ok else 0
            time.sleep(0.05 if ok else 0.2)
        kids = children_of(proc.pid)
        assert len(kids) == 2
        n = 40
        for i in range(n):  # a fresh connection each: the kernel spreads them over both
            r = httpx.post(url + "/v1/completions", timeout=10,
                           json={"model": "stub-model", "prompt": f"hello {i}", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "w0"
        assert len(seen) == n
        # each process has its own keep-alive connection to the worker: two source ports
        assert len({port for _, port in peers}) >= 2
        for _ in range(6):  # whichever process answers /metrics counts all of them
            assert requests_total(url) == n
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10  # the worker processes exit after their parent

        def alive() -> list[int]:
            return [k for k in kids if Path(f"/proc/{k}").exists() and "zombie" not in
                    Path(f"/proc/{k}/status").read_text().lower()]

        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        stub.stop()
