"""`AsyncLLMEngine`'s typed surface (`engine/async_api.py`): what serving and kvtransfer use
instead of closures run on the engine thread, the engine's page API, which gives and
takes every KV head the same way with one rank as with many, and its KV connector
(`engine/kv_connector`), the only page API kvtransfer calls: leases expired on the engine
thread, layer saves through the worker side, the registry."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.leases import LeaseError, LeaseStats
from tandem.engine.kv_cache.pages import gather_layer
from tandem.engine.kv_connector import (
    KV_CONNECTORS,
    ConnectorMetadata,
    ExternalMatch,
    FinishAction,
    make_connector,
)
from tandem.engine.kv_connector.pd import PDConnector
from tandem.engine.kv_pages import ImportCommit, ImportPins, PageLayout
from tandem.engine.llm_engine import LLMEngine
from tandem.kvtransfer.pages import engine_layout, tensor_bytes
from tandem.protocol.block_hash import HashKeys, hash_block_chain, root_hash

from .utils import make_request, make_tiny_model_dir

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


def test_kvtransfer_calls_the_engines_pages_through_its_connector_only():
    direct = re.compile(r"\bengine\.(pin_cached|import_blocks|commit_import|unpin|page_source|"
                        r"page_sink|observe_layers|unobserve_layers|release_kept|"
                        r"kept_block_ids|kv_caches|layer_streaming|cached_prefix_len|"
                        r"prefix_caching)\b")
    offenders = [f"{path.name}:{n}: {line.strip()}"
                 for path in sorted((SRC / "kvtransfer").glob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if direct.search(line)]
    assert offenders == []


def test_a_page_layout_splits_its_kv_heads_by_rank():
    layout = PageLayout("m", 2, 4, 16, 64, torch.float16)
    assert [layout.kv_heads_per_rank(w) for w in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert layout.rank_heads(1, 2) == range(2, 4) and layout.rank_heads(5, 8) == range(2, 3)
    share = layout.rank_layout(1, 2)
    assert (share.num_kv_heads, share.block_layer_bytes * 2) == (2, layout.block_layer_bytes)
    assert share.layer_shape(3) == (2, 3, 2, 16, 64)
    with pytest.raises(ConfigError, match="one must divide the other"):
        layout.rank_layout(0, 3)


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


def test_the_connector_is_the_engines_own_and_built_from_the_registry(engine):
    kv = engine.kv_connector
    assert isinstance(kv, PDConnector) and engine.kv_connector is kv
    assert KV_CONNECTORS["pd"] is PDConnector and kv.name == "pd"
    assert kv.layout("m") == engine.page_layout("m") and kv.device == engine.device
    with pytest.raises(ConfigError, match="unknown KV connector 'tier'; available: .*pd"):
        make_connector("tier", engine)


def test_a_lease_nobody_releases_expires_on_the_engine_thread(engine):
    """A prefill worker whose decode peer died: the kept pages are unpinned at the lease's
    end, counted, and the lease's handle is refused from then on."""
    kv = engine.kv_connector
    core = engine.engine
    prompt = list(range(80, 93))  # 3 full blocks + 1 token

    async def main() -> None:
        free = core.kv.pool.num_free_blocks()
        _, out = await engine.add(prompt, ONE, "lease-src", keep_blocks=True)
        while not (await out.get()).finished:
            pass
        before = kv.lease_stats()
        lease = await kv.lease_kept("lease-src", 0.3)
        assert lease is not None and len(lease.block_ids) == 4
        assert core.kv.pool.num_free_blocks() == free - 4
        source = await kv.page_source(lease, 1, 2)  # blocks 1..2 of the lease
        assert source.block_ids == list(lease.block_ids[1:3])
        assert torch.equal(source.layer(0), gather_layer(engine.kv_caches, 0,
                                                         list(lease.block_ids[1:3])))
        renewed = await kv.renew(lease, 0.3)
        assert renewed.expires > lease.expires
        for _ in range(100):  # an idle engine thread expires leases every 0.25 s
            if core.kv.pool.num_free_blocks() == free:
                break
            await asyncio.sleep(0.05)
        assert core.kv.pool.num_free_blocks() == free
        assert kv.lease_stats() == LeaseStats(before.active - 1, before.released,
                                              before.expired + 1)
        stats = core.stats()  # what the worker's /metrics exports
        assert (stats.kv_leases_active, stats.kv_leases_expired) == (before.active - 1,
                                                                     before.expired + 1)
        text = _metrics_text(stats)
        assert f'tandem_kv_leases_expired_total{{model_name="m"}} {before.expired + 1}.0' in text
        assert f'tandem_kv_leases_active{{model_name="m"}} {before.active - 1}.0' in text
        with pytest.raises(LeaseError, match="expired"):
            await kv.page_source(lease)
        assert await kv.release(lease) is False and await kv.release_kept("lease-src") is False
        await kv.close()

    asyncio.run(main())


