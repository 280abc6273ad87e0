"""The request's output constraint (`convert.structured_outputs`) and forced tool calls
(`serving.tool_choice`): which field gives which engine constraint, the named 400s, the
"required" schema, and the streamed tool calls equal to the whole output's however the
text is split."""

from __future__ import annotations

import json
import random

import pytest

from tandem.engine.errors import InvalidRequestError
from tandem.protocol import openai_api as api
from tandem.protocol.structured_outputs import StructuredOutputs
from tandem.serving.convert import sampling_params, structured_outputs
from tandem.serving.tool_choice import ToolCallPlan, required_schema

MSG = [{"role": "user", "content": "hi"}]
POINT = {"type": "object", "properties": {"p": {"$ref": "#/$defs/xy"}}, "required": ["p"],
         "$defs": {"xy": {"type": "array", "items": {"type": "integer"}}}}
TOOLS = [{"type": "function", "function": {"name": "move", "parameters": POINT}},
         {"type": "function", "function": {"name": "stop"}}]


def _chat(**extra) -> api.ChatCompletionRequest:
    return api.ChatCompletionRequest.model_validate({"messages": MSG, **extra})


def _spec(**extra) -> tuple[StructuredOutputs | None, str | None]:
    return structured_outputs(_chat(**extra))


def test_each_field_gives_its_constraint() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    canonical = '{"type":"object","properties":{"b":{"type":"integer"},"a":{}}}'  # key order kept
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema, "strict": True}}},
         StructuredOutputs(json=canonical), "response_format"),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True),
         "response_format"),
        ({"guided_json": json.dumps(schema)}, StructuredOutputs(json=canonical), "guided_json"),
        ({"guided_regex": "a+"}, StructuredOutputs(regex="a+"), "guided_regex"),
        ({"guided_choice": ["x", "y"]}, StructuredOutputs(choice=("x", "y")), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"'),
         "guided_grammar"),
        ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
         StructuredOutputs(json=canonical, disable_any_whitespace=True),
         "structured_outputs.json"),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True),
         "structured_outputs.json_object"),
        ({"response_format": {"type": "json_object"},
          "structured_outputs": {"disable_any_whitespace": True}},
         StructuredOutputs(json_object=True, disable_any_whitespace=True), "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "stop"}}},
         StructuredOutputs(json='{"type":"object","properties":{}}'), "tool_choice"),
    ]
    for extra, want, param in cases:
        assert _spec(**extra) == (want, param), extra
    assert _spec(response_format={"type": "text"}) == (None, None)
    assert _spec(tools=TOOLS, tool_choice="none") == (None, None)
    completion = api.CompletionRequest.model_validate({"prompt": "x", "guided_regex": "b"})
    assert sampling_params(completion, 4).structured_outputs == StructuredOutputs(regex="b")


@pytest.mark.parametrize("extra,param,message", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "guided_regex and guided_choice cannot be used together"),
    ({"structured_outputs": {"regex": "a", "grammar": "g"}}, "structured_outputs.grammar",
     "structured_outputs.regex and structured_outputs.grammar cannot be used together"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs",
     "structured_outputs: give one of json, regex, choice, grammar or json_object"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: the JSON schema is not valid"),
    ({"guided_json": "[1]"}, "guided_json",
     "guided_json: the JSON schema must be a JSON object"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format and tool_choice cannot be used together"),
])
def test_what_the_engine_cannot_take_names_its_field(extra, param, message) -> None:
    with pytest.raises(InvalidRequestError) as err:
        sampling_params(_chat(**extra), 4)
    assert (err.value.param, str(err.value)[:len(message)]) == (param, message)


