"""Tool-call parsers (`serving/tool_parsers`): seeded random calls rendered in each model
family's format and streamed in random pieces give back exactly their names and arguments,
the streamed argument fragments concatenating to JSON; plain and malformed output is
content; what a parser holds back is bounded."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from tandem.protocol import engine_flags
from tandem.serving.tool_parsers import (
    ExtractedToolCalls,
    StreamDelta,
    get_tool_parser,
    tool_parser_names,
)
from tandem.serving.tool_parsers.base import MAX_HELD_CHARS
from tandem.serving.tool_parsers.json_stream import JsonScanner

# text that a careless parser would take for structure
TRICKY = ['"', "\\", "{", "}", "[", "]", ",", ":", ";", "<tool_call>", "</tool_call>",
          "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<function=x>", "</parameter>", "\n",
          "é", "日本", "🙂", "\t", "\u0001", "null", "true", "1e5", "<", "[TOOL"]


def rand_string(rng: random.Random, tricky: bool = True) -> str:
    parts = [rng.choice(TRICKY) if tricky and rng.random() < 0.3
             else "".join(rng.choice("abcxyz _-") for _ in range(rng.randint(0, 6)))
             for _ in range(rng.randint(0, 5))]
    return "".join(parts)


def rand_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "null", "obj", "arr"] if depth < 3
                      else ["str", "int", "float", "bool", "null"])
    if kind == "str":
        return rand_string(rng)
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -3.25, 1e-7, 2.5e10, 123.0])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "obj":
        return rand_args(rng, depth + 1)
    return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def rand_args(rng: random.Random, depth: int = 0) -> dict:
    return {rand_string(rng, tricky=rng.random() < 0.3) + str(i): rand_value(rng, depth)
            for i in range(rng.randint(0, 4))}


def rand_name(rng: random.Random) -> str:
    return rng.choice(["get_weather", "search", "f", "run_code", "a.b-c_9"])


def dumps(rng: random.Random, value) -> str:
    return json.dumps(value, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, None, 2]),
                      separators=rng.choice([None, (",", ":")]))


def content_text(rng: random.Random) -> str:
    """Plain text for before the calls: may hold a marker's start, never a whole marker."""
    return rng.choice(["", "", "Let me check.", "Sure <b>x</b> [TOOL", "a < b { c",
                       "Calling <tool_", "ok\n\n"])


# -- each format's renderer: (text, expected content) ----------------------------------
def render_hermes(rng, calls):
    before = content_text(rng)
    body = "".join(f"<tool_call>\n{dumps(rng, {'name': n, 'arguments': a})}\n</tool_call>\n"
                   for n, a in calls)
    return before + ("\n" if before else "") + body, before.rstrip() or None


def render_llama3_json(rng, calls):
    sep = rng.choice(["; ", ";", " ;\n"])
    key = rng.choice(["parameters", "arguments"])
    body = sep.join(dumps(rng, {"name": n, key: a}) for n, a in calls)
    return rng.choice(["", "<|python_tag|>", " "]) + body, None


def render_mistral(rng, calls):
    before = content_text(rng)
    if rng.random() < 0.5:  # v3: one JSON array
        body = "[TOOL_CALLS]" + dumps(rng, [{"name": n, "arguments": a} for n, a in calls])
    else:  # v11+: one marker per call
        body = "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(rng, a)}" for n, a in calls)
    return before + body, before.rstrip() or None


def qwen3_value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_qwen3_coder(rng, calls):
    before = content_text(rng)
    out = [before + ("\n" if before else "")]
    for name, args in calls:
        out.append(f"<tool_call>\n<function={name}>\n")
        for k, v in args.items():
            out.append(f"<parameter={k}>\n{qwen3_value(v)}\n</parameter>\n")
        out.append("</function>\n</tool_call>\n")
    return "".join(out), before.rstrip() or None


_TYPE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object",
         list: "array"}


