"""A POST body must be sent as JSON, with the same clear 400 from a worker and from the
router (in-process apps over real HTTP semantics: Starlette's TestClient, no servers)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tandem.protocol.web import NOT_JSON
from tandem.router.app import RouterServerSettings
from tandem.router.app import build_app as router_app
from tandem.router.core import Router, RouterSettings
from tandem.serving.api_server import ServerSettings
from tandem.serving.api_server import build_app as worker_app

BODIES = {
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "a"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}
REFUSED = {"error": {"message": NOT_JSON, "type": "invalid_request_error", "param": None,
                     "code": 400}}


def _no_engine():
    raise RuntimeError("no engine in this test")


@pytest.fixture(scope="module")
def apps():
    worker = TestClient(worker_app(ServerSettings(served_model_name="m"), _no_engine),
                        raise_server_exceptions=False)
    router = TestClient(router_app(Router(RouterSettings(), lambda _: None),
                                   RouterServerSettings()), raise_server_exceptions=False)
    with router:
        yield {"worker": worker, "router": router}


@pytest.mark.parametrize("content_type", [None, "text/plain",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_json_gets_the_same_clear_400_at_worker_and_router(
        apps, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    for path, body in BODIES.items():
        for name, client in apps.items():
            r = client.post(path, content=json.dumps(body), headers=headers)
            assert (r.status_code, r.json()) == (400, REFUSED), (name, path, r.text)


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8",
                                          "application/merge-patch+json"])
def test_json_content_types_pass_the_check(apps, content_type):
    """Past the check, the request meets the next one: the worker's model is not loaded
    (503), the router has no worker serving it (404)."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        for name, client in apps.items():
            r = client.post(path, content=json.dumps(BODIES[path]),
                            headers={"content-type": content_type})
            assert r.status_code == {"worker": 503, "router": 404}[name], (name, path, r.text)
