"""Worker process lifecycle: loading, back-pressure, draining on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tandem.protocol.bundled import BUNDLED_NAME

from .helpers import WorkerProcess, free_port, metric, start_worker, wait_for, wait_idle

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


def _wait_gauge(url: str, name: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, name) < n:
        assert time.monotonic() < deadline, f"{name} never reached {n}"
        time.sleep(0.05)


def _wait_running(url: str, n: int) -> None:
    _wait_gauge(url, "vllm:num_requests_running", n)


# the ready workers the tests below use, each its own (its flags), none shared
PRESTARTED = {"full_queue": ("--max-num-seqs", "1", "--max-waiting", "1", "--drain-timeout", "0"),
              "timeout": ("--request-timeout", "1.5"), "default": (),
              "drain": ("--drain-timeout", "60")}


@pytest.fixture(scope="module")
def prestarted(tmp_path_factory):
    """`PRESTARTED`'s workers, launched together when the module starts (their model loads
    overlap: each is mostly one core's work); `take` hands one out once all are ready (no
    load competes with a test), for the test to stop."""
    tmp = tmp_path_factory.mktemp("lifecycle")
    workers = {name: start_worker(tmp, *args, wait_ready=False)
               for name, args in PRESTARTED.items()}
    yield workers
    for w in workers.values():  # those no test took (deselected)
        if w.proc.poll() is None:
            w.stop()


def take(workers: dict[str, WorkerProcess], name: str) -> WorkerProcess:
    for w in workers.values():
        if w.proc.poll() is None:
            wait_for(w, "/ready", 200, timeout=240)
    return workers[name]


def test_loading_then_ready(tmp_path, prestarted):
    w = start_worker(tmp_path, wait_ready=False)  # loads beside the prestarted ones
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


def test_a_model_that_fails_to_load_exits_the_worker_with_the_reason(tmp_path):
    """As vLLM: no worker lingers without a model (Kubernetes restarts the container)."""
    missing = tmp_path / "missing.gguf"
    w = start_worker(tmp_path, "--model", str(missing), wait_ready=False)
    assert w.proc.wait(timeout=120) == 1, w.log()
    log = w.log()
    assert "engine failed to load" in log and f"{missing} does not exist" in log
    assert "exiting: the model failed to load" in log


@pytest.mark.parametrize("flags,message", [
    (("--long-prefill-token-threshold", "-5"), "long_prefill_token_threshold must be >= 0"),
    (("--max-num-batched-tokens", "0"), "max_num_batched_tokens must be >= 1"),
    (("--role", "decode", "--kv-transfer-backend", "torch", "--kv-transfer-host",
      "no-such-host.invalid"), "kv transfer host 'no-such-host.invalid' does not resolve"),
])
def test_a_bad_engine_flag_is_a_usage_error_before_anything_starts(flags, message):
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "worker", "--port",
                        str(free_port()), *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_full_queue_gets_429_with_retry_after(prestarted):
    w = take(prestarted, "full_queue")
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


def test_request_timeout_is_504_streamed_or_not_and_frees_the_blocks(prestarted):
    w = take(prestarted, "timeout")
    try:
        t = time.monotonic()
        r = httpx.post(w.url + "/v1/completions", json={**LONG, "max_tokens": 3000},
                       timeout=60)
        assert r.status_code == 504, r.text
        assert 1.5 <= time.monotonic() - t < 10
        error = r.json()["error"]
        assert error["type"] == "timeout_error" and "1.5" in error["message"]
        wait_idle(w.url, within=1.0)
        events = []
        with httpx.stream("POST", w.url + "/v1/completions", timeout=60,
                          json={**LONG, "max_tokens": 3000, "stream": True}) as resp:
            assert resp.status_code == 200  # headers went out before the deadline
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert '"error"' in events[-2] and "timed out" in events[-2]
        assert len(events) > 3  # tokens streamed before the deadline
        wait_idle(w.url, within=1.0)
    finally:
        assert w.stop() == 0, w.log()


def test_non_streaming_client_that_hangs_up_frees_its_blocks(prestarted):
    w = take(prestarted, "default")
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(w.url + "/v1/completions", json={**LONG, "max_tokens": 3000},
                       timeout=httpx.Timeout(10, read=1.0))
        wait_idle(w.url, within=1.0)
    finally:
        assert w.stop() == 0, w.log()


def test_sigterm_drains_running_requests_then_exits_zero(prestarted):
    w = take(prestarted, "drain")
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
        assert f"Tandem is serving {BUNDLED_NAME} at {url}" in text  # the model's name
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
