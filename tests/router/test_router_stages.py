"""The router's OpenAI POST stages (`router.stages`), called one by one on a real Starlette
request, without a server: each stage's answer and the rejection it counts."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from tandem.protocol.web import APIError
from tandem.router import stages
from tandem.router.app import RouterServerSettings, build_app
from tandem.router.auth import ApiKeys
from tandem.router.core import Router, RouterSettings
from tandem.router.routes import RouterApp


def _request(body: dict, headers: dict[str, str] | None = None) -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    hdrs = {"content-type": "application/json", **(headers or {})}
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()]}
    return Request(scope, receive)


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
    assert stages.authenticate(ra, _request({}, {"authorization": "Bearer sk-a"})) == "team-a"
    with pytest.raises(APIError) as err:
        stages.authenticate(ra, _request({}, {"authorization": "Bearer nope"}))
    assert err.value.status == 401 and _rejected(ra, "401") == 1


def test_parse_body_then_admit() -> None:
    ra = _app(max_tokens_cap=8, max_prompt_tokens=3)
    body = asyncio.run(stages.parse_body(ra, "completions",
                                         _request({"prompt": [1, 2, 3, 4], "max_tokens": 8}),
                                         None))
    assert (body.model, body.parsed.token_ids, body.changed) == ("", [1, 2, 3, 4], True)
    with pytest.raises(APIError) as err:  # before the model's check
        stages.admit(ra, body)
    assert (err.value.status, err.value.message) == (400, "prompt has 4 tokens; the limit is 3")
    with pytest.raises(APIError) as err:
        asyncio.run(stages.parse_body(ra, "completions",
                                      _request({"model": "m", "prompt": "x", "max_tokens": 9}),
                                      None))
    assert err.value.status == 400 and "max_tokens: at most 8" in err.value.message
    assert _rejected(ra, "400") == 2


def test_charge_without_a_limiter_and_routing_without_workers() -> None:
    ra = _app()
    body = asyncio.run(stages.parse_body(ra, "completions",
                                         _request({"model": "m", "prompt": "hi"}), None))
    assert asyncio.run(stages.charge(ra, "completions", body)) is None
    assert asyncio.run(stages.shared_matches(ra, body.parsed, "m")) == (None, None)
    routing = stages.Routing(ra, "rid", body, 0.0, None, None)
    assert routing.pick(set()) is None and not routing.first
