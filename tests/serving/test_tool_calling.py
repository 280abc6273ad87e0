"""Tool calling and reasoning output on chat completions: tools, assistant tool calls and
tool results through real tool-use chat templates (Qwen2.5's hermes style, Llama 3.1's,
Mistral's); the chat responder's split of each choice into reasoning_content, content and
tool_calls, whole and streamed, n > 1; and a tool-calling loop with the official openai
client against a real worker started with `--enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3` (the tiny random model's output forced by a regex)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tandem.cli import main as cli_main
from tandem.engine.errors import InvalidRequestError
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.request import TokenizedPrompt
from tandem.protocol.chat_template import ChatTemplateError, render_chat
from tandem.protocol.openai_api import ChatCompletionRequest
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving.api_server import ServerSettings
from tandem.serving.responses import ChatResponder
from tandem.serving.tool_parsers.options import ChatParsing
from tests.engine.utils import make_tiny_model_dir, write_tiny_tokenizer
from tests.serving.tiny_worker import tiny_worker

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcDEF123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
]

# the tool-use parts of the public templates (Qwen2.5-Instruct, Llama-3.1-Instruct,
# Mistral-7B-Instruct-v0.3), as their tokenizer_config.json ship them
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""  # noqa: E501

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if tools_in_user_message and not tools is none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""  # noqa: E501

MISTRAL = """{%- set loop_messages = messages %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}{{- '"' + key + '": "' + val + '"' }}
                    {%- else %}{{- '"' + key + '": ' + val|tojson }}{%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}{{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- set content = message.content %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501


def rendered(template: str, body: dict) -> str:
    """As the worker and the router render a chat request (its template messages and
    variables)."""
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, **body})
    return render_chat(template, req.template_messages(), bos_token="<s>", eos_token="</s>",
                       **req.template_kwargs())


def test_qwen_hermes_template_renders_tools_calls_and_results():
    text = rendered(QWEN25, {"tools": TOOLS})
    assert ("<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>") in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text  # arguments as an object
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in rendered(QWEN25, {})


def test_llama31_template_renders_tools_calls_and_results():
    text = rendered(LLAMA31, {"tools": TOOLS})
    assert json.dumps(TOOLS[0], indent=4) in text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
            '"parameters": {"city": "Paris"}}<|eot_id|>') in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' in text
    two = [*HISTORY[:1], {**HISTORY[1], "tool_calls": HISTORY[1]["tool_calls"] * 2}]
    req = ChatCompletionRequest.model_validate({"messages": two})
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        render_chat(LLAMA31, req.template_messages())


def test_mistral_template_renders_tools_and_no_tools_without_them():
    text = rendered(MISTRAL, {"tools": TOOLS})
    assert text.startswith('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": '
                           '{"name": "get_weather", "description": "Weather.", "parameters": ')
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
            '"id": "abcDEF123"}]</s>') in text
    assert '[TOOL_RESULTS] {"content": sunny, "call_id": "abcDEF123"}[/TOOL_RESULTS]' in text
    # `tools` is defined (None) when a request has none, as transformers renders it
    assert "AVAILABLE_TOOLS" not in rendered(MISTRAL, {})


def test_chat_template_kwargs_reach_the_template_but_not_the_requests_own_variables():
    template = ("{% if enable_thinking is defined and not enable_thinking %}<think>\n\n"
                "</think>\n\n{% endif %}{{ messages[-1].content }}")
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False}})
    assert render_chat(template, req.template_messages(), **req.template_kwargs()) == \
        "<think>\n\n</think>\n\nhi"
    for bad in ({"tools": []}, {"messages": []}, {"add_generation_prompt": False},
                {"not-a-name": 1}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            ChatCompletionRequest.model_validate({
                "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": bad})


# -- the responder: hand-made engine outputs -------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return Tokenizer.load(str(path))


def responder(tok: Tokenizer, parsing: ChatParsing, **body) -> ChatResponder:
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body})
    return ChatResponder(req, tok, ServerSettings(served_model_name="m", chat_parsing=parsing),
                         "chatcmpl-1")


HERMES_QWEN3 = ChatParsing("hermes", True, "qwen3")
CALL_TEXT = ('<think>I should look.</think>\n\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Par\\"is {x}"}}\n</tool_call>')


