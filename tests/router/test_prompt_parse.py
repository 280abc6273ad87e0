"""`prompt.parse_async` (the router's path: render on the loop, or on a thread for a long
body; a long new text tokenized off the loop) gives exactly `prompt.parse`'s prompt, for every
kind of body."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.protocol.bundled import BUNDLED_NAME, find_bundled_gguf
from tandem.protocol.tokenizer import OFFLOAD_CHARS, Tokenizer
from tandem.router import prompt as prompts

WORDS = ["alpha", "Beta", "naïve", "日本", "42", "3.5", "don't", "x", "\n", "🚀", "foo_bar",
         "<|im_end|>", "  ", "über"]


def text(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        out.append(rng.choice(WORDS) + rng.choice([" ", " ", ", ", "", "\n"]))
        n += len(out[-1])
    return "".join(out)


def bodies(rng: random.Random) -> list[tuple[str, dict]]:
    long, short = text(rng, OFFLOAD_CHARS * 3), text(rng, 40)
    return [
        ("chat", {"model": BUNDLED_NAME, "messages": [
            {"role": "system", "content": short}, {"role": "user", "content": long}]}),
        ("chat", {"model": BUNDLED_NAME, "messages": [{"role": "user", "content": short}],
                  "stream": True, "cache_salt": "s"}),
        ("completions", {"model": BUNDLED_NAME, "prompt": long, "echo": True, "logprobs": 1}),
        ("completions", {"model": BUNDLED_NAME, "prompt": [long, short]}),
        ("completions", {"model": BUNDLED_NAME, "prompt": [rng.randrange(49152)
                                                           for _ in range(300)]}),
        ("completions", {"model": BUNDLED_NAME, "prompt": [2**32 + 5]}),
        ("responses", {"model": BUNDLED_NAME, "input": long, "instructions": short}),
    ]


@pytest.mark.parametrize("render_off_loop", [False, True])
@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_parse_async_gives_parse(with_tokenizer, render_off_loop):
    rng = random.Random(5)
    tok = Tokenizer.load(find_bundled_gguf()) if with_tokenizer else None

    async def run() -> None:
        for _ in range(5):
            for kind, body in bodies(rng):
                want = prompts.parse(kind, body, tok)
                got = await prompts.parse_async(kind, body, tok, render_off_loop)
                assert got == want, (kind, body)
                ids = body.get("prompt")
                if isinstance(ids, list) and isinstance(ids[0], int):  # as sent, in range
                    assert got.token_ids == (ids if max(ids) < 2**32 else None)
                else:  # tokenized where there is a tokenizer
                    assert (got.token_ids is not None) == (tok is not None)

    asyncio.run(run())
