"""A conformance-style suite for the endpoint picker, modelled on the Gateway API Inference
Extension's own conformance tests (`conformance/tests/` in kubernetes-sigs/gateway-api-
inference-extension) and its endpoint-picker protocol (`docs/proposals/004-endpoint-picker-
protocol`): each test is named after the test or protocol clause it mirrors. Where the
upstream test steers the picker with its test-only `test-epp-endpoint-selection` header, these
steer it with the protocol's own subset hint (`envoy.lb.subset_hint`). The gateway is played by
`extproc_client.Envoy` against stub workers on real ports."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.router.extproc.encode import BODY_CHUNK
from tandem.router.extproc.settings import ExtProcSettings
from tests.router.extproc_client import EppRouter
from tests.router.stub_worker import StubWorker
from tests.serving.helpers import free_port


@pytest.fixture(scope="module")
def pool():
    workers = [StubWorker(free_port()) for _ in range(3)]
    router = EppRouter([w.url for w in workers],
                       ext=ExtProcSettings(port=0, host="127.0.0.1", fallbacks=2))
    router.wait_routable(3)
    yield router, workers, [f"127.0.0.1:{w.port}" for w in workers]
    router.stop()
    for w in workers:
        w.stop()


def _body(prompt: str) -> bytes:
    return json.dumps({"model": "stub-model", "prompt": prompt, "max_tokens": 5}).encode()


def _landed(workers: list[StubWorker], before: list[int]) -> int:
    (got,) = [i for i, w in enumerate(workers) if len(w.bodies) > before[i]]
    return got


@pytest.mark.parametrize("allowed", [[2], [0, 1], [0, 1, 2]])
def test_gateway_following_epp_routing(pool, allowed) -> None:
    """GatewayFollowingEPPRouting: traffic reaches only endpoints in the list the picker
    returns; the header and the `envoy.lb` metadata carry the same list."""
    router, workers, eps = pool
    subset = [eps[i] for i in allowed]
    for n in range(6):
        before = [len(w.bodies) for w in workers]
        ex = router.envoy.request("/v1/completions", _body(f"follow {allowed} {n}"),
                                  subset=subset)
        assert ex.status == 200 and ex.endpoints == ex.metadata_endpoints
        assert sorted(ex.endpoints) == sorted(subset)
        assert _landed(workers, before) in allowed


def test_gateway_destination_endpoint_served(pool) -> None:
    """GatewayDestinationEndpointServed: the endpoint the gateway reports as served
    (`envoy.lb` / `x-gateway-destination-endpoint-served`) is read back for each endpoint."""
    router, workers, eps = pool
    name = "tandem_router_extproc_served_total"
    for i, ep in enumerate(eps):
        picks = router.metric(name, {"outcome": "pick"})
        before = [len(w.bodies) for w in workers]
        ex = router.envoy.request("/v1/completions", _body(f"served {i}"), subset=[ep])
        assert ex.served_by == ep and _landed(workers, before) == i
        assert router.metric(name, {"outcome": "pick"}) == picks + 1
    unreported = router.metric(name, {"outcome": "unreported"})
    router.envoy.request("/v1/completions", _body("silent"), report_served=False)
    assert router.metric(name, {"outcome": "unreported"}) == unreported + 1


def test_gateway_weighted_two_pools_routes_only_within_the_selected_pool(pool) -> None:
    """GatewayWeightedAcrossTwoInferencePools (the picker's part): each InferencePool's picker
    names only its own pool's endpoints."""
    router, workers, eps = pool
    other = [StubWorker(free_port()) for _ in range(2)]
    second = EppRouter([w.url for w in other],
                       ext=ExtProcSettings(port=0, host="127.0.0.1", fallbacks=2))
    try:
        second.wait_routable(2)
        theirs = {f"127.0.0.1:{w.port}" for w in other}
        for n in range(4):
            a = router.envoy.request("/v1/completions", _body(f"pool a {n}"))
            b = second.envoy.request("/v1/completions", _body(f"pool b {n}"))
            assert set(a.endpoints) <= set(eps) and set(b.endpoints) <= theirs
            assert a.status == b.status == 200
    finally:
        second.stop()
        for w in other:
            w.stop()


def test_endpoint_subset_with_no_eligible_endpoint_is_503(pool) -> None:
    """Protocol, Endpoint Subset: "If none of the endpoints in the list is eligible or the
    list is empty, then the EPP MUST return a ImmediateResponse with 503"."""
    router, _workers, eps = pool
    for subset in (["192.0.2.1:8000"], [], "192.0.2.1:8000,192.0.2.2:8000"):
        ex = router.envoy.request("/v1/completions", _body("none"), subset=subset)
        assert ex.immediate is not None and ex.immediate.status.code == 503
        assert ex.pick is None
    ex = router.envoy.request("/v1/completions", _body("ip only"), subset=["127.0.0.1"])
    assert ex.status == 200 and set(ex.endpoints) <= set(eps)


def test_destination_endpoint_header_and_metadata_agree(pool) -> None:
    """Protocol, Destination Endpoint: the header and the `envoy.lb` metadata name the same
    endpoints (`ip:port`, comma-separated, pick first); the header is set in `raw_value`
    only; the route cache is cleared."""
    router, _workers, eps = pool
    ex = router.envoy.request("/v1/completions", _body("agree"))
    assert ex.endpoints == ex.metadata_endpoints and not ex.set_both
    assert len(ex.endpoints) == 3 and set(ex.endpoints) == set(eps)
    assert ex.pick.request_headers.response.clear_route_cache


def test_request_body_passthrough(pool) -> None:
    """The upstream gets exactly the body the picker returns (FULL_DUPLEX_STREAMED): an
    unchanged body byte for byte, in chunks of at most 62000 bytes, the last one ending the
    stream, with a matching content-length."""
    router, workers, _eps = pool
    body = _body("long " * 40000)
    before = [len(w.bodies) for w in workers]
    ex = router.envoy.request("/v1/completions", body, chunk=16384)
    assert ex.forwarded_body == body and ex.status == 200
    assert int(ex.set_headers["content-length"]) == len(body)
    landed = workers[_landed(workers, before)]
    assert landed.bodies[-1] == json.loads(body)
    assert len(body) > 2 * BODY_CHUNK


def test_response_body_passthrough(pool) -> None:
    """The client gets the worker's answer unchanged, headers and body."""
    router, workers, eps = pool
    body = _body("echo")
    ex = router.envoy.request("/v1/completions", body, subset=[eps[0]])
    direct = httpx.post(f"{workers[0].url}/v1/completions", content=body,
                        headers={"content-type": "application/json"})
    assert ex.status == direct.status_code == 200 and ex.body == direct.content
    assert ex.response_headers["content-type"] == direct.headers["content-type"]


@pytest.mark.parametrize("service", ["liveness", "readiness",
                                     "envoy.service.ext_proc.v3.ExternalProcessor"])
def test_health_checking_services(pool, service) -> None:
    """Protocol, Health Checking: the three services answer SERVING on a ready pool."""
    router, _workers, _eps = pool
    with grpc.insecure_channel(router.target) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert got.status == health_pb2.HealthCheckResponse.SERVING
