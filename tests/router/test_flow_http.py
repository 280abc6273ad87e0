"""Flow control through the real router (lean HTTP server) in front of a stub worker on a
real port: a saturated worker's requests queue and are answered in arrival order (the
scaling signal counting them meanwhile), a request past its TTL gets 429 with Retry-After
and the reason header, a full band sheds the newcomer with 429, a client that gives up
leaves the queue, and `/scaling` refuses what it does not know; router.yaml's flow-control
keys are checked like every other."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tandem.operator.metrics import HttpScalingSource, Scaling
from tandem.router.config import RouterConfigError, check_config
from tandem.router.core import Router, RouterSettings
from tandem.router.flowcontrol.local import QueueFlowControl
from tandem.router.flowcontrol.settings import BandLimits, FlowSettings
from tests.router.stub_worker import StubWorker, slow_stream
from tests.router.test_router_app import router_app
from tests.serving.helpers import free_port


def flow_router(worker: StubWorker, **flow):  # noqa: ANN201 - (Served, QueueFlowControl)
    """A router whose worker is saturated at one open request, with flow control on."""
    router = Router(RouterSettings(seed=0, flow_saturation_waiting=1), lambda m: None)
    fc = QueueFlowControl(FlowSettings(enabled=True, **flow), router)
    served = router_app([worker.url], router=router, flow_control=fc)
    deadline = time.monotonic() + 10
    while httpx.get(served.url + "/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return served, fc


def post(url: str, prompt: str, results: dict, headers: dict | None = None,
         stream: bool = False, timeout: float = 20) -> threading.Thread:
    def run() -> None:
        try:
            r = httpx.post(url + "/v1/completions", timeout=timeout, headers=headers,
                           json={"model": "stub-model", "prompt": prompt, "max_tokens": 4,
                                 "stream": stream})
            results[prompt] = (r.status_code, r.headers, r.text)
        except httpx.HTTPError as exc:
            results[prompt] = (None, {}, type(exc).__name__)

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_for(check, timeout: float = 10) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.fixture()
def worker():
    w = StubWorker(free_port())
    yield w
    w.stop()


def test_a_saturated_worker_answers_the_queue_in_arrival_order(worker):
    served, fc = flow_router(worker)
    try:
        results: dict = {}
        threads = [post(served.url, "first", results, slow_stream(4, 0.2), stream=True)]
        wait_for(lambda: len(worker.bodies) == 1)
        for n, p in enumerate(("second", "third", "fourth"), 1):
            threads.append(post(served.url, p, results))
            wait_for(lambda n=n: fc.queued("stub-model") == n)
        signal = httpx.get(served.url + "/scaling", timeout=5,
                           params={"model": "stub-model", "role": "decode"}).json()
        assert signal == {"model": "stub-model", "role": "decode", "demand": 4.0,
                          "queued": 3, "running": 1, "waiting": 0, "kv_utilization": 0.0,
                          "ready_workers": 1, "queued_by_band": {"0": 3}}
        # what the operator's autoscaler reads of it (the same contract)
        url = "http://demo-metrics.ml.svc:9091/scaling?model=stub-model&role=decode"
        assert HttpScalingSource(base=served.url).read(url) == Scaling(
            4.0, queued=3, running=1, waiting=0, kv_utilization=0.0, ready_workers=1,
            queued_by_band={"0": 3})
        prefill = httpx.get(served.url + "/scaling", timeout=5,
                            params={"model": "stub-model", "role": "prefill"}).json()
        assert prefill["demand"] == 3.0 and prefill["ready_workers"] == 0
        assert prefill["queued_by_band"] == {"0": 3}
        for t in threads:
            t.join()
        assert [b["prompt"] for b in worker.bodies] == ["first", "second", "third", "fourth"]
        assert all(r[0] == 200 for r in results.values())
        text = httpx.get(served.url + "/metrics", timeout=5).text
        assert 'tandem_router_flow_dispatched_total{band="0",tenant="anonymous"} 4.0' in text
        assert 'tandem_router_flow_queued{band="0",tenant="anonymous"} 0.0' in text
        assert 'tandem_router_flow_wait_seconds_count{band="0"} 4.0' in text
        assert fc.outstanding == 0
    finally:
        served.stop()


def test_ttl_and_a_full_band_answer_429_with_retry_after_and_the_reason(worker):
    served, fc = flow_router(worker, ttl_s=1.0,
                             default_band=BandLimits(max_requests=2, max_bytes=1 << 20))
    try:
        results: dict = {}
        busy = post(served.url, "busy", results, slow_stream(15, 0.2), stream=True)
        wait_for(lambda: len(worker.bodies) == 1)
        t0 = time.monotonic()
        waits = [post(served.url, "expires", results)]
        wait_for(lambda: fc.queued("stub-model") == 1)
        waits.append(post(served.url, "gives-up", results, timeout=0.3))
        wait_for(lambda: fc.queued("stub-model") == 2)
        over = httpx.post(served.url + "/v1/completions", timeout=10,
                          json={"model": "stub-model", "prompt": "over"})
        assert over.status_code == 429
        assert over.headers["x-tandem-flow-reason"] == "band-full"
        assert over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == 429
        waits[1].join()
        assert results["gives-up"][0] is None  # the client timed out ...
        wait_for(lambda: fc.queued("stub-model") == 1)  # ... and left the queue
        waits[0].join()
        status, headers, _ = results["expires"]
        assert status == 429 and headers["x-tandem-flow-reason"] == "ttl"
        assert headers["retry-after"] == "1"
        assert 0.9 < time.monotonic() - t0 < 5
        text = httpx.get(served.url + "/metrics", timeout=5).text
        for reason in ("band-full", "ttl", "cancelled"):
            assert (f'tandem_router_flow_shed_total{{band="0",reason="{reason}",'
                    f'tenant="anonymous"}} 1.0') in text
        assert [b["prompt"] for b in worker.bodies] == ["busy"]
        busy.join()
    finally:
        served.stop()


def test_scaling_refuses_what_it_does_not_know(worker):
    served, _ = flow_router(worker, bands={-1: BandLimits(), 4: BandLimits()})
    try:
        get = lambda **q: httpx.get(served.url + "/scaling", params=q, timeout=5)  # noqa: E731
        ok = get(model="stub-model", role="decode")
        # a bounded band is always there (0 when empty): a KEDA trigger on it never misses
        assert ok.status_code == 200 and ok.json()["queued_by_band"] == {"-1": 0, "4": 0}
        assert get(role="decode").status_code == 400
        bad = get(model="stub-model", role="both")
        assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
        assert get(model="stub-model", role="decode", extra="1").status_code == 400
        assert get(model="nope", role="decode").status_code == 404
    finally:
        served.stop()


@pytest.mark.parametrize(("config", "message"), [
    ({"flow_control": {"fairness": "lottery"}}, "flow_control.fairness"),
    ({"flow_control": {"ordering": "lifo"}}, "flow_control.ordering"),
    ({"flow_control": {"ttl_s": 0}}, "flow_control.ttl_s"),
    ({"flow_control": {"saturation": {"waiting": 0}}}, "flow_control.saturation.waiting"),
    ({"flow_control": {"saturation": {"kv": 1.5}}}, "flow_control.saturation.kv"),
    ({"flow_control": {"bands": {"high": {}}}}, "flow_control.bands"),
    ({"flow_control": {"bands": {1: {"max_requests": 0}}}},
     "flow_control.bands.1.max_requests"),
    ({"flow_control": {"bands": {"default": {"max_items": 3}}}},
     'unknown key "flow_control.bands.default.max_items"'),
    ({"flow_control": {"tenant_weights": {"gold": -1}}}, "flow_control.tenant_weights.gold"),
    ({"flow_control": {"sharde": True}}, 'did you mean "shared"'),
    ({"served_models": [{"name": "m", "start_timeout": 5}]},
     'unknown key "served_models.0.start_timeout"'),
    ({"served_models": [{"name": ""}]}, "served_models.0.name"),
])
def test_bad_flow_control_keys_are_refused_with_their_path(config, message):
    with pytest.raises(RouterConfigError, match=message.replace(".", r"\.").replace(
            "(", r"\(")):
        check_config(config)


def test_flow_settings_from_router_yaml():
    cfg = check_config({"flow_control": {
        "enabled": True, "fairness": "round-robin", "ordering": "edf", "ttl_s": 5,
        "saturation": {"waiting": 2, "kv": 0.5}, "shared": True,
        "bands": {"default": {"max_requests": 10}, 3: {"max_bytes": 100}},
        "tenant_weights": {"gold": 4}}, "served_models": [{"name": "m"}]})
    s = FlowSettings.from_config(cfg["flow_control"], cfg["served_models"])
    assert (s.enabled, s.fairness, s.ordering, s.ttl_s, s.shared) == (
        True, "round-robin", "edf", 5.0, True)
    assert (s.saturation_waiting, s.saturation_kv) == (2, 0.5)
    assert s.limits(0) == BandLimits(10, 64 << 20)
    assert s.limits(3) == BandLimits(10, 100)  # unset keys: the default band's
    assert s.weight("gold") == 4.0 and s.weight("other") == 1.0
    assert s.served_models == {"m": 120.0}
    assert FlowSettings.from_config(None, [{"name": "m"}]).enabled  # served_models: on
    with pytest.raises(ValueError, match="served_models needs flow control"):
        FlowSettings.from_config({"enabled": False}, [{"name": "m"}])
    with pytest.raises(ValueError, match="listed twice"):
        FlowSettings.from_config(None, [{"name": "m"}, {"name": "m"}])
    assert not FlowSettings.from_config(None, None).enabled
    assert FlowSettings.from_config(None, None, flag=True).enabled


def test_the_request_flow_control_sees_band_cost_size_and_deadline():
    from tandem.protocol.web import APIError
    from tandem.router.flowcontrol.front import flow_request, parse_deadline

    r = flow_request("id", None, "m", {"priority": -3, "max_tokens": 50, "n": 2}, 10, 123,
                     None)
    assert (r.tenant, r.band, r.cost, r.size_bytes) == ("anonymous", 3, 110, 123)
    r = flow_request("id", "t", "m", {"max_completion_tokens": 7}, 10, 1, 5.0)
    assert (r.tenant, r.band, r.cost, r.deadline) == ("t", 0, 17, 5.0)
    assert flow_request("id", "t", "m", {}, 10, 1, None).cost == 10 + 256
    assert parse_deadline(None, 100.0) is None
    assert parse_deadline("2500", 100.0) == 102.5
    for bad in ("0", "-5", "1.5", "abc", "3600001"):
        with pytest.raises(APIError) as err:
            parse_deadline(bad, 100.0)
        assert err.value.status == 400 and "x-tandem-deadline-ms" in err.value.message


def test_the_cli_builds_flow_control_from_the_flag_and_refuses_what_cannot_work():
    import argparse

    from tandem.router.main import add_router_args, build

    def args(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_router_args(p)
        return p.parse_args(["--workers", "http://127.0.0.1:9", *argv])

    _, router, server = build(args("--flow-control"), {})
    assert isinstance(server.flow_control, QueueFlowControl)
    assert router.settings.flow_saturation_waiting == 4
    _, router, server = build(args(), {"served_models": [{"name": "m"}],
                                       "flow_control": {"saturation": {"kv": 0.5}}})
    assert server.flow_control is not None and router.settings.served_models == {"m": 120.0}
    assert router.settings.flow_saturation_kv == 0.5
    assert build(args(), {})[2].flow_control is None
    with pytest.raises(SystemExit, match="needs the router's Redis"):
        build(args(), {"flow_control": {"enabled": True, "shared": True}})
    with pytest.raises(SystemExit, match="served_models needs flow control"):
        build(args(), {"flow_control": {"enabled": False}, "served_models": [{"name": "m"}]})
