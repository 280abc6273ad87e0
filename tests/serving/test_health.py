"""Liveness (`/health`) follows the engine loop: 503 once it has died."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.serving.api_server import ServerSettings, build_app


@pytest.mark.slow
def test_health_fails_once_the_engine_loop_has_died():
    engines: list[AsyncLLMEngine] = []

    def load() -> AsyncLLMEngine:
        engines.append(AsyncLLMEngine.from_args(num_kv_blocks=64, num_threads=1))
        return engines[0]

    app = build_app(ServerSettings(served_model_name="SmolLM2-135M-Instruct"), load)
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").json()
            time.sleep(0.1)
        assert client.get("/health").json() == {"status": "ok"}
        engines[0].dead = RuntimeError("the loop crashed")  # what `_run` records
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "dead"}
        assert client.get("/ready").json()["status"] == "dead"
