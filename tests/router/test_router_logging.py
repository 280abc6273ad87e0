"""The router's log under probes: the workers' readiness probes (every `probe_interval_s`,
over the router's upstream pool, logged by `tandem.router.probe`) are DEBUG records, while
a routed request keeps its INFO line, on both front-door HTTP servers; httpx requests keep
their INFO line."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from tandem.router.app import RouterServerSettings, build_app
from tandem.router.auth import ApiKeys
from tandem.router.core import Router, RouterSettings
from tandem.router.monitor import MonitorSettings
from tests.router.test_router_app import Served, _wait_ready, stub_openai


def httpx_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "httpx"]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "uvicorn"])
def test_probes_are_debug_and_routed_requests_info(caplog: pytest.LogCaptureFixture,
                                                   lean: bool):
    seen: list = []
    stub = Served(stub_openai("stub0", seen))
    router = None
    try:
        caplog.set_level(logging.INFO)
        settings = RouterServerSettings(worker_urls=[stub.url], api_keys=ApiKeys({}),
                                        monitor=MonitorSettings(probe_interval_s=0.05))
        router = Served(build_app(Router(RouterSettings(seed=0), lambda m: None), settings),
                        lean=lean)
        _wait_ready(router.url, 1)
        time.sleep(0.5)  # ~10 probe rounds (GET /ready, then /health and /v1/models)
        assert httpx_records(caplog) == [], [r.getMessage() for r in httpx_records(caplog)]
        r = httpx.post(router.url + "/v1/completions", timeout=10,
                       json={"model": "stub-model", "prompt": "hi"})
        assert r.status_code == 200 and seen, r.text
        routed = [r.getMessage() for r in caplog.records
                  if r.name == "tandem.router.app" and r.levelno == logging.INFO]
        assert len(routed) == 1 and f" -> {stub.url} (" in routed[0], routed
        # a request that is not a probe keeps httpx's INFO line (the test's own too)
        httpx.post(stub.url + "/v1/completions", json={"model": "stub-model"}, timeout=10)
        assert [(r.levelname, r.getMessage()) for r in httpx_records(caplog)] == [
            ("INFO", f'HTTP Request: POST {router.url}/v1/completions "HTTP/1.1 200 OK"'),
            ("INFO", f'HTTP Request: POST {stub.url}/v1/completions "HTTP/1.1 200 OK"')]
        # --log-level debug: the probes are there, at DEBUG
        caplog.clear()
        caplog.set_level(logging.DEBUG, logger="tandem.router.probe")
        deadline = time.monotonic() + 10  # until a probe round of each kind has run
        while True:
            probes = {r.getMessage().split()[3].removeprefix(stub.url)
                      for r in caplog.records if r.name == "tandem.router.probe"
                      and r.levelno == logging.DEBUG
                      and r.getMessage().startswith("HTTP Request: GET ")}
            if len(probes) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert probes == {"/ready", "/health", "/v1/models"}, probes
    finally:
        if router is not None:
            router.stop()
        stub.stop()
