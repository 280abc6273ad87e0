"""Scale from zero with real processes: a `tandem router` whose router.yaml lists
`served_models` and whose one worker address has nothing listening yet lists the models,
holds a request for one of them (the scaling signal shows the demand), answers it once a
worker process for the model starts, and answers 503 `start-timeout` (Retry-After) for a
model whose worker did not start within its `start_timeout_s`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.router.test_router_lifecycle import Router
from tests.serving.helpers import free_port

REPO = Path(__file__).resolve().parents[2]


def scaling(url: str, model: str) -> dict:
    return httpx.get(url + "/scaling", params={"model": model, "role": "decode"},
                     timeout=5).json()


def test_a_request_waits_for_a_worker_that_starts_after_it_arrived(tmp_path):
    port = free_port()
    config = tmp_path / "router.yaml"
    config.write_text("flow_control: {enabled: true, ttl_s: 5}\n"
                      "served_models:\n"
                      "  - {name: m, start_timeout_s: 60}\n"
                      "  - {name: cold, start_timeout_s: 1}\n")
    router = Router(tmp_path, [f"http://127.0.0.1:{port}"], "--config", str(config))
    worker = None
    try:
        router.wait_listening()
        models = httpx.get(router.url + "/v1/models", timeout=5)
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["cold", "m"]
        assert scaling(router.url, "m")["demand"] == 0.0
        held: dict = {}

        def send() -> None:
            held["r"] = httpx.post(router.url + "/v1/completions", timeout=60,
                                   json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})

        waiter = threading.Thread(target=send)
        waiter.start()
        deadline = time.monotonic() + 20
        while scaling(router.url, "m")["queued"] < 1:
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.05)
        signal = scaling(router.url, "m")
        assert signal["demand"] >= 1.0 and signal["ready_workers"] == 0
        t0 = time.monotonic()
        cold = httpx.post(router.url + "/v1/completions", timeout=30,
                          json={"model": "cold", "prompt": [1], "max_tokens": 1})
        assert cold.status_code == 503, cold.text
        assert cold.headers["x-tandem-flow-reason"] == "start-timeout"
        assert cold.headers["retry-after"] == "5"
        assert "cold" in cold.json()["error"]["message"]
        assert 0.9 < time.monotonic() - t0 < 10
        assert "r" not in held  # still waiting: its worker has not started
        worker = subprocess.Popen(
            [sys.executable, "-c", "import time; from tests.router.stub_worker import "
             f"StubWorker; StubWorker({port}, model='m'); time.sleep(120)"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(REPO), os.environ.get("PYTHONPATH", "")])},
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        waiter.join(timeout=60)
        answer = held["r"]
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "abcde"
        assert scaling(router.url, "m")["queued"] == 0
        assert scaling(router.url, "m")["ready_workers"] == 1
    finally:
        router.stop()
        if worker is not None:
            worker.kill()
            worker.wait(timeout=10)
