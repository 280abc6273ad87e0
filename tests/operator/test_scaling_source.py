"""The operator's read of the router's `/scaling` (`metrics.HttpScalingSource`): the answer
as a `Scaling`, over real HTTP (`FakeRouter`); every failure is a `ScalingError` naming the
URL (refused connection, an error status, a body that is not the answer), never a value."""

from __future__ import annotations

import pytest

from tandem.operator.metrics import HttpScalingSource, Scaling, ScalingError
from tandem.serving.ports import free_port
from tests.operator.harness import FakeRouter

URL = "http://demo-metrics.ml.svc:9091/scaling?model=Acme%2Fllama&role=prefill"


def test_reads_the_answer_at_the_rendered_path_and_query():
    router = FakeRouter()
    try:
        router.set("Acme/llama", "prefill", 7)
        got = HttpScalingSource(base=router.url).read(URL)
        assert got == Scaling(demand=7.0)
        (_, path, query), = router.requests
        assert (path, query) == ("/scaling", {"model": ["Acme/llama"], "role": ["prefill"]})
        with pytest.raises(ScalingError, match="404"):  # a model the router does not know
            HttpScalingSource(base=router.url).read(URL.replace("prefill", "decode"))
        router.fail(500)
        with pytest.raises(ScalingError, match="500"):
            HttpScalingSource(base=router.url).read(URL)
    finally:
        router.stop()


def test_an_unreachable_router_is_an_error():
    with pytest.raises(ScalingError, match="demo-metrics|127.0.0.1"):
        HttpScalingSource(timeout_s=1, base=f"http://127.0.0.1:{free_port()}").read(URL)


@pytest.mark.parametrize("body", [[], {"demand": -1}, {"demand": "5"}, {"demand": True},
                                  {"queued": 3}, {"demand": float("nan")}])
def test_an_answer_without_a_demand_is_refused(body):
    with pytest.raises(ScalingError, match="demand|object"):
        Scaling.from_json(body)


def test_every_field_is_read():
    body = {"model": "m", "role": "decode", "demand": 9.0, "queued": 4, "running": 3,
            "waiting": 2, "kv_utilization": 0.5, "ready_workers": 2,
            "queued_by_band": {"-1": 1, "2": 3}}
    assert Scaling.from_json(body) == Scaling(9.0, 4, 3, 2, 0.5, 2, {"-1": 1, "2": 3})
