"""Request bodies take only the fields the schemas declare: anything else is a 400 naming it
(`<path> is not supported`, `param` the path), nested objects included; null is "not sent"
for every field, and so is an empty `tools` / `functions` / `logit_bias`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tandem.protocol import openai_api as api
from tandem.protocol.web import bad_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _refused(model: type, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    e = bad_body(err.value)
    assert e.status == 400 and e.type == "invalid_request_error"
    return e.message, e.param


@pytest.mark.parametrize("model,body,param", [
    (api.ChatCompletionRequest, {**CHAT, "function_call": "auto"}, "function_call"),
    (api.ChatCompletionRequest, {**CHAT, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern"),
    (api.ChatCompletionRequest, {**CHAT, "structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    (api.CompletionRequest, {**COMPLETION, "tools": [{"type": "function"}]}, "tools"),
    (api.CompletionRequest, {**COMPLETION, "tool_choice": "auto"}, "tool_choice"),
    (api.ChatCompletionRequest, {**CHAT, "echo": True}, "echo"),  # completions only
    (api.CompletionRequest, {**COMPLETION, "max_completion_tokens": 4}, "max_completion_tokens"),
    (api.CompletionRequest, {**COMPLETION, "add_generation_prompt": False},
     "add_generation_prompt"),
    (api.ChatCompletionRequest, {**CHAT, "messages": [
        {"role": "assistant", "content": "x",
         "function_call": {"name": "f", "arguments": "{}"}}]}, "messages.0.function_call"),
    (api.ChatCompletionRequest, {**CHAT, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}",
                                                         "x": 1}}]}]},
     "messages.0.tool_calls.0.function.x"),
    (api.ChatCompletionRequest, {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi",
                                      "cache_control": {"type": "ephemeral"}}]}]},
     None),  # a content part: the union's first branch (a string) is reported first
    (api.TokenizeRequest, {"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
    (api.DetokenizeRequest, {"tokens": [1], "skip_special_tokens": True},
     "skip_special_tokens"),
    (api.LoadLoRAAdapterRequest, {"lora_name": "a", "lora_path": "/a", "load_inplace": True},
     "load_inplace"),
    (api.UnloadLoRAAdapterRequest, {"lora_name": "a", "lora_int_id": 3}, "lora_int_id"),
])
def test_undeclared_fields_are_refused_with_their_path(model: type, body: dict,
                                                       param: str | None) -> None:
    message, got = _refused(model, body)
    if param is None:  # still refused, naming where
        assert message.startswith("messages.0.content")
        with pytest.raises(ValidationError) as err:
            model.model_validate(body)
        assert any(e["type"] == "extra_forbidden" and e["loc"][-1] == "cache_control"
                   for e in err.value.errors())
        return
    assert (message, got) == (f"{param} is not supported", param)


def test_store_true_is_refused_and_false_accepted() -> None:
    assert _refused(api.ChatCompletionRequest, {**CHAT, "store": True}) == (
        "store=true is not supported: completions are not stored", "store")
    assert api.ChatCompletionRequest.model_validate({**CHAT, "store": False}).store is False
    assert _refused(api.CompletionRequest, {**COMPLETION, "store": False}) == (
        "store is not supported", "store")  # OpenAI's completions have no `store`


def test_metadata_is_bounded_as_openai_bounds_it() -> None:
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    assert api.ChatCompletionRequest.model_validate({**CHAT, "metadata": ok}).metadata == ok
    assert _refused(api.ChatCompletionRequest,
                    {**CHAT, "metadata": {**ok, "k16": "v"}})[1] == "metadata"
    assert _refused(api.ChatCompletionRequest, {**CHAT, "metadata": {"k": "v" * 513}})[1] \
        == "metadata.k"


def test_null_means_the_default_for_every_field() -> None:
    req = api.ChatCompletionRequest.model_validate({
        **CHAT, "n": None, "stream": None, "logprobs": None, "speculative": None,
        "priority": None, "add_generation_prompt": None, "tools": None, "functions": None,
        "messages": [{"role": "assistant", "content": "x", "tool_calls": None,
                      "refusal": None, "name": None}]})
    assert (req.n, req.stream, req.logprobs, req.speculative, req.priority,
            req.add_generation_prompt) == (1, False, False, True, 0, True)
    # a required field sent as null is missing
    assert _refused(api.CompletionRequest, {"prompt": None}) == ("prompt: Field required",
                                                                  "prompt")


def test_empty_means_not_sent_only_for_tools_functions_and_logit_bias() -> None:
    assert {"tools", "functions", "logit_bias"} == api.EMPTY_MEANS_UNUSED
    api.ChatCompletionRequest.model_validate({**CHAT, "tools": [], "functions": [],
                                              "logit_bias": {}})
    for field, empty in (("tool_choice", ""), ("stop_sequences", []),
                         ("response_format", {}), ("guided_choice", [])):
        assert _refused(api.ChatCompletionRequest, {**CHAT, field: empty})[1].startswith(field)


def test_validation_leaves_the_callers_body_alone() -> None:
    """The router validates the body it forwards: dropping nulls must not change it."""
    body = {**COMPLETION, "tools": None, "n": None}
    api.CompletionRequest.model_validate(body)
    assert body == {**COMPLETION, "tools": None, "n": None}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "hi", "add_special_tokens": True, "tools": [{"type": "x"}]},
     "tools"),
    ("/detokenize", {"tokens": [1, 2], "model": "m", "spaces": True}, "spaces"),
    ("/v1/chat/completions", {**CHAT, "stream": True,
                              "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_the_worker_app_answers_the_openai_400(path: str, body: dict, param: str) -> None:
    from tandem.serving.api_server import ServerSettings, build_app

    app = build_app(ServerSettings(served_model_name="m"), lambda: None)  # never reached
    r = TestClient(app, raise_server_exceptions=False).post(path, json=body)
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": f"{param} is not supported", "type": "invalid_request_error",
        "param": param, "code": 400}})
