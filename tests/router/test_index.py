"""PrefixIndex and ApproximateIndex: event replay, reconnects, speculative entries."""

from __future__ import annotations

from tandem.protocol.block_hash import hash_block_chain
from tandem.router.index import ApproximateIndex, PrefixIndex

A = hash_block_chain(list(range(64)), 16)  # 4 blocks
B = hash_block_chain(list(range(100, 164)), 16)


def test_match_counts_only_leading_blocks():
    idx = PrefixIndex()
    idx.stored("w1", A[:3])
    idx.stored("w2", [A[0], A[2], A[3]])  # a hole at block 1
    assert idx.match(A, now=0) == {"w1": 3, "w2": 1}
    assert idx.match(B, now=0) == {}
    assert idx.match(A, now=0, workers=["w2"]) == {"w2": 1}


def test_event_replay_removed_cleared_and_reset():
    idx = PrefixIndex()
    idx.stored("w1", A)
    idx.stored("w2", A[:2])
    idx.removed("w1", [A[1]])
    assert idx.match(A, 0) == {"w1": 1, "w2": 2}
    idx.cleared("w2")
    assert idx.match(A, 0) == {"w1": 1}
    idx.reset("w1", B)  # a reconnect's snapshot replaces everything known
    assert idx.match(A, 0) == {} and idx.match(B, 0) == {"w1": 4}
    assert idx.num_blocks() == 4 and idx.num_blocks("w1") == 4


def test_drop_forgets_a_worker_entirely():
    idx = PrefixIndex()
    idx.stored("w1", A)
    idx.stored("w2", A)
    idx.add_speculative("w3", A, now=0)
    idx.drop("w1")
    idx.drop("w3")
    assert idx.match(A, 0) == {"w2": 4}
    assert idx.workers() == ["w2"]
    idx.drop("w2")
    assert idx.num_blocks() == 0  # no empty holder sets left behind


def test_speculative_entries_expire_and_yield_to_confirmation():
    idx = PrefixIndex(speculative_ttl_s=2.0)
    idx.add_speculative("w1", A, now=10.0)
    assert idx.match(A, now=11.0) == {"w1": 4}
    assert idx.match(A, now=12.5) == {}  # expired
    idx.add_speculative("w1", A, now=20.0)
    idx.stored("w1", A[:2])  # the worker confirmed two blocks
    assert idx.match(A, now=30.0) == {"w1": 2}  # confirmed ones stay, guesses expire
    assert idx.expire(now=30.0) == 2
    assert idx.expire(now=30.0) == 0


def test_approximate_index_is_a_bounded_lru():
    approx = ApproximateIndex(capacity=5)
    approx.routed("w1", A)
    assert approx.match(A, ["w1", "w2"]) == {"w1": 4}
    approx.routed("w1", B[:2])  # 6 entries -> A[0] is evicted first
    assert approx.match(A, ["w1"]) == {}
    assert approx.match(B, ["w1"]) == {"w1": 2}
    approx.drop("w1")
    assert approx.match(B, ["w1"]) == {}


def _reference_match(held: dict[str, set[bytes]], hashes, workers=None) -> dict[str, int]:
    out = {}
    for w, blocks in held.items():
        if workers is not None and w not in workers:
            continue
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        if n:
            out[w] = n
    return out


def test_random_event_streams_match_a_naive_reference():
    """Bit slots are reused after drops; results must equal a set-per-worker reference."""
    import random

    rng = random.Random(7)
    chains = [hash_block_chain([rng.randrange(1000) for _ in range(8 * 16)], 16)
              for _ in range(6)]
    universe = sorted({h for c in chains for h in c})
    idx, held = PrefixIndex(), {}
    names = [f"w{i}" for i in range(12)]
    for _ in range(3000):
        w, op = rng.choice(names), rng.random()
        if op < 0.45:
            hs = rng.sample(universe, rng.randrange(1, 6)) if rng.random() < 0.5 else \
                rng.choice(chains)[:rng.randrange(1, 9)]
            idx.stored(w, hs)
            held.setdefault(w, set()).update(hs)
        elif op < 0.8:
            hs = rng.sample(universe, rng.randrange(1, 6))
            idx.removed(w, hs)
            if w in held:
                held[w].difference_update(hs)
        elif op < 0.88:
            idx.cleared(w)
            if w in held:
                held[w].clear()
        elif op < 0.95:
            idx.drop(w)
            held.pop(w, None)
        else:
            snap = rng.sample(universe, rng.randrange(0, 20))
            idx.reset(w, snap)
            held[w] = set(snap)
        chain = rng.choice(chains)
        subset = set(rng.sample(names, 5)) if rng.random() < 0.3 else None
        assert idx.match(chain, 0.0, subset) == _reference_match(held, chain, subset)
    assert idx.num_blocks() == len(set().union(*held.values()) if held else set())