def qwen3_calls(rng: random.Random) -> tuple[list, list]:
    """Calls whose parameter names and string values the XML format can carry, and the
    tools (schemas) that type them."""
    calls, tools = [], {}
    for _ in range(rng.randint(1, 3)):
        name = rand_name(rng)
        args = {}
        for i in range(rng.randint(0, 4)):
            v = rand_value(rng)
            if isinstance(v, str):
                v = v.replace("</parameter>", "").strip("\n") or "x"
            key = f"p{i}"
            if v is None or "</parameter>" in qwen3_value(v):  # the format cannot carry it
                continue
            args[key] = v
            props = tools.setdefault(name, {})
            props[key] = {"type": _TYPE[type(v)]}
        calls.append((name, args))
    for name, args in calls:  # one schema per name: a parameter's type must agree
        for k, v in args.items():
            tools[name][k] = {"type": _TYPE[type(v)]}
    fixed = [(n, {k: v for k, v in a.items() if tools[n][k]["type"] == _TYPE[type(v)]})
             for n, a in calls]
    return fixed, [{"type": "function", "function": {
        "name": n, "parameters": {"type": "object", "properties": p}}} for n, p in tools.items()]


RENDER = {"hermes": render_hermes, "llama3_json": render_llama3_json,
          "mistral": render_mistral, "qwen3_coder": render_qwen3_coder}


def random_pieces(rng: random.Random, text: str) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 40))))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def stream(parser, pieces: list[str]) -> list[StreamDelta]:
    s = parser.streaming()
    return [s.feed(p) for p in pieces] + [s.finish()]


