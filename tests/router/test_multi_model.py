"""Several models behind one router: a real router in front of stub workers of two models
routes each request by its `model` to that model's workers only, refuses a missing model
(400) and an unknown one (404), and lists both in `/v1/models` with their context lengths."""

from __future__ import annotations

import httpx
import pytest

from tests.router.stub_worker import StubWorker
from tests.router.test_router_app import _wait_ready, router_app
from tests.serving.helpers import free_port


@pytest.fixture(scope="module")
def fleet():
    alpha = [StubWorker(free_port(), model="alpha", max_model_len=400) for _ in range(2)]
    beta = [StubWorker(free_port(), model="beta", max_model_len=800)]
    router = router_app([w.url for w in [*alpha, *beta]])
    _wait_ready(router.url, 3)
    yield router, alpha, beta
    for s in [router, *alpha, *beta]:
        s.stop()


def test_each_request_goes_to_its_models_workers(fleet):
    router, alpha, beta = fleet
    for i in range(12):
        model = "alpha" if i % 3 else "beta"
        r = httpx.post(router.url + "/v1/completions", timeout=10,
                       json={"model": model, "prompt": f"prompt {i} " * (i + 1)})
        assert r.status_code == 200 and r.json()["model"] == model, r.text
    assert [b["model"] for w in alpha for b in w.bodies] == ["alpha"] * 8
    assert [b["model"] for b in beta[0].bodies] == ["beta"] * 4
    assert all(w.bodies for w in alpha)  # both alpha workers served


def test_a_missing_or_unknown_model_is_refused(fleet):
    router, _, _ = fleet
    r = httpx.post(router.url + "/v1/completions", timeout=10, json={"prompt": "hi"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == \
        "the request must name a model (this router serves several)"
    r = httpx.post(router.url + "/v1/completions", timeout=10,
                   json={"model": "gamma", "prompt": "hi"})
    assert r.status_code == 404 and "gamma" in r.json()["error"]["message"]


def test_models_lists_every_model_once(fleet):
    router, _, _ = fleet
    r = httpx.get(router.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": [
        {"id": "alpha", "object": "model", "owned_by": "tandem", "max_model_len": 400},
        {"id": "beta", "object": "model", "owned_by": "tandem", "max_model_len": 800}]}
