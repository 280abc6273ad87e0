"""Reasoning parsers (`serving/reasoning`): the thinking (`<think>...</think>`) comes back as
reasoning_content apart from the content, whole and in random pieces, in DeepSeek-R1's
style (the prompt opened the thinking) and Qwen3's (the output opens it, or never does);
`is_reasoning_end` finds the end tag's ids for structured outputs."""

from __future__ import annotations

import itertools
import random

import pytest

from tandem.protocol import engine_flags
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving.reasoning import get_reasoning_parser, reasoning_parser_names
from tests.engine.utils import write_tiny_tokenizer

PIECES = ["Let me think", " about <this>", " x < y", "</thin", "k", "\n", "日本", "<think",
          "{", "a</b>", " "]


def rand_text(rng: random.Random) -> str:
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
    return text.replace("</think>", "").replace("<think>", "")


def pieces(rng: random.Random, text: str) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 30))))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def streamed(parser, parts: list[str]) -> tuple[str, str]:
    s = parser.streaming()
    out = [s.feed(p) for p in parts] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def test_the_registry_has_vllms_names_as_the_flag_offers_them():
    assert reasoning_parser_names() == engine_flags.REASONING_PARSERS
    with pytest.raises(KeyError, match="unknown reasoning parser 'r1'; known: deepseek_r1"):
        get_reasoning_parser("r1")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_random_thinking_and_answers_split_whole_and_streamed(name):
    rng = random.Random(f"reasoning-{name}")
    parser = get_reasoning_parser(name)()
    for _ in range(400):
        thinking, answer = rand_text(rng), rand_text(rng)
        opened = name == "qwen3" or rng.random() < 0.5  # R1: the prompt may have opened it
        closed = rng.random() < 0.85
        text = ("<think>" if opened else "") + thinking + ("</think>" + answer if closed
                                                           else "")
        want = (thinking, answer or None) if closed else (thinking, None)
        assert parser.extract(text) == want, text
        for _ in range(5):
            reasoning, content = streamed(parser, pieces(rng, text))
            assert (reasoning, content or None) == want, text


def test_qwen3_without_a_think_block_is_all_content():
    """As with `chat_template_kwargs: {"enable_thinking": false}`."""
    rng = random.Random("qwen3-plain")
    parser = get_reasoning_parser("qwen3")()
    for text in ["The answer is 4.", "", "  <thi", "x</think>y", "<b>bold</b>"]:
        assert parser.extract(text) == (None, text or None)
        for _ in range(10):
            assert streamed(parser, pieces(rng, text)) == ("", text)


def test_deepseek_r1_thinking_cut_short_is_all_reasoning():
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.extract("<think>\nstill thinking") == ("\nstill thinking", None)
    assert parser.extract("still thinking </thi") == ("still thinking </thi", None)
    s = parser.streaming()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>a</th") == ("a", "")
    assert s.feed("ink>\n\nThe answer") == ("", "\n\nThe answer")
    assert s.reasoning_ended and s.finish() == ("", "")


def test_is_reasoning_end_finds_the_end_tag_in_token_ids(tmp_path):
    write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.load(str(tmp_path))
    parser = get_reasoning_parser("deepseek_r1")(tok)
    end = parser.reasoning_end_token_ids()
    assert end == tuple(tok.encode("</think>", add_special_tokens=False)) and len(end) > 1
    thinking = tok.encode("hmm, let me see", add_special_tokens=False)
    assert not parser.is_reasoning_end(thinking)
    assert parser.is_reasoning_end([*thinking, *end, *tok.encode("ok", add_special_tokens=False)])
    assert not parser.is_reasoning_end([*thinking, *end[:-1]])
    start = tuple(tok.encode("<think>", add_special_tokens=False))
    # a prompt that closed an empty block (Qwen3's enable_thinking false): over already;
    # one that opens the thinking after an earlier turn's block: not over
    assert parser.is_reasoning_end([*thinking, *start, *end, *thinking])
    assert not parser.is_reasoning_end([*start, *thinking, *end, *thinking, *start])
    assert parser.reasoning_end_token_ids(tok) == end


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_leading_whitespace_is_not_held_without_bound(name):
    s = get_reasoning_parser(name)().streaming()
    sent = 0
    for _ in range(10):
        reasoning, content = s.feed(" " * 10_000)
        sent += len(reasoning) + len(content)
    assert sent >= 100_000 - 4096 and len(s.held) <= 4096
