"""Fuzzing the HTTP sockets: schemathesis generates requests (valid and invalid, from each
server's own /openapi.json) for every operation of a real worker (a tiny random model) and of
a router in front of it. Whatever comes in: no 5xx, no hang, every 4xx a well-formed OpenAI
error, every 2xx a valid answer (a completion or chat completion against its pydantic model,
an event stream of JSON events ending `[DONE]`); both servers serve afterwards."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from tandem.protocol.openai_api import ChatCompletionResponse, CompletionResponse
from tandem.serving.api_server import ServerSettings
from tests.engine.utils import make_tiny_model_dir
from tests.router.test_router_app import router_app
from tests.serving.tiny_worker import tiny_worker

EXAMPLES = 12  # per operation and server: the suite's time budget
TIMEOUT_S = 30.0  # an answer slower than this is a hang
MODEL = "fuzz-tiny"
ANSWERS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionResponse}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(worker URL, router URL): the tiny model's worker and a router with /openapi.json."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")  # a fuzzed adapter path must not reach the network
    path = tmp_path_factory.mktemp("fuzz-model")
    make_tiny_model_dir(path, max_position_embeddings=128)  # bounds every generation
    worker, _ = tiny_worker(path, ServerSettings(served_model_name=MODEL))
    router = router_app([worker.url], openapi=True)
    deadline = time.monotonic() + 10
    while httpx.get(router.url + "/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the router did not see its worker ready"
        time.sleep(0.1)
    yield worker.url, router.url
    router.stop()
    worker.stop()
    mp.undo()


def openai_error(body: object) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and {"message", "type", "param", "code"} <= set(body["error"])
            and isinstance(body["error"]["message"], str))


def check_answer(path: str, resp: httpx.Response | object) -> None:
    status = resp.status_code
    assert status < 500, (path, status, resp.text[:500])
    ctype = resp.headers.get("content-type", "")
    if status >= 400:
        assert openai_error(resp.json()), (path, status, resp.text[:500])
    elif "text/event-stream" in ctype:
        events = [ln[5:].strip() for ln in resp.text.splitlines() if ln.startswith("data:")]
        assert events and events[-1] == "[DONE]", (path, resp.text[-300:])
        for e in events[:-1]:
            obj = json.loads(e)
            assert isinstance(obj, dict) and ("error" not in obj or openai_error(obj)), e
    elif path in ANSWERS and status == 200:
        ANSWERS[path].model_validate(resp.json())
    elif "json" in ctype:
        json.loads(resp.text)


def fuzz_operation(op, base: str) -> None:
    """EXAMPLES cases of `op` (positive and negative) against `base`; the first bad answer
    raises."""
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def one(case) -> None:
        if isinstance(case.body, dict) and op.path in (*ANSWERS, "/v1/responses"):
            case.body.setdefault("model", MODEL)  # reach the engine, not only the 404
        resp = case.call(base_url=base, timeout=TIMEOUT_S)
        check_answer(f"{op.method.upper()} {op.path} {case.body!r:.300}", resp)

    one()


def fuzz(base: str) -> tuple[int, list[str]]:
    """Every operation of `base`'s own /openapi.json: (operations, failures)."""
    doc = httpx.get(base + "/openapi.json", timeout=10).json()
    config = SchemathesisConfig()
    config.projects.default.generation.update(modes=list(GenerationMode))
    schema = schemathesis.openapi.from_dict(doc, config=config)
    ops = [r.ok() for r in schema.get_all_operations()]
    failures = []
    for op in ops:
        try:
            fuzz_operation(op, base)
        except Exception as exc:  # noqa: BLE001 - every operation's failure, reported together
            failures.append(f"{op.method.upper()} {op.path}: {exc!r:.1500}")
    return len(ops), failures


@pytest.mark.parametrize("which", ["worker", "router"])
def test_every_operation_answers_fuzzed_requests_without_5xx(servers, which):
    base = servers[0] if which == "worker" else servers[1]
    operations, failures = fuzz(base)
    assert operations >= 10 and not failures, "\n".join(failures)
    r = httpx.post(base + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "still serving", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_token_id_beyond_any_vocabulary_gets_the_workers_400_through_the_router(servers):
    # the router hashed every full block of a token-id prompt as uint32: an id of 2**32 or
    # more was an OverflowError, a 500 (found by the fuzzing above)
    for base in servers:
        r = httpx.post(base + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": [[7, 2**32, 9, 4097233162999.0, 1475, 3, 5, 8]],
            "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "prompt token ids must be integers in [0, 49152)"
        assert r.json()["error"]["param"] == "prompt"


def test_the_routers_openapi_describes_the_bodies_it_forwards(servers):
    worker = httpx.get(servers[0] + "/openapi.json", timeout=10).json()
    router = httpx.get(servers[1] + "/openapi.json", timeout=10).json()
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/responses", "ResponsesRequest")):
        body = router["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
        fields = router["components"]["schemas"][model]["properties"].keys()
        if model in worker["components"]["schemas"]:  # the worker's own, where it has one
            assert fields == worker["components"]["schemas"][model]["properties"].keys()
        assert {"model", "stream"} <= fields
        error = router["paths"][path]["post"]["responses"]["4XX"]["content"]
        assert error["application/json"]["schema"] == {"$ref": "#/components/schemas/"
                                                                 "ErrorResponse"}
