"""Structured outputs and forced tool calls through the OpenAI API, with the official openai
client against a real worker app on a real port (a tiny random model: whatever it would
write, the grammar makes the output valid), and through the router: `response_format`
(json_schema via `parse()`, json_object), vLLM's `guided_*` and `structured_outputs`,
`tool_choice` "required" and named, streamed and not, tool messages in the history, and the
named 400s for what cannot be honoured."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tandem.engine.config import EngineConfig
from tandem.protocol.tokenizer import Tokenizer
from tandem.router import prompt as router_prompt
from tandem.serving.api_server import ServerSettings
from tests.engine.utils import make_tiny_model_dir
from tests.router.test_router_app import _wait_ready, router_app
from tests.serving.tiny_worker import tiny_worker
from tests.structured_schemas import is_valid, random_schema

NAME = "tiny"
MSG = [{"role": "user", "content": "Answer in JSON."}]
# a random model would write whitespace between JSON tokens without end
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
             "required": ["zone"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _bounded(schema: dict) -> dict:
    """`schema` with every string and array bounded (a random model never ends a free
    string on its own), numbers as bounded integers."""
    out = dict(schema)
    kind = out.get("type")
    if kind == "object":
        out["properties"] = {k: _bounded(v) for k, v in out["properties"].items()}
    elif kind == "array":
        out["items"] = _bounded(out["items"])
        out["maxItems"] = min(out.get("maxItems", 2), 2)
        out["minItems"] = min(out.get("minItems", 0), out["maxItems"])
    elif kind == "string" and "enum" not in out:
        out["maxLength"] = min(out.get("maxLength", 6), 6)
        out["minLength"] = min(out.get("minLength", 0), out["maxLength"])
    elif kind == "number":
        out = {"type": "integer", "minimum": -50, "maximum": 50}
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-structured")
    make_tiny_model_dir(path, "llama", seed=5)
    server, _ = tiny_worker(path, ServerSettings(served_model_name=NAME))
    yield server, path
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="none", max_retries=0)


def _stream_text(client: openai.OpenAI, **kw) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def _streamed_calls(client: openai.OpenAI, **kw) -> tuple[list[dict], str, str | None]:
    """The streamed tool calls (each call's argument fragments joined), content, finish."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.id is not None:  # a call's first chunk: id, type and name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], content, finish


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")
    days: int = Field(ge=1, le=7)


def test_parse_returns_the_pydantic_object(client) -> None:
    got = client.beta.chat.completions.parse(model=NAME, messages=MSG, response_format=Weather,
                                             max_tokens=120, temperature=0, extra_body=TIGHT)
    parsed = got.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 7
    assert got.choices[0].finish_reason == "stop"


def test_parse_with_a_strict_function_tool(client) -> None:
    """The openai client's tool helper: the forced call's arguments parse into the model."""
    got = client.beta.chat.completions.parse(
        model=NAME, messages=MSG, max_tokens=120, temperature=0, extra_body=TIGHT,
        tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
        parallel_tool_calls=False)
    [call] = got.choices[0].message.tool_calls
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments,
                                                          Weather)
    assert got.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", [3, 11])
def test_random_schemas_give_valid_json(client, seed: int) -> None:
    """Seeded random schemas at temperature 0 and 1, streamed and not: valid JSON."""
    schema = _bounded(random_schema(seed, max_depth=2, max_props=3))
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                   "strict": True}}
    for temperature in (0.0, 1.0):
        kw = dict(model=NAME, messages=MSG, max_tokens=200, temperature=temperature,
                  seed=seed, response_format=fmt, extra_body=TIGHT)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "stop", whole.message.content
        assert is_valid(json.loads(whole.message.content), schema), whole.message.content
        text, finish = _stream_text(client, **kw)
        assert finish == "stop" and is_valid(json.loads(text), schema), text
        if temperature == 0:
            assert text == whole.message.content


def test_json_object_and_vllm_constraints(client, served) -> None:
    obj = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=60,
                                         temperature=0,
                                         response_format={"type": "json_object"},
                                         extra_body=TIGHT)
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict), content
    else:  # an object the model never closes: still one, cut short
        assert content.lstrip().startswith("{")
    choice = client.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=10, temperature=1.0, seed=1,
        extra_body={"guided_choice": ["yes", "no", "maybe not"]})
    assert choice.choices[0].message.content in ("yes", "no", "maybe not")
    nested = client.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert nested.choices[0].message.content in ("left", "right")
    regex = client.completions.create(model=NAME, prompt="Code:", max_tokens=12, temperature=1,
                                      seed=2, extra_body={"guided_regex": "[A-F]{3}-[0-9]{2}"})
    assert re.fullmatch("[A-F]{3}-[0-9]{2}", regex.choices[0].text), regex.choices[0].text
    grammar = client.completions.create(
        model=NAME, prompt="Say:", max_tokens=12, temperature=1, seed=3,
        extra_body={"guided_grammar": 'root ::= "ab" ("c" | "d") "!"'})
    assert grammar.choices[0].text in ("abc!", "abd!")


