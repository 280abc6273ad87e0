"""The batch chain (router) and the per-block hash (engine) agree byte for byte."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from tandem.protocol.block_hash import (
    HashKeys,
    hash_block,
    hash_block_chain,
    root_hash,
    token_bytes,
)


def test_chain_equals_iterated_blocks_and_the_documented_layout():
    rng = random.Random(0)
    for _ in range(50):
        size = rng.choice([1, 2, 16, 32])
        tokens = [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 200))]
        keys = HashKeys(model_id="m", cache_salt=rng.choice(["", "t1"]))
        chain = hash_block_chain(tokens, size, keys)
        prev, want = root_hash(keys), []
        for i in range(len(tokens) // size):
            block = tokens[i * size:(i + 1) * size]
            raw = hashlib.sha256(b"tandem-kv-block-v1" + prev + struct.pack("<I", size)
                                 + struct.pack(f"<{size}I", *block)).digest()
            assert raw == hash_block(prev, block)
            prev = raw
            want.append(raw)
        assert chain == want
        if want:  # continuing from a parent gives the tail of the same chain
            assert hash_block_chain(tokens[size:], size, parent=want[0]) == want[1:]


def test_token_bytes_is_the_u32_layout_for_any_sequence_and_refuses_what_it_cannot_pack():
    rng = random.Random(1)
    for _ in range(200):
        tokens = [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 64))]
        want = struct.pack(f"<{len(tokens)}I", *tokens)
        assert token_bytes(tokens) == token_bytes(tuple(tokens)) == want
    assert token_bytes(range(3)) == struct.pack("<3I", 0, 1, 2)
    for bad, error in (([1, -1], OverflowError), ([1 << 32], OverflowError),
                       ([1, 2.0], TypeError), (["1"], TypeError)):
        for seq in (bad, tuple(bad)):
            with pytest.raises(error):
                token_bytes(seq)
