"""The worker's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`)
with the official openai client against a real worker app on a real port (a tiny random
model): text and message-list input, instructions, OpenAI's streaming event sequence,
`previous_response_id` over the tenant-isolated, bounded store, and the named 400s."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tandem.protocol.responses_api import TENANT_HEADER, ResponsesRequest, tenant_target
from tandem.protocol.signing import WorkerKey, sign
from tandem.serving.api_server import ServerSettings
from tandem.serving.response_store import ResponseStore
from tandem.serving.responses_api import ResponsesResponder
from tests.engine.utils import make_tiny_model_dir
from tests.serving.helpers import WORKER_KEY, signed, worker_key_file
from tests.serving.tiny_worker import tiny_worker

NAME = "tiny"
BASE = {"model": NAME, "temperature": 0, "max_output_tokens": 6}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-responses")
    make_tiny_model_dir(path, "llama", seed=11)
    key = WorkerKey(worker_key_file(path))
    server, app = tiny_worker(path, ServerSettings(served_model_name=NAME, auth_key=key))
    yield server, app
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="none", max_retries=0)


def _chat(served, messages: list[dict], **extra) -> dict:
    r = httpx.post(f"{served[0].url}/v1/chat/completions",
                   json={"model": NAME, "temperature": 0, "max_tokens": 6,
                         "messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_text_input_is_a_user_message_and_the_answer_a_response(served, client):
    resp = client.responses.create(input="Say hello", **BASE)
    chat = _chat(served, [{"role": "user", "content": "Say hello"}])
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.model == NAME and resp.store is True
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"
    assert resp.output_text == chat["choices"][0]["message"]["content"]
    assert resp.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6


def test_instructions_and_message_items_render_as_chat_messages(served, client):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Count to 3"}]}]
    resp = client.responses.create(input=items, instructions="You are a bot.", **BASE)
    chat = _chat(served, [{"role": "system", "content": "You are a bot."},
                          {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello!"},
                          {"role": "system", "content": "Be terse."},
                          {"role": "user", "content": "Count to 3"}])
    assert resp.output_text == chat["choices"][0]["message"]["content"]
    assert resp.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert resp.instructions == "You are a bot."


EXPECTED = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done",
           "response.output_item.done", "response.completed"]


def test_stream_follows_the_openai_event_sequence(served, client):
    whole = client.responses.create(input="Tell me a story", **{**BASE, "max_output_tokens": 8})
    events = list(client.responses.create(input="Tell me a story", stream=True,
                                          **{**BASE, "max_output_tokens": 8}))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == EXPECTED + ["response.output_text.delta"] * len(deltas) + CLOSING, kinds
    assert len(deltas) >= 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    done = events[-1].response
    assert done.output_text == text and done.id == events[0].response.id
    assert done.usage.output_tokens == 8 and done.status == "incomplete"
    item_ids = {e.item_id for e in deltas} | {events[2].item.id, events[-2].item.id}
    assert len(item_ids) == 1
    # the raw wire: an SSE `event:` line naming each `data:` line's type, no [DONE]
    with httpx.stream("POST", f"{served[0].url}/v1/responses",
                      json={**BASE, "input": "Tell me a story", "stream": True}) as r:
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.split("\n")[0] == f"event: {json.loads(b.split(chr(10))[1][6:])['type']}"
               for b in blocks), raw[:500]
    assert "[DONE]" not in raw
    for b in blocks:  # each event as strict as the openai client's own types
        TypeAdapter(ResponseStreamEvent).validate_python(json.loads(b.split("\n")[1][6:]))
    r = httpx.post(f"{served[0].url}/v1/responses", json={**BASE, "input": "Hi"})
    assert Response.model_validate(r.json()).output_text


def test_stream_helper_accumulates_the_final_response(client):
    with client.responses.stream(input="Name a color", **BASE) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text and final.usage.output_tokens == 6


def test_previous_response_id_continues_the_stored_conversation(served, client):
    first = client.responses.create(input="My name is Ada.", instructions="Old rules.", **BASE)
    second = client.responses.create(input="What is my name?", instructions="New rules.",
                                     previous_response_id=first.id, **BASE)
    # the previous instructions are not carried over (as OpenAI's); the first exchange is
    chat = _chat(served, [{"role": "system", "content": "New rules."},
                          {"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    # a streamed response is stored too, and retrieval returns what was answered
    events = list(client.responses.create(input="And now?", previous_response_id=second.id,
                                          stream=True, **BASE))
    third = events[-1].response
    got = client.responses.retrieve(third.id)
    assert got.output_text == third.output_text and got.usage == third.usage
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(third.id)


def test_store_false_keeps_nothing_and_unknown_ids_are_404(client):
    resp = client.responses.create(input="Hi", store=False, **BASE)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(input="Hi", previous_response_id=resp.id, **BASE)
    assert err.value.body["param"] == "previous_response_id"


def test_another_tenants_response_is_404_like_an_unknown_id(served):
    url = served[0].url
    salt_a = "tenant=alice;ns=0123456789abcdef0123456789abcdef"
    salt_b = "tenant=bob;ns=fedcba9876543210fedcba9876543210"
    body, headers = signed({**BASE, "input": "Secret plan", "cache_salt": salt_a})
    r = httpx.post(f"{url}/v1/responses", content=body, headers=headers)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]

    def follow_up(salt: str) -> httpx.Response:
        body, headers = signed({**BASE, "input": "more", "cache_salt": salt,
                                "previous_response_id": rid})
        return httpx.post(f"{url}/v1/responses", content=body, headers=headers)

    def get(tenant: str | None, method: str = "GET") -> httpx.Response:
        headers = {} if tenant is None else {
            TENANT_HEADER: tenant, "x-tandem-signature": sign(WORKER_KEY, b"",
                                                               tenant_target(tenant))}
        return httpx.request(method, f"{url}/v1/responses/{rid}", headers=headers)

    other = follow_up(salt_b)
    assert other.status_code == 404, other.text
    unknown = httpx.post(f"{url}/v1/responses", json={**BASE, "input": "x",
                                                      "previous_response_id": "resp_nope"})
    assert other.json()["error"]["message"].replace(rid, "X") == \
        unknown.json()["error"]["message"].replace("resp_nope", "X")
    assert get("bob").status_code == 404 and get(None).status_code == 404
    assert get("bob", "DELETE").status_code == 404
    # the tenant header is honoured only signed by the router
    forged = httpx.get(f"{url}/v1/responses/{rid}", headers={TENANT_HEADER: "alice"})
    assert forged.status_code == 403
    assert get("alice").status_code == 200 and get("alice").json()["id"] == rid
    assert follow_up(salt_a).status_code == 200
    assert get("alice", "DELETE").status_code == 200
    assert get("alice").status_code == 404


YES_NO = {"type": "json_schema", "name": "answer", "strict": True,
          "schema": {"type": "string", "enum": ["yes", "no"]}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "strict": True, "parameters": {
               "type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "maxLength": 8}}}}


def test_text_format_is_structured_output_and_a_bad_schema_a_named_400(served, client):
    body = {**BASE, "temperature": 1, "max_output_tokens": 16, "text": {"format": YES_NO}}
    for _ in range(3):
        resp = client.responses.create(input="Is it raining?", **body)
        assert resp.output_text in ('"yes"', '"no"') and resp.status == "completed"
        assert resp.text.format.type == "json_schema"
    events = list(client.responses.create(input="Is it raining?", stream=True, **body))
    assert events[-1].response.output_text in ('"yes"', '"no"')
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}
    r = httpx.post(f"{served[0].url}/v1/responses",
                   json={**BASE, "input": "hi", "text": {"format": bad}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


def test_a_named_function_is_called_and_its_output_continues_the_conversation(served,
                                                                              client):
    body = {**BASE, "max_output_tokens": 40, "tools": [WEATHER]}
    first = client.responses.create(input="weather in Paris?", **body,
                                    tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"city"} and first.status == "completed"
    events = list(client.responses.create(
        input="weather in Paris?", stream=True, **body,
        tool_choice={"type": "function", "name": "get_weather"}))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"], kinds
    streamed = events[-1].response.output[0]
    assert "".join(deltas) == events[-3].arguments == streamed.arguments
    assert streamed.call_id and events[2].item.type == "function_call"
    # the tool loop: the function's output continues the stored conversation
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(input=[result], previous_response_id=first.id, **body,
                                     tool_choice="none")
    chat = _chat(served, [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}], tool_choice="none")
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"frequency_penalty": 1}, "frequency_penalty", "frequency_penalty is not supported"),
    ({"background": True}, "background", "background=true is not supported"),
    ({"truncation": "auto"}, "truncation", "truncation='auto' is not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include",
     "include 'reasoning.encrypted_content' is not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "tools of type 'web_search'"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0",
     "input items of this type are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0", "content parts of type 'input_file' are not supported"),
    ({"input": [{"role": "user", "content": "x", "foo": 1}]}, "input.0.foo",
     "input.0.foo is not supported"),
    ({"temperature": 3}, "temperature", "temperature: Input should be less than"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens: Input should be"),
    ({"input": []}, "input", "input must not be empty"),
    ({"reasoning": {"summary": "auto"}}, "reasoning", "reasoning.summary is not supported"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "needs a name and a schema"),
    ({"model": "other"}, None, "other"),
])
def test_bad_requests_are_named_400s(served, extra, param, message):
    r = httpx.post(f"{served[0].url}/v1/responses", json={**BASE, "input": "hi", **extra})
    status = 404 if extra.get("model") == "other" else 400
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and (param is None or err["param"] == param), err


def test_store_bounds_evict_by_count_and_by_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    for rid in ("a", "b"):
        assert store.put("t", rid, {"id": rid}, [])
    assert store.get("t", "a") is not None  # now the most recently used
    store.put("t", "c", {"id": "c"}, [])
    assert [store.get("t", r) is not None for r in "abc"] == [True, False, True]
    assert store.get("u", "a") is None  # another tenant
    now[0] = 9.5
    store.put("t", "d", {"id": "d"}, [])  # evicts c (least recent), a got touched
    now[0] = 10.0  # a is 10 s old: expired; d is not
    assert store.get("t", "a") is None and store.get("t", "d") is not None
    assert len(store) == 1
    tiny = ResponseStore(max_entries=5, max_bytes=60)
    assert not tiny.put("t", "big", {"text": "x" * 100}, [])
    assert tiny.put("t", "s1", {"x": 1}, []) and tiny.put("t", "s2", {"x": 2}, [])
    assert tiny.bytes <= 60 and not ResponseStore(max_entries=0).put("t", "x", {}, [])


def test_store_flags_reach_the_worker(tmp_path):
    from tandem.cli import build_parser

    args = build_parser().parse_args(["worker", "--responses-store-max", "0",
                                      "--responses-store-ttl", "5"])
    assert (args.responses_store_max, args.responses_store_ttl) == (0, 5.0)
    args = build_parser().parse_args(["worker"])
    assert (args.responses_store_max, args.responses_store_ttl) == (1000, 3600.0)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["worker", "--responses-store-ttl", "0"])
    assert exc.value.code == 2


class _Chat:
    """A chat responder's answer, given: its stream's chunks and its whole body."""

    def __init__(self, chunks: list[dict], body: dict | None = None) -> None:
        self.given, self.body = chunks, body
        self.request_id, self.model, self.created = "resp_" + "0" * 32, NAME, 1
        self.params = SimpleNamespace(temperature=1.0, top_p=1.0)

    async def chunks(self, stream):  # noqa: ANN001, ANN201
        for c in self.given:
            yield c

    async def collect(self, stream) -> dict:  # noqa: ANN001
        return self.body


def _delta(**delta) -> dict:
    finish = delta.pop("finish_reason", None)
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _call(index: int, arguments: str, **head) -> dict:
    return {"index": index, **({"id": head["id"], "type": "function"} if head else {}),
            "function": {**({"name": head["name"]} if head else {}), "arguments": arguments}}


USAGE = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 4}}


def test_reasoning_text_and_calls_become_items_in_openais_shapes():
    """Thinking, text and two tool calls, streamed and whole: each event and the response
    validate against the openai client's own types; the conversation stored goes on with
    the text and the calls (not the thinking)."""
    chunks = [_delta(role="assistant", content=""), _delta(reasoning_content="Let me"),
              _delta(reasoning_content=" think"), _delta(content="Hi"), _delta(content=" there"),
              _delta(tool_calls=[_call(0, '{"a"', id="call_1", name="f")]),
              _delta(tool_calls=[_call(0, ":1}")]),
              _delta(tool_calls=[_call(1, "{}", id="call_2", name="g")]),
              _delta(finish_reason="tool_calls"), {"choices": [], "usage": USAGE}]
    store = ResponseStore()
    req = ResponsesRequest(input="hi", stream=True)
    responder = ResponsesResponder(SimpleNamespace(store=store), req, _Chat(chunks), "t",
                                   [{"role": "user", "content": "hi"}], 1)

    async def run() -> list[str]:
        return [e async for e in responder.sse(None)]

    raw = asyncio.run(run())
    events = [TypeAdapter(ResponseStreamEvent).validate_python(
        json.loads(e.split("\n")[1][len("data: "):])) for e in raw]
    item = ["response.output_item.added", "response.content_part.added"]
    closing = ["response.content_part.done", "response.output_item.done"]
    call = ["response.output_item.added", "response.function_call_arguments.delta"]
    call_done = ["response.function_call_arguments.done", "response.output_item.done"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        *item, "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", *closing,
        *item, "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", *closing,
        *call, "response.function_call_arguments.delta", *call_done,
        *call, *call_done, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.output_index for e in events[2:-1]] == \
        [0] * 7 + [1] * 7 + [2] * 5 + [3] * 4
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call",
                                              "function_call"]
    assert final.output[0].content[0].text == "Let me think"
    assert final.output_text == "Hi there" and final.status == "completed"
    assert [(c.call_id, c.name, c.arguments) for c in final.output[2:]] == \
        [("call_1", "f", '{"a":1}'), ("call_2", "g", "{}")]
    assert (final.usage.input_tokens, final.usage.output_tokens,
            final.usage.input_tokens_details.cached_tokens) == (5, 9, 4)
    stored = store.get("t", final.id)
    assert stored.conversation[-1] == {"role": "assistant", "content": "Hi there", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    # the same answer whole
    body = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Hi there", "reasoning_content": "Let me think",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": '{"a":1}'}}]}}],
        "usage": USAGE}
    whole = ResponsesResponder(SimpleNamespace(store=store), req, _Chat([], body), "t", [], 1)
    answer = Response.model_validate(asyncio.run(whole.collect(None)))
    assert [i.type for i in answer.output] == ["reasoning", "message", "function_call"]
    assert answer.output_text == "Hi there" and answer.output[2].call_id == "call_1"


def test_a_signed_get_by_id_needs_no_api_key_on_a_keyed_worker():
    """`ApiKeyAuth` lets a signed request through to the routes under `/v1/responses/` (the
    route then checks the signature), as to the other signed routes; nothing else."""
    from tandem.serving.api_server import SIGNED_ROUTES
    from tandem.serving.worker_auth import ApiKeyAuth

    reached: list[str] = []

    async def inner(scope, receive, send) -> None:  # noqa: ANN001
        reached.append(scope["path"])

    auth = ApiKeyAuth(inner, ["k"], signed_paths=SIGNED_ROUTES, accept_signed=True)
    sent: list[dict] = []

    async def call(path: str, headers: list[tuple[bytes, bytes]]) -> None:
        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await auth({"type": "http", "path": path, "method": "GET", "headers": headers,
                    "query_string": b""}, receive, send)

    signature = [(b"x-tandem-signature", b"t=1,n=0,v1=0")]
    for path in ("/v1/responses/resp_1", "/v1/responses"):
        asyncio.run(call(path, signature))
    asyncio.run(call("/v1/models/x", signature))
    asyncio.run(call("/v1/responses/resp_1", []))
    assert reached == ["/v1/responses/resp_1", "/v1/responses"]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [401, 401]


def test_a_reasoning_parser_splits_the_thinking_into_a_reasoning_item(served, client,
                                                                      monkeypatch):
    """With `--reasoning-parser deepseek_r1` (the template opens the thinking), a model that
    never closes it thinks all along: the text is a reasoning item (and no message), whole
    and streamed."""
    import dataclasses

    from tandem.serving.tool_parsers.options import ChatParsing

    wa = served[1].state.worker_app
    monkeypatch.setattr(wa, "settings", dataclasses.replace(
        wa.settings, chat_parsing=ChatParsing(reasoning_parser="deepseek_r1")))
    plain = _chat(served, [{"role": "user", "content": "Think"}])["choices"][0]["message"]
    resp = client.responses.create(input="Think", **BASE)
    assert [i.type for i in resp.output] == ["reasoning"]  # no text: no message item
    assert resp.output[0].content[0].text == plain["reasoning_content"] != ""
    assert resp.output_text == "" and plain["content"] in (None, "")
    events = list(client.responses.create(input="Think", stream=True, **BASE))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == plain["reasoning_content"]
    assert [i.type for i in events[-1].response.output] == ["reasoning"]
    after = client.responses.create(input="Go on", previous_response_id=resp.id, **BASE)
    assert after.usage.input_tokens == _chat(served, [
        {"role": "user", "content": "Think"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "Go on"}])["usage"]["prompt_tokens"]