def test_tool_choice_and_tool_messages_are_checked_by_the_schema() -> None:
    bad = [({"tool_choice": "required"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice"),
           ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
           ({"guided_json": [1]}, "guided_json"),
           ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
           ({"tools": TOOLS + TOOLS[:1]}, "tools"),
           ({"guided_choice": ["a"] * 257}, "guided_choice"),
           ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice.1"),
           ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
           ({"messages": [{"role": "tool", "content": "1"}]}, "messages.0"),
           ({"messages": [{"role": "user", "content": "1", "tool_call_id": "c"}]},
            "messages.0"),
           ({"messages": [{"role": "user", "content": "1", "tool_calls": []}]}, "messages.0")]
    for extra, param in bad:
        with pytest.raises(Exception) as err:
            _chat(**extra)
        assert err.value.errors()[0]["loc"] == tuple(  # type: ignore[attr-defined]
            int(p) if p.isdigit() else p for p in param.split(".")), extra
    req = _chat(messages=[
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "move", "arguments": '{"p": [1]}'}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"}], tools=TOOLS)
    assert req.template_messages() == [
        {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "move", "arguments": {"p": [1]}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"}]
    assert req.template_kwargs() == {"tools": TOOLS}
    assert req.effective_tool_choice() == "auto" and _chat().effective_tool_choice() == "none"


def test_required_schema_hoists_defs_and_bounds_parallel_calls() -> None:
    tools = _chat(tools=TOOLS).tools
    schema = required_schema(tools, parallel=False)
    assert schema["$defs"] == POINT["$defs"] and (schema["minItems"], schema["maxItems"]) == (1, 1)
    move, stop = schema["items"]["anyOf"]
    assert move["properties"]["name"] == {"type": "string", "enum": ["move"]}
    assert "$defs" not in move["properties"]["parameters"]
    assert stop["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_schema(tools)
    clash = _chat(tools=[TOOLS[0], {"type": "function", "function": {
        "name": "other", "parameters": {**POINT, "$defs": {"xy": {"type": "string"}}}}}]).tools
    with pytest.raises(InvalidRequestError) as err:
        required_schema(clash)
    assert err.value.param == "tools" and "'xy'" in str(err.value)


def _replay(plan: ToolCallPlan, text: str, rng: random.Random) -> tuple[str, list]:
    """`text` streamed in random pieces: (content, [(name, arguments)])."""
    stream = plan.stream()
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    content, calls = "", {}
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        more, deltas = stream.feed(text[a:b])
        content += more
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function"
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    content += stream.finish()[0]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_streamed_calls_equal_the_whole_output_however_split() -> None:
    plan = ToolCallPlan.for_request(_chat(tools=TOOLS, tool_choice="required"))
    assert plan is not None and plan.required
    text = ('[{"name": "move", "parameters": {"p": [1, -2], "s": "a\\"}]"}},'
            ' {"parameters":{}, "name":"stop"}, {"name": "stop", "parameters": {"k": null}},'
            ' {"name": "move", "parameters": {"p": []}}]')
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in plan.tool_calls(text)]
    assert [n for n, _ in whole] == ["move", "stop", "stop", "move"]
    rng = random.Random(0)
    for _ in range(50):
        content, calls = _replay(plan, text, rng)
        assert content == "" and [(n, json.loads(a)) for n, a in calls] == whole
    assert plan.finish_reason("stop", True) == "tool_calls"
    assert plan.finish_reason("length", True) == "length"
    cut = '[{"name": "move", "parameters": {"p": [1'  # max_tokens: the call begun is kept
    assert [(c.function.name, c.function.arguments) for c in plan.tool_calls(cut)] == [
        ("move", '{"p": [1')] and _replay(plan, cut, rng) == ("", [("move", '{"p": [1')])
    # not the expected shape: all of it is content, and no tool_calls
    for other in ("Sure! [1, 2]", '{"name": "move"}', "[1, 2]"):
        assert plan.tool_calls(other) is None
        assert _replay(plan, other, rng) == (other, [])
    named = ToolCallPlan.for_request(_chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "move"}}))
    assert named is not None and not named.required
    assert _replay(named, '{"p": [3]}', rng) == ("", [("move", '{"p": [3]}')])
    assert named.finish_reason("stop", True) == "stop"
    [call] = named.tool_calls('{"p": [3]}')
    assert (call.function.name, call.function.arguments) == ("move", '{"p": [3]}')
    assert call.id.startswith("chatcmpl-tool-")
