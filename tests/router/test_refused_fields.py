"""Through the router (real sockets, a stock-OpenAI stub behind it): a field Tandem does not
support gets the worker's own 400 (`<field> is not supported`, `param` the field) and never
reaches a worker; what the API accepts without effect passes through as sent."""

from __future__ import annotations

import httpx
import pytest

from tests.router.test_router_app import Served, _wait_ready, router_app, stub_openai
from tests.test_docs_api import _unsupported_fields, unsupported

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "stub-model", "prompt": "hi"}


@pytest.fixture(scope="module")
def routed():
    seen: list = []
    stub = Served(stub_openai("stub0", seen))
    router = router_app([stub.url])
    _wait_ready(router.url, 1)
    yield router.url, seen
    router.stop()
    stub.stop()


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(url + path, json=body, timeout=10)
    return r.status_code, r.json()


def test_documented_unsupported_fields_get_the_workers_400(routed) -> None:
    url, seen = routed
    before = len(seen)
    fields = [*_unsupported_fields(), "max_token", "x_not_a_field"]
    for field in fields:
        for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            assert _post(url, path, {**base, field: [{"x": 1}]}) == unsupported(field), field
    nested = {**CHAT, "messages": [{"role": "assistant", "content": "42",
                                    "function_call": {"name": "f", "arguments": "{}"}}]}
    assert _post(url, "/v1/chat/completions", nested) == unsupported("messages.0.function_call")
    assert _post(url, "/v1/chat/completions", {**CHAT, "store": True})[1]["error"] == {
        "message": "store=true is not supported: completions are not stored",
        "type": "invalid_request_error", "param": "store", "code": 400}
    assert len(seen) == before  # none of them reached the worker


def test_a_bad_value_names_its_field_too(routed) -> None:
    url, _ = routed
    status, body = _post(url, "/v1/completions", {**COMPLETION, "speculative": "no"})
    assert (status, body["error"]["param"]) == (400, "speculative")
    assert body["error"]["message"] == "speculative: Input should be a valid boolean"


def test_accepted_fields_and_nulls_pass_through_as_sent(routed) -> None:
    url, seen = routed
    body = {**COMPLETION, "user": "user-1234", "tools": None, "logit_bias": {},
            "functions": [], "n": None}
    status, answer = _post(url, "/v1/completions", body)
    assert status == 200, answer
    assert seen[-1][1] == body  # forwarded unchanged: the worker applies the same rule


def test_adapter_loads_refuse_unknown_fields(routed) -> None:
    url, _ = routed
    body = {"lora_name": "a", "lora_path": "/adapters/a", "load_inplace": True}
    assert _post(url, "/v1/load_lora_adapter", body) == unsupported("load_inplace")
