"""The router's gauges of what it holds open (read by the chaos suite's leak check):
`tandem_router_worker_requests_in_flight` per worker and `tandem_router_upstream_connections`
by state count a stream while it is relayed and return to 0 (the connection idle, kept alive)
once it ends."""

from __future__ import annotations

import httpx

from tests.router.stub_worker import StubWorker, slow_stream
from tests.router.test_router_app import _wait_ready, router_app
from tests.serving.helpers import free_port


def sample(text: str, name: str) -> float:
    """The value of the sample whose line starts with `name` (labels included)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_a_relayed_stream_counts_until_it_ends():
    worker = StubWorker(free_port())
    router = router_app([worker.url])
    try:
        _wait_ready(router.url, 1)
        in_flight = f'tandem_router_worker_requests_in_flight{{worker="{worker.url}"}}'
        active = 'tandem_router_upstream_connections{state="active"}'
        idle = 'tandem_router_upstream_connections{state="idle"}'
        before = httpx.get(router.url + "/metrics").text
        assert sample(before, in_flight) == 0 and sample(before, active) == 0
        with httpx.stream("POST", router.url + "/v1/completions", timeout=30,
                          headers=slow_stream(40, 0.25),
                          json={"model": "stub-model", "prompt": "hi", "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            # (the readiness probes share the pool: one may be in flight at a reading)
            during = [httpx.get(router.url + "/metrics").text for _ in range(5)]
            assert [sample(t, in_flight) for t in during] == [1] * 5
            assert min(sample(t, active) for t in during) == 1
            assert "data: [DONE]" in list(lines)
        after = [httpx.get(router.url + "/metrics").text for _ in range(5)]
        assert [sample(t, in_flight) for t in after] == [0] * 5
        assert min(sample(t, active) for t in after) == 0
        assert max(sample(t, idle) for t in after) >= 1  # kept alive for the next request
    finally:
        router.stop()
        worker.stop()
