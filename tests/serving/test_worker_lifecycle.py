"""Worker process lifecycle: loading, back-pressure, draining on SIGTERM."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from .conftest import start_worker, wait_for

pytestmark = pytest.mark.slow
LONG = {"prompt": "Count from one to a thousand:", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}


def _post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    def run() -> None:
        try:
            results.append(httpx.post(url + "/v1/completions", json=body, timeout=120))
        except httpx.HTTPError as exc:
            results.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def _wait_gauge(url: str, name: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _gauge(url, name) < n:
        assert time.monotonic() < deadline, f"{name} never reached {n}"
        time.sleep(0.05)


def _wait_running(url: str, n: int) -> None:
    _wait_gauge(url, "vllm:num_requests_running", n)


def test_loading_then_ready(tmp_path):
    w = start_worker(tmp_path, wait_ready=False)
    try:
        wait_for(w, "/health", 200, timeout=120)  # the process answers before the model is up
        ready = httpx.get(w.url + "/ready", timeout=5)
        early = httpx.post(w.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        assert early.status_code == 503 and early.headers["Retry-After"]
        assert early.json()["error"]["type"] == "service_unavailable"
        wait_for(w, "/ready", 200, timeout=180)
        ok = httpx.post(w.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200
    finally:
        assert w.stop() == 0, w.log()


def test_full_queue_gets_429_with_retry_after(tmp_path):
    w = start_worker(tmp_path, "--max-num-seqs", "1", "--max-waiting", "1",
                     "--drain-timeout", "0")
    results: list = []
    try:
        _post_in_thread(w.url, LONG, results)
        _wait_running(w.url, 1)
        _post_in_thread(w.url, LONG, results)  # fills the one waiting slot
        _wait_gauge(w.url, "vllm:num_requests_waiting", 1)
        r = httpx.post(w.url + "/v1/completions", json=LONG, timeout=120)
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert w.stop() == 0, w.log()


def test_sigterm_drains_running_requests_then_exits_zero(tmp_path):
    w = start_worker(tmp_path, "--drain-timeout", "60")
    results: list = []
    t = _post_in_thread(w.url, {**LONG, "max_tokens": 120}, results)
    _wait_running(w.url, 1)
    w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while httpx.get(w.url + "/ready", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = httpx.post(w.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
    assert refused.status_code == 503
    t.join(timeout=120)
    assert results and results[0].status_code == 200, results
    assert results[0].json()["usage"]["completion_tokens"] == 120
    assert w.proc.wait(timeout=60) == 0, w.log()


def test_tandem_serve_prints_the_url_and_stops_everything_on_ctrl_c(tmp_path):
    import os
    import subprocess
    import sys

    from .conftest import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--port", str(port),
         "--kv-cache-memory", str(256 << 20)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Press Ctrl-C" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        assert f"curl {url}/v1/chat/completions" in text
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):  # the worker process is gone too
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