def test_required_tool_calls_validate_streamed_and_not(client) -> None:
    for parallel in (True, False):
        kw = dict(model=NAME, messages=MSG, max_tokens=200, temperature=1.0, seed=7,
                  tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                  extra_body=TIGHT)
        got = client.chat.completions.create(**kw).choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content is None
        calls = got.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
            assert is_valid(json.loads(call.function.arguments), PARAMS[call.function.name])
        streamed, content, finish = _streamed_calls(client, **kw)
        assert (content, finish) == ("", "tool_calls")
        assert [c["name"] for c in streamed] == [c.function.name for c in calls]
        assert [json.loads(c["arguments"]) for c in streamed] == [
            json.loads(c.function.arguments) for c in calls]  # same seed, same calls


def test_named_tool_call_validates_streamed_and_not(client) -> None:
    kw = dict(model=NAME, messages=MSG, max_tokens=120, temperature=0, tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              extra_body=TIGHT)
    got = client.chat.completions.create(**kw).choices[0]
    assert got.finish_reason == "stop" and got.message.content is None  # as OpenAI's
    [call] = got.message.tool_calls
    assert call.function.name == "get_weather"
    assert is_valid(json.loads(call.function.arguments), WEATHER)
    streamed, content, finish = _streamed_calls(client, **kw)
    assert (content, finish) == ("", "stop")
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        ("get_weather", call.function.arguments)]


def test_tool_history_renders_as_the_router_renders_it(client, served) -> None:
    """Assistant tool calls and tool results go through the chat template; the router's
    tokenization of the same body is the worker's (same prompt tokens)."""
    messages = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "assistant", "content": "It is noon.", "reasoning_content": "easy"},
        {"role": "user", "content": "And the weather?"}]
    body = {"model": NAME, "messages": messages, "tools": TOOLS, "max_tokens": 2,
            "temperature": 0, "tool_choice": "none"}  # "auto" needs a tool-call parser
    got = client.chat.completions.create(**body)
    ids = router_prompt.parse("chat", body, Tokenizer.load(served[1])).token_ids
    assert got.usage.prompt_tokens == len(ids)
    plain = client.chat.completions.create(**{**body, "messages": MSG, "tools": None})
    assert got.usage.prompt_tokens > plain.usage.prompt_tokens


def _error(served, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    r = httpx.post(served[0].url + path, json={"model": NAME, "max_tokens": 4, **body},
                   timeout=60)
    return r.status_code, r.json().get("error", {})


@pytest.mark.parametrize("extra,param,message", [
    # the grammar library's own errors, at admission
    ({"guided_regex": "(ab"}, "guided_regex", "guided_regex: cannot compile"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar",
     "guided_grammar: cannot compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "response_format: cannot compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "http://x"}}}}}},
     "response_format", "is not local"),
    ({"guided_json": {"type": "object", "description": "x" * 70_000}}, "guided_json",
     "more than the limit of 65536"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json", "response_format and guided_json cannot be used together"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "the function 'nope' is not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "guided_regex and tool_choice cannot be used together"),
    ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "unknown backend"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type",
     "response_format type 'structural_tag' is not supported"),
])
def test_what_cannot_be_honoured_is_a_named_400(served, extra, param, message) -> None:
    """Bad schemas, grammars and combinations: a 400 naming the field, never a 500."""
    status, error = _error(served, {"messages": MSG, **extra})
    assert (status, error.get("param"), error.get("type")) == (400, param,
                                                              "invalid_request_error"), error
    assert message in error["message"], error


def test_completions_refuse_a_bad_constraint_and_the_wrong_backend(served) -> None:
    status, error = _error(served, {"prompt": "x", "guided_choice": []}, "/v1/completions")
    assert (status, error["param"]) == (400, "guided_choice")
    ours = EngineConfig.structured_outputs_backend  # what the worker decodes with
    other = ({"xgrammar", "llguidance"} - {ours}).pop()
    status, error = _error(served, {"prompt": "x", "guided_regex": "a",
                                    "guided_decoding_backend": other}, "/v1/completions")
    assert (status, error["param"]) == (400, "guided_decoding_backend")
    assert f"this server decodes with {ours!r}" in error["message"]
    for name in ("auto", ours):
        r = httpx.post(served[0].url + "/v1/completions", json={
            "model": NAME, "prompt": "x", "max_tokens": 2, "guided_regex": "a",
            "guided_decoding_backend": name})
        assert (r.status_code, r.json()["choices"][0]["text"]) == (200, "a")


def test_through_the_router(served) -> None:
    router = router_app([served[0].url])
    try:
        _wait_ready(router.url, 1)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        got = client.beta.chat.completions.parse(model=NAME, messages=MSG, max_tokens=120,
                                                 temperature=0, response_format=Weather,
                                                 extra_body=TIGHT)
        assert isinstance(got.choices[0].message.parsed, Weather)
        calls, content, finish = _streamed_calls(
            client, model=NAME, messages=MSG, max_tokens=200, temperature=0, tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, extra_body=TIGHT)
        assert (len(calls), content, finish) == (1, "", "tool_calls")
        assert is_valid(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])
        r = httpx.post(router.url + "/v1/chat/completions", json={
            "model": NAME, "messages": MSG, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tool_choice")
    finally:
        router.stop()
