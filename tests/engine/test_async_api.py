"""`AsyncLLMEngine`'s typed surface (`engine/async_api.py`): what serving and kvtransfer use
instead of closures run on the engine thread, and the engine's page API, which gives and
takes every KV head the same way with one rank as with many."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache.pages import gather_layer
from tandem.engine.kv_pages import ImportCommit, ImportPins, PageLayout
from tandem.engine.llm_engine import LLMEngine
from tandem.kvtransfer.pages import engine_layout, tensor_bytes
from tandem.protocol.block_hash import HashKeys, hash_block_chain, root_hash

from .utils import make_tiny_model_dir

SRC = Path(__file__).resolve().parents[2] / "src" / "tandem"
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def test_no_module_outside_the_engine_runs_closures_on_it_or_reaches_into_it():
    # `engine.call(fn)` / `engine._call(fn)`, `engine.engine.<anything>`
    reach = re.compile(r"\b\w*eng\w*\._?call\(|\bengine\.engine\b")
    offenders = [f"{path.relative_to(SRC)}:{n}: {line.strip()}"
                 for path in sorted(SRC.rglob("*.py"))
                 if path.relative_to(SRC).parts[0] != "engine"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if reach.search(line)]
    assert offenders == []
    assert not hasattr(AsyncLLMEngine, "call")  # private: `_call`


def test_kvtransfer_never_learns_the_tensor_parallel_size():
    """Pages come from `page_source` and go through `page_sink`, one rank or many."""
    tp = re.compile(r"tensor_parallel|kv_in_place|runner\.|\.world\b|(export|import)_(kv|pages)")
    offenders = [f"{path.name}:{n}: {line.strip()}"
                 for path in sorted((SRC / "kvtransfer").glob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if tp.search(line)]
    assert offenders == []


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-api")
    make_tiny_model_dir(path, "llama", seed=5)
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), block_size=4,
                                                num_kv_blocks=32)))
    yield eng
    eng.shutdown()


def test_views_are_the_engines_own(engine):
    core = engine.engine
    assert (engine.state, engine.config, engine.tokenizer, engine.device, engine.lora) == (
        core.state, core.config, core.tokenizer, core.device, None)
    assert engine.kv_in_place and engine.prefix_caching
    assert engine.lora_digest("any") is None
    layout = engine.page_layout("m")
    assert isinstance(layout, PageLayout) and layout == engine_layout("m", core)
    assert (layout.num_layers, layout.num_kv_heads, layout.block_size, layout.cache_dtype) == (
        len(core.runner.kv_caches), core.arch.num_kv_heads, 4, "auto")
    assert engine.process_prompt([5, 6, 7]).token_ids == [5, 6, 7]


def test_pages_move_out_and_in_through_typed_coroutines_with_one_rank(engine):
    caches = engine.kv_caches
    prompt = list(range(40, 57))  # 4 full blocks + 1 token

    async def main() -> None:
        _, out = await engine.add(prompt, ONE, "src", keep_blocks=True)
        while not (await out.get()).finished:
            pass
        ids = await engine.kept_block_ids("src")
        assert isinstance(ids, list) and len(ids) == 5
        pages = await engine.export_pages(ids[:4])
        layout = engine.page_layout("m")
        assert [p.shape for p in pages] == [torch.Size(layout.layer_shape(4))] * len(caches)
        assert all(p.device.type == "cpu" for p in pages)
        assert all(torch.equal(p, gather_layer(caches, i, ids[:4]).cpu())
                   for i, p in enumerate(pages))

        keys = HashKeys(cache_salt="elsewhere")  # another chain: fresh blocks for every hash
        hashes = hash_block_chain(prompt[:16], 4, keys)
        pins = await engine.import_blocks(hashes, tail=True)
        assert isinstance(pins, ImportPins) and pins.pinned
        assert (len(pins.blocks), pins.fresh) == (5, [0, 1, 2, 3, 4])
        target = [b.block_id for b in pins.blocks[:4]]
        await engine.import_pages(target, pages)
        assert all(torch.equal(gather_layer(caches, i, target).cpu(), p)
                   for i, p in enumerate(pages))

        assert engine.cached_prefix_len(hashes) == 0
        full = await engine.commit_import(pins, ImportCommit(
            "dst", hashes, root_hash(keys), prompt[:16], 4, []))
        assert full == pins.blocks[:4] and engine.cached_prefix_len(hashes) == 4
        local = await engine.pin_cached(hashes)
        assert [b.block_id for b in local] == target
        free = engine.engine.kv.pool.num_free_blocks()
        await engine.unpin(local)
        await engine.unpin(pins.blocks, limit=4, drop_tail="dst")  # the staged tail too
        # every pin gone: the 4 blocks are cached (evictable) and the tail is free
        assert engine.engine.kv.pool.num_free_blocks() == free + 5
        assert await engine.release_kept("src") is True
        assert await engine.release_kept("src") is False
        assert await engine.kept_block_ids("src") is None

    asyncio.run(main())


def test_import_refuses_pages_for_another_number_of_layers(engine):
    async def main() -> None:
        with pytest.raises(ValueError, match="pages for 1 layers"):
            await engine.import_pages([0], [torch.zeros(1)])

    asyncio.run(main())


def test_a_page_source_and_sink_move_every_layer_with_one_rank(engine):
    caches = engine.kv_caches
    prompt = list(range(60, 69))  # 2 full blocks + 1 token

    async def main() -> None:
        _, out = await engine.add(prompt, ONE, "src2", keep_blocks=True)
        while not (await out.get()).finished:
            pass
        ids = (await engine.kept_block_ids("src2"))[:2]
        source = await engine.page_source(ids)
        pages = [source.layer(i) for i in range(len(caches))]
        assert all(torch.equal(p, gather_layer(caches, i, ids)) for i, p in enumerate(pages))
        assert b"".join(source.views(0)) == bytes(tensor_bytes(pages[0]))  # host cache
        assert engine.layer_streaming

        pins = await engine.import_blocks(hash_block_chain(prompt[:8], 4,
                                                           HashKeys(cache_salt="x")))
        target = [b.block_id for b in pins.blocks]
        sink = engine.page_sink(target)
        for i, p in enumerate(pages[:-1]):
            sink.write(i, p)
        with pytest.raises(ValueError, match=f"{len(caches) - 1} of {len(caches)} layers"):
            await sink.finish()
        sink.write(len(caches) - 1, pages[-1])
        await sink.finish()
        assert all(torch.equal(gather_layer(caches, i, target), p)
                   for i, p in enumerate(pages))
        await engine.unpin(pins.blocks)
        await engine.release_kept("src2")

    asyncio.run(main())
