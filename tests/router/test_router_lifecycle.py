"""A real `tandem router` process through its start and its stop, in front of a stub worker
on a real port: requests sent the moment it listens get 503 "starting" (never 404) until the
worker is ready; on SIGTERM it drains: `/ready` answers 503, new requests are refused, a
stream in flight completes, one past `--drain-seconds` is cut, and the process exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.router.stub_worker import StubWorker, slow_stream
from tests.serving.helpers import free_port


class Router:
    def __init__(self, tmp_path, workers: list[str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"router-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "router", "--port", str(self.port),
                 "--workers", ",".join(workers), *args],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_listening(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.01)

    def wait_ready(self, timeout: float = 30) -> None:
        self.wait_listening()
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def completion(url: str, model: str = "stub-model", **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=10,
                      json={"model": model, "prompt": [1, 2, 3], "max_tokens": 4, **extra})


def test_start_up_answers_503_starting_until_the_worker_is_ready_then_404_for_others(tmp_path):
    port = free_port()  # the worker's: nothing listens there yet
    router = Router(tmp_path, [f"http://127.0.0.1:{port}"])
    worker = None
    try:
        router.wait_listening()
        r = completion(router.url)  # the moment it listens: the worker is not even up
        assert r.status_code == 503, r.text
        assert "starting" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
        assert completion(router.url, model="gpt-17").status_code == 503  # cannot tell yet
        r = httpx.get(router.url + "/v1/models", timeout=10)
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
        worker = StubWorker(port, loading=True)  # up, loading its model: /ready 503
        deadline = time.monotonic() + 10
        while "its worker is not ready yet" not in (r := completion(router.url)).text:
            assert r.status_code == 503, r.text
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.json()["error"]["message"].startswith("model 'stub-model'")
        # it has reported its model: another model is known not to be served
        r = completion(router.url, model="gpt-17")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        worker.loading = False
        router.wait_ready()
        r = completion(router.url)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "abcde"
        assert [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]] == [
            "stub-model"]
        assert completion(router.url, model="gpt-17").status_code == 404
    finally:
        router.stop()
        if worker is not None:
            worker.stop()


@pytest.fixture(scope="module")
def worker():
    w = StubWorker(free_port())
    yield w
    w.stop()


def stream_in_thread(url: str, chunks: int, delay: float) -> tuple[threading.Thread, dict]:
    """Stream a completion in a thread; `out` gets the events, whether it ended cleanly."""
    out: dict = {"events": [], "first": threading.Event()}

    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "stub-model", "prompt": [1, 2, 3], "max_tokens": chunks,
                    "stream": True}, headers=slow_stream(chunks, delay)) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(line[6:])
                        out["first"].set()
            out["clean"] = True
        except httpx.HTTPError as exc:
            out["error"] = exc
        out["first"].set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_sigterm_drains_a_stream_to_done_and_refuses_new_work(tmp_path, worker):
    router = Router(tmp_path, [worker.url])
    try:
        router.wait_ready()
        t, out = stream_in_thread(router.url, chunks=8, delay=0.25)  # ~2 s
        assert out["first"].wait(10)
        t_term = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.5  # until the signal is handled (well within the stream)
        while (r := httpx.get(router.url + "/ready", timeout=5)).status_code == 200 \
                and time.monotonic() < deadline:  # each a new connection, mid-drain
            time.sleep(0.02)
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200  # liveness
        r = completion(router.url)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "shutting down" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"
        t.join(timeout=30)
        assert out.get("clean"), out
        assert out["events"] == [f'{{"id": "cmpl-1", "object": "text_completion", "choices": '
                                 f'[{{"index": 0, "text": "t{i}", "finish_reason": null}}]}}'
                                 for i in range(8)] + ["[DONE]"]
        assert router.proc.wait(timeout=30) == 0, router.log()
        assert time.monotonic() - t_term < 10  # it left once the stream was done
    finally:
        router.stop()


def test_a_stream_past_the_drain_deadline_is_cut_then_the_process_exits_0(tmp_path, worker):
    router = Router(tmp_path, [worker.url], "--drain-seconds", "1")
    try:
        router.wait_ready()
        t, out = stream_in_thread(router.url, chunks=40, delay=0.25)  # ~10 s
        assert out["first"].wait(10)
        t_term = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=20) == 0, router.log()
        took = time.monotonic() - t_term
        assert 0.9 < took < 6, took
        t.join(timeout=10)
        assert out["events"] and "[DONE]" not in out["events"]
        assert 2 <= len(out["events"]) < 40
        assert "cutting 1 requests still running" in router.log()
    finally:
        router.stop()