def out(texts: list[str], finish: str | None = "stop", finished: bool = True) -> RequestOutput:
    return RequestOutput("r-0", None, [1, 2], [
        CompletionOutput(i, t, [5] * max(1, len(t) // 4), finish if finished else None)
        for i, t in enumerate(texts)], finished=finished)


def test_auto_tool_choice_needs_the_flags_as_in_vllm(tok):
    for parsing in (ChatParsing(), ChatParsing("hermes", False), ChatParsing(None, True)):
        with pytest.raises(InvalidRequestError, match='"auto" tool choice requires '
                           "--enable-auto-tool-choice and --tool-call-parser") as e:
            responder(tok, parsing)
        assert e.value.param == "tool_choice"
        responder(tok, parsing, tool_choice="none")  # "none": no parsing, no error
    for name, keep in (("mistral", True), ("llama3_json", True), ("hermes", True),
                       ("qwen3_coder", False)):
        params = responder(tok, ChatParsing(name, True)).params
        assert params.skip_special_tokens is not keep, name
        assert responder(tok, ChatParsing(name, True), tool_choice="none").params \
            .skip_special_tokens is True


def test_whole_choices_split_into_reasoning_content_and_tool_calls(tok):
    r = responder(tok, HERMES_QWEN3, n=2)
    body = r.body([out([CALL_TEXT, "<think>hm</think>Just text."])])
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls"
    msg = first["message"]
    assert (msg["content"], msg["reasoning_content"]) == (None, "I should look.")
    [call] = msg["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": 'Par"is {x}'}
    assert second["finish_reason"] == "stop"
    assert second["message"] == {"role": "assistant", "content": "Just text.",
                                 "reasoning_content": "hm", "tool_calls": None}
    # no parsers configured: the text is the content, as before
    plain = responder(tok, ChatParsing(), tool_choice="none").body([out([CALL_TEXT])])
    assert plain["choices"][0]["message"]["content"] == CALL_TEXT


def test_a_constraint_waits_for_the_thinking_unless_the_prompt_closed_it(tok):
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    thinking = tok.encode("<think>\nhm", add_special_tokens=False)
    closed = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    regex = {"guided_regex": "[ab]+"}
    for parsing, body, prompt, want in (
            (HERMES_QWEN3, regex, thinking, end),
            (ChatParsing(reasoning_parser="deepseek_r1"), {**regex, "tool_choice": "none"},
             [1, 2], end),
            (HERMES_QWEN3, regex, closed, None),  # enable_thinking false: constrained at once
            (HERMES_QWEN3, {"tool_choice": "required"}, thinking, end),  # a forced call too
            (HERMES_QWEN3, {}, thinking, None),  # nothing to constrain
            (ChatParsing("hermes", True), regex, thinking, None)):  # no reasoning parser
        r = responder(tok, parsing, **body)
        r.prepare([TokenizedPrompt(list(prompt))])
        assert r.params.reasoning_end_token_ids == want, (parsing, body)


def test_parallel_tool_calls_false_keeps_the_first_call(tok):
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>')
    for parallel, cities in ((True, ["A", "B"]), (False, ["A"])):
        r = responder(tok, HERMES_QWEN3, parallel_tool_calls=parallel)
        calls = r.body([out([two])])["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
        r = responder(tok, HERMES_QWEN3, parallel_tool_calls=parallel, stream=True)
        steps = [(0, out([two[k:k + 9]], finished=k + 9 >= len(two)))
                 for k in range(0, len(two), 9)]
        chunks = asyncio.run(_sse_chunks(r, steps))
        indexes = {d["index"] for c in chunks for d in c["choices"][0]["delta"].get(
            "tool_calls", ())}
        assert indexes == set(range(len(cities)))


async def _sse_chunks(r: ChatResponder, outputs: list[tuple[int, RequestOutput]]) -> list:
    async def gen():
        for item in outputs:
            yield item
    chunks = [c async for c in r.sse(gen())]
    assert chunks[-1] == "data: [DONE]\n\n"
    return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


def test_streamed_choices_each_keep_their_own_parser_state(tok):
    r = responder(tok, HERMES_QWEN3, n=2, stream=True)
    texts = [CALL_TEXT, "<think>hm</think>Just <b>text</b>."]
    steps = []
    for k in range(0, 160, 7):  # the two choices' pieces interleaved
        pieces = [t[k:k + 7] for t in texts]
        last = k + 7 >= 160
        steps.append((0, out(pieces, finished=last)))
    chunks = asyncio.run(_sse_chunks(r, steps))
    got = {0: {"reasoning": "", "content": "", "calls": {}, "finish": None},
           1: {"reasoning": "", "content": "", "calls": {}, "finish": None}}
    for chunk in chunks:
        [choice] = chunk["choices"]
        g, delta = got[choice["index"]], choice["delta"]
        assert set(delta) <= {"role", "content", "reasoning_content", "tool_calls"}
        g["reasoning"] += delta.get("reasoning_content", "")
        g["content"] += delta.get("content", "")
        for d in delta.get("tool_calls", ()):
            if "id" in d:
                assert d["index"] not in g["calls"] and d["type"] == "function"
                g["calls"][d["index"]] = [d["function"]["name"], ""]
            g["calls"][d["index"]][1] += d["function"]["arguments"]
        if choice["finish_reason"]:
            assert g["finish"] is None
            g["finish"] = choice["finish_reason"]
    assert got[0]["reasoning"] == "I should look." and got[0]["content"] == ""
    [(name, args)] = got[0]["calls"].values()
    assert name == "get_weather" and json.loads(args) == {"city": 'Par"is {x}'}
    assert got[0]["finish"] == "tool_calls"
    assert (got[1]["reasoning"], got[1]["content"], got[1]["calls"], got[1]["finish"]) == (
        "hm", "Just <b>text</b>.", {}, "stop")


def test_the_flags_are_usage_errors_when_wrong(capsys):
    for argv, message in (
            (["worker", "--enable-auto-tool-choice"],
             "--enable-auto-tool-choice needs --tool-call-parser"),
            (["serve", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"],
             "--enable-auto-tool-choice needs --tool-call-parser"),
            (["worker", "--tool-call-parser", "nope"],
             "argument --tool-call-parser: invalid choice: 'nope'"),
            (["worker", "--reasoning-parser", "r2"],
             "argument --reasoning-parser: invalid choice: 'r2'")):
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


# -- a real worker, the openai client ----------------------------------------------------
CALL_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'
              r'\n</tool_call>')


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tools")
    make_tiny_model_dir(path, "llama", seed=5)
    server, _ = tiny_worker(path, ServerSettings(served_model_name="tiny",
                                                 chat_parsing=HERMES_QWEN3))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


def test_a_tool_calling_loop_with_the_openai_client(client):
    """The prompt closes the thinking (as Qwen3's template does with enable_thinking
    false), so the regex forces the model's call from its first token."""
    messages = [{"role": "user", "content": "Weather in Paris?</think>"}]
    kw = dict(model="tiny", tools=TOOLS, max_tokens=80, temperature=1.0, seed=3,
              extra_body={"guided_regex": CALL_REGEX})
    got = client.chat.completions.create(messages=messages, **kw).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content is None
    assert got.message.reasoning_content is None  # (Qwen3's parser: no <think>, no thinking)
    [call] = got.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    # streamed: the same call (same seed), as delta.tool_calls
    calls, content, reasoning, finish = {}, "", "", None
    for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.id is not None:
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
    assert (content, reasoning, finish) == ("", "", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (call.function.name, json.loads(call.function.arguments))]
    # the loop goes on: the call and its result in the history, a plain answer back
    messages += [got.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(
        messages=messages, model="tiny", tools=TOOLS, max_tokens=20, temperature=0,
        extra_body={"guided_regex": "It is (sunny|warm)\\."}).choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert answer.message.content in ("It is sunny.", "It is warm.")
    assert answer.message.reasoning_content is None


def test_a_constraint_applies_after_the_thinking_on_a_real_worker(client):
    """The random model never closes a thinking it never opens: its output stays free
    unless the prompt already closed the thinking (then the choice is forced at once)."""
    kw = dict(model="tiny", max_tokens=12, temperature=0, tool_choice="none", tools=TOOLS,
              extra_body={"guided_choice": ["yes", "no"]})
    free = client.chat.completions.create(
        messages=[{"role": "user", "content": "Answer."}], **kw).choices[0]
    assert free.finish_reason == "length" and free.message.content not in ("yes", "no")
    forced = client.chat.completions.create(
        messages=[{"role": "user", "content": "Answer.</think>"}], **kw).choices[0]
    assert forced.finish_reason == "stop" and forced.message.content in ("yes", "no")
