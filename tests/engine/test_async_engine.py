"""`AsyncLLMEngine`'s thread: it sleeps while nothing can be scheduled (no spinning that
holds the GIL from the event loop that must serve the releases), wakes for commands, and
admits a request's prompts in one command."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tandem import SamplingParams
from tandem.engine.async_engine import AddRequest, AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.protocol.block_hash import HashKeys, hash_block_chain

from .utils import make_tiny_model_dir

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-async")
    make_tiny_model_dir(path, "llama", seed=3)
    return str(path)


def _engine(path: str, **kw) -> tuple[AsyncLLMEngine, list[int]]:
    """An async engine whose scheduler counts its `schedule` calls (in the list)."""
    eng = LLMEngine(EngineConfig(model=path, block_size=4, **kw))
    calls = [0]
    real = eng.scheduler.schedule

    def counting():
        calls[0] += 1
        return real()

    eng.scheduler.schedule = counting  # type: ignore[method-assign]
    return AsyncLLMEngine(eng), calls


async def _collect(q: asyncio.Queue):
    while True:
        out = await q.get()
        if out.finished:
            return out


def test_the_engine_thread_sleeps_while_pins_hold_every_block(tiny_path):
    engine, calls = _engine(tiny_path, num_kv_blocks=8)

    async def main() -> None:
        chain = hash_block_chain(list(range(100, 132)), 4, HashKeys())  # 8 blocks
        pinned, _ = await engine._call(lambda e: e.kv.import_blocks(chain))
        assert len(pinned) == 8  # the whole pool, as leases or imports in flight can
        _, q = await engine.add(list(range(500, 510)), GREEDY, "starved")
        await asyncio.sleep(0.2)
        before = calls[0]
        await asyncio.sleep(1.0)
        idle = calls[0] - before
        # it waits for a command (with a 1 s safety wake), it does not poll
        assert idle <= 2, f"{idle} schedule calls in 1 s while nothing could run"
        t0 = time.monotonic()
        await engine._call(lambda e: e.kv.unpin(pinned))  # the release is the wake-up
        out = await asyncio.wait_for(_collect(q), 30)
        assert out.outputs[0].finish_reason == "length"
        assert time.monotonic() - t0 < 5

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_add_many_admits_every_prompt_in_the_same_step(tiny_path):
    engine, _ = _engine(tiny_path, kv_cache_memory=16 << 20)
    steps: list[set[str]] = []
    sched = engine.engine.scheduler
    counting = sched.schedule

    def recording():
        out = counting()
        steps.append({s.request.request_id for s in out.scheduled})
        return out

    sched.schedule = recording  # type: ignore[method-assign]
    gate = threading.Event()

    async def main() -> None:
        blocked = asyncio.ensure_future(engine._call(lambda e: gate.wait(10)))  # a long step
        await asyncio.sleep(0.1)
        adds = [AddRequest(f"r-{i}", list(range(200 + 10 * i, 208 + 10 * i)), GREEDY)
                for i in range(4)]
        added = asyncio.ensure_future(engine.add_many(adds))
        await asyncio.sleep(0.2)
        gate.set()
        await blocked
        queues = [q for _, q in await added]
        outs = [await asyncio.wait_for(_collect(q), 30) for q in queues]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    first = next(s for s in steps if s)
    assert first == {"r-0", "r-1", "r-2", "r-3"}


def test_add_many_adds_none_when_one_is_refused(tiny_path):
    engine, _ = _engine(tiny_path, kv_cache_memory=16 << 20, max_model_len=64)

    async def main() -> None:
        adds = [AddRequest("ok-0", [5, 6, 7], GREEDY),
                AddRequest("bad-1", list(range(100, 200)), GREEDY)]  # past the window
        with pytest.raises(ValueError, match="context window"):
            await engine.add_many(adds)
        stats = await engine._call(lambda e: (e.scheduler.num_waiting, e.scheduler.num_running,
                                             e.kv.usage()))
        assert stats == (0, 0, 0.0)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
