"""The helper tokenizer process (`protocol.tokenize_proc`), a real child process: its ids are
the library's, `Tokenizer.encode_async` through it equals `encode` (concurrent calls
included), and a helper that dies costs nothing but a fallback and a restart."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.protocol import tokenize_proc
from tandem.protocol.bundled import find_bundled_gguf
from tandem.protocol.tokenize_proc import TokenizeError, TokenizeProcess, _ids_of
from tandem.protocol.tokenizer import Tokenizer

PIECES = ["alpha", "Beta", "naïve", "日本語", "42", "don't", "<|im_start|>", "<|im_end|>",
          "\n", " ", "🚀", "foo_bar", "ü"]


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) + rng.choice([" ", "", "  ", ", "]) for _ in range(n))


async def ready(helper: TokenizeProcess) -> None:
    helper.start()
    for _ in range(600):
        if helper.ready:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the tokenizer process did not start in 30 s")


@pytest.fixture(scope="module")
def path() -> str:
    return str(find_bundled_gguf())


def test_the_helper_gives_the_librarys_ids(path):
    tok = Tokenizer.load(path)
    rng = random.Random(2)

    async def run() -> None:
        helper = TokenizeProcess(path)
        await ready(helper)
        try:
            for _ in range(30):
                texts = [text(rng, rng.randrange(0, 300)) for _ in range(rng.randrange(1, 5))]
                for special in (False, True):
                    want = [e.ids for e in tok.backend.encode_batch(
                        texts, add_special_tokens=special)]
                    assert await helper.encode(texts, special) == want
        finally:
            await helper.close()

    asyncio.run(run())


def test_encode_async_through_the_helper_equals_encode_and_survives_its_death(path,
                                                                               monkeypatch):
    """Concurrent long prompts through the helper; then the child is killed:
    every call still gets `encode`'s ids (in-process meanwhile), and a new child starts."""
    monkeypatch.setattr(tokenize_proc, "RESTART_AFTER_S", 0.0)
    ref = Tokenizer.load(path)
    rng = random.Random(4)
    texts = [text(rng, 600) for _ in range(24)]

    async def run() -> None:
        tok = Tokenizer.load(path)
        tok.start_helper()
        helper = tok.helper
        assert helper is not None
        await ready(helper)
        sent: list[int] = []
        encode = helper.encode

        async def counted(t: list[str], special: bool) -> list[list[int]]:
            got = await encode(t, special)
            sent.append(len(t))
            return got

        helper.encode = counted  # type: ignore[method-assign]
        try:
            got = await asyncio.gather(*(tok.encode_async(t, offload_chars=256)
                                         for t in texts))
            assert got == [ref.encode(t) for t in texts]
            assert len(sent) == len(texts)  # each went through the helper
            pid = helper._proc.pid
            helper._proc.kill()
            got = await asyncio.gather(*(tok.encode_async(t[::-1], offload_chars=256)
                                         for t in texts))
            assert got == [ref.encode(t[::-1]) for t in texts]
            for _ in range(600):  # it starts again on a later call
                await tok.encode_async(text(rng, 400), offload_chars=256)
                if helper.ready and helper._proc is not None and helper._proc.pid != pid:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the helper did not restart")
            t = text(rng, 700)
            before = len(sent)
            assert await tok.encode_async(t, offload_chars=256) == ref.encode(t)
            assert len(sent) == before + 1
        finally:
            await helper.close()

    asyncio.run(run())


def test_a_helper_not_ready_is_refused_at_once(path):
    async def run() -> None:
        helper = TokenizeProcess(path)
        with pytest.raises(TokenizeError):
            await helper.encode(["x"], False)  # starts it, and does not wait
        await helper.close()

    asyncio.run(run())


def test_a_malformed_answer_is_an_error():
    body = (3).to_bytes(4, "little") + (7).to_bytes(4, "little") * 2  # 3 ids, 2 given
    with pytest.raises((TokenizeError, ValueError)):
        _ids_of(body, 1)
    good = (2).to_bytes(4, "little") + (7).to_bytes(4, "little") + (9).to_bytes(4, "little")
    assert _ids_of(good, 1) == [[7, 9]]
    with pytest.raises(TokenizeError):
        _ids_of(good + b"\0\0\0\0", 1)  # bytes left over


def test_a_stalled_helper_is_killed_and_the_caller_still_gets_its_ids(path, monkeypatch):
    """A child that stops answering (SIGSTOP) holds no request past the answer timeout: the
    call gets `encode`'s ids in-process, and the child is killed and replaced."""
    import os
    import signal
    import time

    monkeypatch.setattr(tokenize_proc, "ANSWER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(tokenize_proc, "RESTART_AFTER_S", 0.0)
    ref = Tokenizer.load(path)
    rng = random.Random(6)

    async def run() -> None:
        tok = Tokenizer.load(path)
        tok.start_helper()
        helper = tok.helper
        assert helper is not None
        await ready(helper)
        stopped = helper._proc
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            t = text(rng, 600)
            t0 = time.monotonic()
            assert await tok.encode_async(t, offload_chars=256) == ref.encode(t)
            assert time.monotonic() - t0 < 5
            await asyncio.wait_for(stopped.wait(), 10)  # killed
            await ready(helper)
            assert helper._proc is not stopped
            t = text(rng, 600)
            assert await helper.encode([t], False) == [ref.backend.encode(
                t, add_special_tokens=False).ids]
        finally:
            if stopped.returncode is None:
                stopped.kill()
            await helper.close()

    asyncio.run(run())