def test_layers_are_saved_through_the_connectors_worker_side(engine):
    kv = engine.kv_connector
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    seen: list[tuple] = []

    class Saver:
        def begin(self, block_ids: list[int]) -> None:
            seen.append(("begin", len(block_ids)))

        def layer_done(self, layer: int, event: object) -> None:
            seen.append(("layer", layer, event))

    async def main() -> None:
        assert kv.save_layers("saved", Saver())
        _, out = await engine.add(prompt, ONE, "saved", keep_blocks=True)
        while not (await out.get()).finished:
            pass
        ids = list((await kv.lease_kept("saved", 5.0)).block_ids)
        source = await kv.saved_page_source("saved", ids)
        assert torch.equal(source.layer(1), gather_layer(engine.kv_caches, 1, ids))
        kv.unsave_layers("saved")
        with pytest.raises(ValueError, match="are not being saved"):
            await kv.saved_page_source("saved", ids)
        assert await kv.release_kept("saved")
        # a cached run leased for a reader (a peer pulling pages): pinned until released
        cached = engine.engine.kv.pool.cached_hashes()[:1]
        free = engine.engine.kv.pool.num_free_blocks()
        lease = await kv.lease_cached("peer", cached, 5.0)
        assert len(lease.block_ids) == 1 and engine.engine.kv.pool.num_free_blocks() == free - 1
        assert await kv.release(lease.lease_id) and not await kv.release(lease)
        assert engine.engine.kv.pool.num_free_blocks() == free

    asyncio.run(main())
    layers = len(engine.kv_caches)
    assert seen == [("begin", 3)] + [("layer", i, None) for i in range(layers)]

    # the scheduler side: nothing loads in a step; saves of the allocated blocks; kept
    # blocks under the manager's lease
    sched = kv.scheduler
    req = make_request([1, 2, 3, 4, 5], request_id="r")
    assert sched.get_num_new_matched_tokens(req, 0) == ExternalMatch(0, False)
    kv.save_layers("r", Saver())
    sched.update_state_after_alloc(req, [4, 5], 0)
    assert sched.build_connector_meta() == ConnectorMetadata({}, {"r": (4, 5)})
    assert sched.build_connector_meta().empty
    kv.unsave_layers("r")
    sched.update_state_after_alloc(req, [4, 5], 0)  # no longer saved: nothing to do
    assert sched.build_connector_meta().empty
    req.keep_kv = True
    assert sched.request_finished(req, [4, 5]) == FinishAction(True, 600.0)
    assert engine.engine.kv.connector is sched  # the manager asks it from now on
    with pytest.raises(ValueError, match="before admission"):
        kv.worker.start_load_kv(ConnectorMetadata({"r": (1,)}, {}))


def _metrics_text(stats) -> str:  # noqa: ANN001 - an EngineStats
    """The worker's engine series for `stats`, as /metrics writes them."""
    from prometheus_client import generate_latest

    from tandem.serving.metrics import ServerMetrics

    return generate_latest(ServerMetrics("m", lambda: stats).registry).decode()
