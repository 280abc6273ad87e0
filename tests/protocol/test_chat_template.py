"""Sandboxed chat-template rendering: HF-compatible helpers, validation, hostile templates."""

from __future__ import annotations

import datetime

import pytest

from tandem.protocol.chat_template import (
    ChatTemplateError,
    _compiled,
    compile_template,
    render_chat,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
USER = [{"role": "user", "content": "Hi"}]


def test_chatml_render_and_generation_prompt() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, *USER]
    out = render_chat(CHATML, msgs)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert not render_chat(CHATML, msgs, add_generation_prompt=False).endswith("assistant\n")


def test_trim_and_lstrip_blocks_like_hf() -> None:
    template = "  {% for m in messages %}\n[{{ m.content }}]\n  {% endfor %}\n"
    assert render_chat(template, USER * 2) == "[Hi]\n[Hi]\n"


def test_special_tokens_and_extra_kwargs() -> None:
    template = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ custom }}"
    assert render_chat(template, USER, bos_token="<s>", eos_token="</s>", custom="!") == \
        "<s>Hi</s>!"


def test_raise_exception_becomes_chat_template_error() -> None:
    template = ("{% if messages[0].role != 'system' %}{{ raise_exception('need system') }}"
                "{% endif %}")
    with pytest.raises(ChatTemplateError, match="need system"):
        render_chat(template, USER)


def test_tojson_matches_hf_semantics() -> None:
    template = "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}"
    out = render_chat(template, USER, tools=[{"name": "é", "n": 1}])
    assert out.startswith('[{"name": "é", "n": 1}]|[\n  {')


def test_strftime_now_and_loop_controls_and_generation_tag() -> None:
    template = ("{{ strftime_now('%Y') }}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert render_chat(template, USER * 3) == f"{datetime.datetime.now():%Y}Hi"


def test_content_parts_are_joined_and_input_not_mutated() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "user", "content": parts}]
    assert render_chat("{{ messages[0].content }}", msgs) == "a\nb"
    assert msgs[0]["content"] is parts


def test_tool_call_message_may_have_null_content() -> None:
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert render_chat("{{ messages[0].tool_calls[0].id }}", msgs) == "1"


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list"),
    ([["user", "hi"]], "must be a dict"),
    ([{"content": "hi"}], "'role'"),
    ([{"role": "", "content": "hi"}], "'role'"),
    ([{"role": 3, "content": "hi"}], "'role'"),
    ([{"role": "user"}], "missing 'content'"),
    ([{"role": "user", "content": 5}], "'content' must be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
    ([{"role": "user", "content": [{"type": "text"}]}], "without a string"),
    ([{"role": "user", "content": ["x"]}], "unsupported content part"),
])
def test_bad_messages(messages: object, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(CHATML, messages)  # type: ignore[arg-type]


def test_chat_template_error_is_value_error() -> None:
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ().__class__.__bases__[0].__subclasses__() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
    "{% set x = messages.append({'role': 'x'}) %}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ lipsum.__globals__['os'].system('id') }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
])
def test_malicious_templates_are_blocked(template: str) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        render_chat(template, msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


def test_sandbox_blocks_subclass_walk_to_os() -> None:
    template = ("{% for c in ().__class__.__base__.__subclasses__() %}"
                "{% if c.__name__ == 'Popen' %}{{ c('touch /tmp/x', shell=True) }}{% endif %}"
                "{% endfor %}")
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe|failed"):
        render_chat(template, USER)


@pytest.mark.parametrize("template", [
    "{{ 'a' * 100000000 }}",
    "{{ [1] * 100000000 }}",
    "{{ 2 ** 100000000 }}",
    "{% set s = 'x' * 3000000 %}{{ s + s }}",
])
def test_huge_values_are_refused(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="too large"):
        render_chat(template, USER)


def test_output_size_is_bounded() -> None:
    template = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="exceeds"):
        render_chat(template, [{"role": "user", "content": "x" * 100}], max_output_chars=10_000)
    assert len(render_chat(template, USER, max_output_chars=300_000)) == 200_000


@pytest.mark.parametrize("template, match", [
    ("{% for m in messages %}", "syntax"),
    ("{{ messages[0].content | nosuchfilter }}", "syntax|compile|filter"),
    ("{{ undefined_fn() }}", "failed"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_broken_templates(template: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(template, USER)


def test_templates_are_compiled_once() -> None:
    template = "{{ messages | length }} cached"
    compile_template.cache_clear()
    _compiled.cache_clear()
    for _ in range(5):
        assert render_chat(template, USER) == "1 cached"
    assert compile_template.cache_info().misses == 1  # compiled once
    info = _compiled.cache_info()  # (template, its globals) looked up per render
    assert info.misses == 1 and info.hits == 4
