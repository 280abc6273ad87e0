"""The router's OpenAI POST stages (`router.stages`), called one by one without a server:
each stage's answer and the rejection it counts. The stages take header values and body bytes
(transport-free), as both front doors call them."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.protocol.web import APIError
from tandem.router import stages
from tandem.router.app import RouterServerSettings, build_app
from tandem.router.auth import ApiKeys
from tandem.router.core import Router, RouterSettings
from tandem.router.routes import RouterApp


def _parse(ra: RouterApp, body: dict, content_type: str = "application/json"):
    return asyncio.run(stages.parse_body(ra, "completions", json.dumps(body).encode(),
                                         content_type, None))


def _app(**settings) -> RouterApp:
    return RouterApp(Router(RouterSettings(seed=0), lambda m: None),
                     RouterServerSettings(**settings))


def _rejected(ra: RouterApp, status: str) -> float:
    return ra.metrics.registry.get_sample_value("tandem_router_rejected_total",
                                                {"status": status}) or 0.0


def test_build_app_serves_the_router_app_methods() -> None:
    app = build_app(Router(RouterSettings(), lambda m: None), RouterServerSettings())
    ra = app.state.router_app
    assert isinstance(ra, RouterApp)
    assert app.routes == {"/v1/completions": ra.completions,
                          "/v1/chat/completions": ra.chat, "/v1/responses": ra.responses}
    assert app.state.monitors is ra.membership.monitors


def test_authenticate_counts_a_401() -> None:
    ra = _app(api_keys=ApiKeys({"sk-a": "team-a"}))
    assert stages.authenticate(ra, "Bearer sk-a") == "team-a"
    with pytest.raises(APIError) as err:
        stages.authenticate(ra, "Bearer nope")
    assert err.value.status == 401 and _rejected(ra, "401") == 1


def test_parse_body_then_admit() -> None:
    ra = _app(max_tokens_cap=8, max_prompt_tokens=3)
    body = _parse(ra, {"prompt": [1, 2, 3, 4], "max_tokens": 8})
    assert (body.model, body.parsed.token_ids, body.changed) == ("", [1, 2, 3, 4], True)
    with pytest.raises(APIError) as err:  # before the model's check
        stages.admit(ra, body)
    assert (err.value.status, err.value.message) == (400, "prompt has 4 tokens; the limit is 3")
    with pytest.raises(APIError) as err:
        _parse(ra, {"model": "m", "prompt": "x", "max_tokens": 9})
    assert err.value.status == 400 and "max_tokens: at most 8" in err.value.message
    with pytest.raises(APIError) as err:  # not sent as JSON
        _parse(ra, {"model": "m", "prompt": "x"}, "text/plain")
    assert err.value.status == 400 and _rejected(ra, "400") == 3


def test_charge_without_a_limiter_and_routing_without_workers() -> None:
    ra = _app()
    body = _parse(ra, {"model": "m", "prompt": "hi"})
    assert asyncio.run(stages.charge(ra, "completions", body)) is None
    assert asyncio.run(stages.shared_matches(ra, body.parsed, "m")) == (None, None)
    routing = stages.Routing(ra, "rid", body, 0.0, None, None)
    assert routing.pick(set()) is None and not routing.first
