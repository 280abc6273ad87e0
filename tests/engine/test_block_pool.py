from __future__ import annotations

import pytest

from tandem.engine.kv_cache.block_pool import BlockPool
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.protocol.block_hash import HashKeys, hash_block_chain, root_hash
from tandem.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .utils import make_request


def _compute(kv: KVCacheManager, req, n: int) -> None:
    """Allocate `n` more tokens of `req` and pretend the forward that computed them ended."""
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    kv.commit_computed(req)


def test_new_blocks_come_from_queue_head_and_double_free_raises():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1)
    assert pool.num_free_blocks() == 2
    pool.free_blocks([b, a])
    assert pool.num_free_blocks() == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a])
    with pytest.raises(ValueError, match="only 4 free"):
        pool.get_new_blocks(5)


def test_prefix_hit_reuses_blocks_and_skips_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    r1 = make_request(prompt)
    assert kv.get_computed_blocks(r1) == ([], 0)
    _compute(kv, r1, len(prompt))
    assert kv.block_ids(r1.request_id) == [0, 1, 2]
    kv.free(r1)

    r2 = make_request(prompt)
    blocks, hit = kv.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [0, 1] and hit == 8

    # a prompt that is exactly two full blocks must recompute its last token: only 1 block hits
    r3 = make_request(prompt[:8])
    blocks, hit = kv.get_computed_blocks(r3)
    assert [b.block_id for b in blocks] == [0] and hit == 4


def test_eviction_is_lru_with_request_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    r1 = make_request([1, 2, 3, 4, 5, 6])  # blocks 0,1,2 all full
    _compute(kv, r1, 6)
    kv.free(r1)  # joins the queue tail-first: 3 free clean (3,4,5) then 2,1,0
    r2 = make_request([9, 9, 9, 9, 9, 9, 9, 9])  # needs 4 blocks: 3,4,5 then evicts block 2
    _compute(kv, r2, 8)
    assert kv.block_ids(r2.request_id) == [3, 4, 5, 2]
    # r1's first two blocks survive, its tail block was evicted
    r1b = make_request([1, 2, 3, 4, 5, 6, 7])
    blocks, hit = kv.get_computed_blocks(r1b)
    assert [b.block_id for b in blocks] == [0, 1] and hit == 4


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r1 = make_request(list(range(8)))
    kv.allocate_slots(r1, 8)
    r2 = make_request(list(range(50, 62)))
    assert kv.allocate_slots(r2, 12) is None
    assert kv.pool.num_free_blocks() == 1 and kv.block_ids(r2.request_id) == []


def test_hashes_follow_documented_chain_and_salt_separates():
    tokens = list(range(32))
    a = hash_block_chain(tokens, 16, HashKeys("m"))
    b = hash_block_chain(tokens, 16, HashKeys("m", cache_salt="tenant-1"))
    assert len(a) == 2 and set(a).isdisjoint(b)
    import hashlib
    import struct

    expected = hashlib.sha256(b"tandem-kv-block-v1" + root_hash(HashKeys("m"))
                              + struct.pack("<I", 16) + struct.pack("<16I", *tokens[:16]))
    assert a[0] == expected.digest()


def test_events_stored_removed_cleared():
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_events=True)
    r1 = make_request([1, 2, 3, 4, 5])
    kv.allocate_slots(r1, 4)  # only the first 4 tokens: 2 full blocks
    assert kv.pool.take_events() == []  # nothing is cached before the forward computed it
    r1.num_computed_tokens = 4
    kv.commit_computed(r1)
    events = kv.pool.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].token_ids == (1, 2, 3, 4) and len(events[0].block_hashes) == 2
    assert events[0].parent_hash == root_hash(HashKeys())
    kv.free(r1)
    r2 = make_request([7, 8, 9])
    _compute(kv, r2, 3)
    events = kv.pool.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    kv.free(r2)
    assert kv.pool.reset_prefix_cache()
    assert isinstance(kv.pool.take_events()[-1], AllBlocksCleared)
