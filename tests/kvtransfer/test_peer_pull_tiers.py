"""A holder with KV tiers serves a peer pull from them: the prefix its small device pool
evicted to the host tier is loaded back into device blocks (verified as an admission's tier
load is), cached, leased and sent, so the receiver gets every asked block with the tokens of
the holder's own cold run, while the holder computes nothing and keeps no lease or pin; a
tier record that does not verify ends the served run there (the rest is computed on the
receiver)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_connector.offload import OffloadConnector
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.protocol.block_hash import hash_block_chain, request_hash_keys
from tests.engine.utils import make_tiny_model_dir
from tests.kvtransfer.test_peer_pull import (
    BS,
    MODEL,
    Peers,
    generate,
    ids,
    leases_active,
    stats,
)

DOC = 8  # blocks of the shared prefix


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """holder: a 16-block device pool over a 1 MiB host tier; receiver: plain."""
    path = tmp_path_factory.mktemp("pull-tiers")
    make_tiny_model_dir(path, "llama", seed=5)
    made = {}
    try:
        for name, blocks, host in (("holder", 16, 1 << 20), ("receiver", 128, 0)):
            made[name] = AsyncLLMEngine(LLMEngine(EngineConfig(
                model=str(path), block_size=BS, num_kv_blocks=blocks, num_threads=1,
                served_model_name=MODEL, kv_offload_host_bytes=host)))
        yield made
    finally:
        for e in made.values():
            e.shutdown()


async def cold_then_evict(holder: AsyncLLMEngine, doc: list[int], prompt: list[int],
                          seed: int) -> tuple[RequestOutput, list[bytes]]:
    """Run `prompt` (`doc` + a few tokens) cold on the holder, then push it out of the device
    pool with unrelated prompts: `doc`'s blocks end up in the host tier only. Returns the
    cold run's output and `doc`'s block hashes."""
    cold = await generate(holder, prompt, f"cold-{seed}")
    for i in range(2):
        await generate(holder, ids(seed + 3 + i, 10 * BS), f"evict-{seed}-{i}")
    tiers = holder.engine.kv_tiers
    tiers.flush()
    hashes = hash_block_chain(doc, BS, request_hash_keys(MODEL))
    assert await holder._call(lambda e: len(e.kv.cached_prefix(hashes))) == 0
    assert tiers.lookup(hashes) == DOC
    return cold, hashes


def test_a_holder_serves_its_host_tier_blocks_to_a_peer_pull(engines):
    holder = engines["holder"]
    assert isinstance(holder.kv_connector, OffloadConnector)
    tiers = holder.engine.kv_tiers
    doc = ids(30, DOC * BS)
    prompt = doc + ids(31, 3)

    async def main() -> None:
        async with Peers(engines) as peers:
            want, hashes = await cold_then_evict(holder, doc, prompt, 30)
            before, loads = await stats(holder), tiers.stats()[0].loads
            got = await peers.run(prompt, "pull-30")
            after = await stats(holder)
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.num_cached_tokens == DOC * BS
            assert (peers.pulls("pulled"), peers.pulled_blocks()) == (1, DOC)
            assert tiers.stats()[0].loads - loads == DOC  # every block from the host tier
            # the holder ran no request: no prompt token, no lookup, no sampled token
            assert (after.prompt_tokens, after.prefix_cache_queries,
                    after.generation_tokens) == (before.prompt_tokens,
                                                 before.prefix_cache_queries,
                                                 before.generation_tokens)
            await peers.settled()  # no lease left on the holder, nothing held on the receiver
            assert (await stats(holder)).kv_cache_usage == 0  # and no pin
            # the loaded blocks are the holder's device cache again
            assert await holder._call(lambda e: len(e.kv.cached_prefix(hashes))) == DOC

    asyncio.run(main())


def test_a_tier_record_that_does_not_verify_ends_the_served_run(engines):
    holder = engines["holder"]
    tiers = holder.engine.kv_tiers
    doc = ids(40, DOC * BS)
    prompt = doc + ids(41, 3)

    async def main() -> None:
        async with Peers(engines) as peers:
            want, hashes = await cold_then_evict(holder, doc, prompt, 40)
            record = tiers.host.get(hashes[5])
            assert record is not None
            tiers.host.put(hashes[5], record[:-8] + bytes(8))  # damaged pages
            failures = tiers.stats()[0].validation_failures
            got = await peers.run(prompt, "pull-40")
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.num_cached_tokens == 5 * BS  # blocks 0..4 pulled, the rest computed
            assert (peers.pulls("partial"), peers.pulled_blocks()) == (1, 5)
            assert tiers.stats()[0].validation_failures == failures + 1
            assert tiers.holds(hashes[5]) is None  # dropped, never served
            await peers.settled()
            assert await leases_active(holder) == 0

    asyncio.run(main())