def streamed_calls(deltas: list[StreamDelta]) -> tuple[str, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]), checking that each call's first delta carries
    its id and name, later ones neither, and indexes go 0, 1, 2, ... in order."""
    calls: list[list[str]] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.index == len(calls):
                assert c.id and c.name, c
                calls.append([c.id, c.name, c.arguments])
            else:
                assert c.index == len(calls) - 1 and c.id is None and c.name is None, c
                calls[-1][2] += c.arguments
    return "".join(d.content for d in deltas), [tuple(c) for c in calls]


def test_the_registry_has_vllms_names_as_the_flag_offers_them():
    assert tool_parser_names() == tuple(sorted(engine_flags.TOOL_CALL_PARSERS))
    with pytest.raises(KeyError, match="unknown tool-call parser 'nope'; known: hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("fmt", sorted(RENDER))
def test_random_calls_in_random_pieces_give_back_their_names_and_arguments(fmt):
    rng = random.Random(f"tool-parsers-{fmt}")
    for case in range(150):
        if fmt == "qwen3_coder":
            calls, tools = qwen3_calls(rng)
        else:
            calls = [(rand_name(rng), rand_args(rng)) for _ in range(rng.randint(1, 3))]
            tools = None
        text, content = RENDER[fmt](rng, calls)
        parser = get_tool_parser(fmt)(tools)
        whole = parser.extract(text)
        assert whole.tools_called, (case, text)
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls, text
        assert whole.content == content, text
        assert len({c.id for c in whole.tool_calls}) == len(calls)
        if fmt == "mistral":
            assert all(len(c.id) == 9 and c.id.isalnum() for c in whole.tool_calls)
        for _ in range(8):
            got_content, got = streamed_calls(stream(parser, random_pieces(rng, text)))
            assert [(name, json.loads(args)) for _, name, args in got] == calls, text
            assert (got_content or None) == content, (text, got_content)


@pytest.mark.parametrize("fmt", sorted(RENDER))
def test_plain_text_is_content_exactly(fmt):
    rng = random.Random(f"plain-{fmt}")
    texts = ["", "Hello!", "  spaced  \n", "a < b and {x} [y]", "<tool", "[TOOL_CALLS",
             '{"answer": 42}', "Use <tool_call> tags", "😀 ünïcode", "<|python_tag",
             "x" * 5000]
    for text in texts:
        parser = get_tool_parser(fmt)()
        assert parser.extract(text) == ExtractedToolCalls(False, [], text)
        for _ in range(20):
            content, calls = streamed_calls(stream(parser, random_pieces(rng, text)))
            assert calls == [] and content == text, (text, content)


MALFORMED = {
    "hermes": ['<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
               "<tool_call>not json</tool_call> after", '<tool_call>{"name": 7}</tool_call>',
               '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
               '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut short
               "text <tool_call>", '<tool_call>["f"]</tool_call>'],
    "llama3_json": ['{"name": "f", "parameters": {"a": tru}}', '{"name": "f", "parameters"',
                    '{"nam": "f"}', '<|python_tag|>{"name": "f", "parameters": 3}'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_CALLS] not a call", '[TOOL_CALLS][{"name": 1}]',
                "[TOOL_CALLS]f[ARGS]not json", 'hi [TOOL_CALLS][{"name": "f", "arg'],
    "qwen3_coder": ["<tool_call>\nno function</tool_call>", "<tool_call>\n<function=f",
                    "<tool_call>\n<function=>\n</function></tool_call>"],
}


@pytest.mark.parametrize("fmt", sorted(MALFORMED))
def test_malformed_output_is_content_never_an_exception(fmt):
    rng = random.Random(f"malformed-{fmt}")
    parser = get_tool_parser(fmt)()
    for text in MALFORMED[fmt]:
        assert parser.extract(text) == ExtractedToolCalls(False, [], text), text
        for _ in range(20):  # a stream may have sent a call's start before the breakage
            content, calls = streamed_calls(stream(parser, random_pieces(rng, text)))
            if not calls:
                assert content == text, (text, content)


def test_json_arguments_given_as_a_string_or_before_the_name_are_parsed():
    parser = get_tool_parser("hermes")()
    out = parser.extract('<tool_call>{"arguments": "{\\"a\\": [1, {}]}", "name": "f"}'
                         "</tool_call>")
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("f", {"a": [1, {}]})]
    out = parser.extract('<tool_call>{"name": "g"}</tool_call>')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("g", "{}")]


def test_arguments_stream_as_they_come_and_the_first_delta_names_the_call():
    parser = get_tool_parser("hermes")()
    s = parser.streaming(make_id=lambda: "call-1")
    assert s.feed("<tool_call>\n") == StreamDelta()
    assert s.feed('{"name": "get_weather", "argu') == StreamDelta()
    d = s.feed('ments": {"city": "Par')
    assert [c.to_openai() for c in d.tool_calls] == [{
        "index": 0, "id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]
    d = s.feed('is"}}\n</tool_call>')
    assert [c.to_openai() for c in d.tool_calls] == [
        {"index": 0, "function": {"arguments": 'is"}'}}]
    assert s.finish() == StreamDelta() and s.tools_called


def test_what_a_parser_holds_is_bounded():
    # inside a call's arguments: every piece goes out as it comes
    s = get_tool_parser("hermes")().streaming()
    assert s.feed('<tool_call>{"name": "f", "arguments": {"a": "').tool_calls
    for _ in range(50):
        assert s.feed("y" * 10_000).tool_calls[0].arguments == "y" * 10_000
    # a call's start that never resolves: content once past the bound, then as it comes
    s = get_tool_parser("hermes")().streaming()
    sent = 0
    chunk = '<tool_call>{"name": "f", "x": "' + "z" * (MAX_HELD_CHARS + 10)
    sent += len(s.feed(chunk).content)
    assert sent == len(chunk) - len('<tool_call>{"name": "f", "x": "') + len(
        '<tool_call>{"name": "f", "x": "')  # all of it out, nothing held
    assert s.feed("more text").content == "more text"
    # qwen3_coder: a long string parameter streams
    s = get_tool_parser("qwen3_coder")().streaming()
    s.feed("<tool_call>\n<function=f>\n<parameter=body>\n")
    for _ in range(20):
        assert s.feed("q" * 10_000).tool_calls[0].arguments == "q" * 10_000


def test_qwen3_coder_converts_values_by_the_tool_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                         "b": {"type": "boolean"}, "o": {"type": "object"},
                                         "s": {"type": "string"}, "l": {"type": "array"}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n"
            "<parameter=x>\n2.5\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n"
            '<parameter=o>\n{"k": [1]}\n</parameter>\n<parameter=s>\n 007 \n</parameter>\n'
            "<parameter=l>\nnot json\n</parameter>\n<parameter=extra>\n5\n</parameter>\n"
            "</function>\n</tool_call>")
    (call,) = get_tool_parser("qwen3_coder")(tools).extract(text).tool_calls
    assert json.loads(call.arguments) == {"n": 42, "x": 2.5, "b": True, "o": {"k": [1]},
                                          "s": " 007 ", "l": "not json", "extra": "5"}


def test_the_json_scanner_accepts_exactly_json():
    rng = random.Random("scanner")
    for _ in range(300):
        text = dumps(rng, rand_args(rng))
        scan = JsonScanner()
        for ch in text:
            scan.push(ch)
            assert not scan.error, text
        assert scan.done
    for bad in ['{"a": 01}', '{"a": tru}', '{"a" 1}', '{"a": 1,}', '{"a": "\\x"}', "[1 2]",
                '{"a": -}', '{"a": 1.}', '{"a": "\u0001"}', "{}}", '"top"', "1"]:
        scan = JsonScanner()
        for ch in bad:
            scan.push(ch)
        assert scan.error, bad
    deep = JsonScanner(max_depth=8)
    for ch in "[" * 9:
        deep.push(ch)
    assert deep.error


ATOMS = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", ";", '"name"',
         '"arguments"', '"parameters"', '"f"', "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
         "<function=f>", "</function>", "<parameter=p>", "</parameter>", "\n", " ", "x", "1",
         "true", "null", "é", "<", "["]


@pytest.mark.parametrize("fmt", sorted(RENDER))
def test_random_fragments_never_raise_and_what_is_not_a_call_is_content(fmt):
    """Any output at all: calls whose arguments are JSON objects, or the text unchanged;
    a stream that sent no call sent the text unchanged."""
    rng = random.Random(f"fuzz-{fmt}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "integer"}}}}}]
    for _ in range(600):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 30)))
        parser = get_tool_parser(fmt)(tools)
        whole = parser.extract(text)
        if not whole.tools_called:
            assert whole.content == text
        assert all(isinstance(json.loads(c.arguments), dict) for c in whole.tool_calls)
        content, calls = streamed_calls(stream(parser, random_pieces(rng, text)))
        if not calls:
            assert content == text, text


def _held_chars(obj, seen=None) -> int:
    """Characters a parser (and the parts it owns) holds: its strings and lists of them."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    total = 0
    for value in vars(obj).values():
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):
            total += sum(len(v) for v in value if isinstance(v, str))
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("tandem"):
            total += _held_chars(value, seen)
    return total


@pytest.mark.parametrize("fmt,start", [
    ("hermes", "<tool_call>"), ("hermes", 'x <tool_call>{"name": "f", "k": "'),
    ("llama3_json", ""), ("llama3_json", '{"name": "f", "parameters": {"a": 1}};'),
    ("mistral", "[TOOL_CALLS]"), ("mistral", "[TOOL_CALLS]["), ("mistral", "[TOOL_CALLS]f"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}},'),
    ("qwen3_coder", "<tool_call>"), ("qwen3_coder", "<tool_call><function=f>"),
    ("qwen3_coder", "<tool_call><function=f><parameter=n>")])
@pytest.mark.parametrize("filler", [" ", "\n", "a"])
def test_no_output_makes_a_parser_hold_more_than_its_bound(fmt, start, filler):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}]
    s = get_tool_parser(fmt)(tools).streaming()
    s.feed(start)
    for _ in range(9):  # past the bound: an unbounded parser would hold all of it
        s.feed(filler * 10_000)
        assert _held_chars(s) <= MAX_HELD_CHARS + 2 * 4096 + 256, (fmt, start, filler)
    s.finish()
