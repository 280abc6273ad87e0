"""The operator's read of the router's `/scaling` (`metrics.HttpScalingSource`): the answer
as a `Scaling`, over real HTTP (`FakeRouter`), from every router replica and combined (each
counts only its own queue); every failure is a `ScalingError` naming the URL (refused
connection, an error status, a body that is not the answer), never a value."""

from __future__ import annotations

import pytest

from tandem.operator.metrics import (
    HttpScalingSource,
    Scaling,
    ScalingError,
    combine,
    dns_endpoints,
)
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


def test_every_router_replica_is_read_and_their_queues_add_up():
    """Two replicas: one holds 2 queued (band 1), the other 1 (band 1) and 3 (band 0) and
    sees 3 running + 1 waiting on the workers (the first sees only 2 running): demand
    2 + 4 + (3 + 1) = 10, not either replica's own answer; one replica down fails the read."""
    a, b = FakeRouter(), FakeRouter()
    try:
        a.set("m", "decode", 4, queued=2, running=2, queued_by_band={"1": 2})
        b.set("m", "decode", 8, queued=4, running=3, waiting=1, kv_utilization=0.5,
              ready_workers=2, queued_by_band={"0": 3, "1": 1})
        source = HttpScalingSource(endpoints=lambda url: [a.url, b.url])
        got = source.read("http://demo-metrics.ml.svc:9091/scaling?model=m&role=decode")
        assert got == Scaling(10.0, 6, 3, 1, 0.5, 2, {"0": 3, "1": 3})
        assert [len(r.requests) for r in (a, b)] == [1, 1]
        b.fail(503)
        with pytest.raises(ScalingError, match="503"):
            source.read("http://demo-metrics.ml.svc:9091/scaling?model=m&role=decode")
    finally:
        a.stop()
        b.stop()


def test_combine_of_one_is_that_one_and_dns_finds_every_address():
    one = Scaling(3.0, 1, 1, 1)
    assert combine([one]) is one
    assert "http://127.0.0.1:9091" in dns_endpoints("http://localhost:9091/scaling?model=m")
    with pytest.raises(ScalingError):
        dns_endpoints("http://no-such-host.invalid:9091/scaling")
