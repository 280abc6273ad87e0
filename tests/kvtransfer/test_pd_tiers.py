"""KV tiers on both sides of P/D, with an int8 KV cache (its pages stored as they are:
codes and scales): the offload connector keeps the P/D connector's page API, so imports
from the prefill worker land as before and give the aggregated engine's tokens; the small
decode pool's evicted prefixes then reload from its host tier, token for token."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_connector.offload import OffloadConnector
from tandem.engine.llm_engine import LLMEngine
from tests.engine.utils import make_tiny_model_dir
from tests.kvtransfer.test_kv_dtype import EBS, MODEL, PD, greedy, prompts


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvtiers")
    make_tiny_model_dir(path, "llama", seed=3)
    made = {}
    try:
        for name, blocks, tiers in (("prefill", 128, 1 << 20), ("decode", 16, 1 << 20),
                                    ("single", 128, 0)):
            made[name] = AsyncLLMEngine(LLMEngine(EngineConfig(
                model=str(path), block_size=EBS, num_kv_blocks=blocks, kv_cache_dtype="int8",
                num_threads=1, served_model_name=MODEL, kv_offload_host_bytes=tiers)))
        yield made
    finally:
        for e in made.values():
            e.shutdown()


def test_pd_imports_and_tier_loads_compose(engines):
    decode = engines["decode"]
    assert isinstance(decode.kv_connector, OffloadConnector)
    tiers = decode.engine.kv_tiers
    _, middle, last = prompts(7)  # 28 and 45 tokens

    async def main() -> None:
        async with PD(engines["prefill"], decode) as pd:
            for i, prompt in enumerate((middle, last)):
                want = await greedy(engines["single"], prompt, f"ref-{i}")
                got, nbytes = await pd.run(prompt, f"pd-{i}")
                assert got.outputs[0].token_ids == want.outputs[0].token_ids, i
                assert nbytes > 0 and got.num_cached_tokens == len(prompt) - 1
            assert pd.fetches("ok") == 2
        # the last request's 14 blocks evicted most of the middle prompt's from the 16-block
        # pool: they come back from the host tier (int8 codes and scales as they were)
        tiers.flush()
        loads, hits = tiers.stats()[0].loads, decode.engine.kv.prefix_hits
        follow = middle + [7, 8, 9]
        want = await greedy(engines["single"], follow, "ref-follow")
        got = await greedy(decode, follow, "follow")
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        # its 7 blocks: the evicted ones loaded, the rest still hit in the device pool
        loaded = tiers.stats()[0].loads - loads
        assert loaded >= 3 and loaded * EBS + decode.engine.kv.prefix_hits - hits == 7 * EBS
        assert tiers.stats()[0].validation_failures == 0

    asyncio.run(main())
