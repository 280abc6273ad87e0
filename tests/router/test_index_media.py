"""The prefix index with KV media (device pool, host tier, disk tier) against a reference
model of plain sets, over seeded random event traces."""

from __future__ import annotations

import hashlib
import random

import pytest

from tandem.protocol.kv_events import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST
from tandem.router.index import Hit, PrefixIndex

MEDIA = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)


def _h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


def reference_hit(held: dict[str, set[bytes]], chain: list[bytes]) -> Hit | None:
    """The leading run by medium, as `Hit` defines it, walked block by block."""
    stage = 0  # 0 device, 1 host, 2 disk: the slowest medium the run has reached
    counts = [0, 0, 0]
    for h in chain:
        if stage == 0 and h in held[MEDIUM_DEVICE]:
            pass
        elif stage <= 1 and (h in held[MEDIUM_DEVICE] or h in held[MEDIUM_HOST]):
            stage = 1
        elif any(h in held[m] for m in MEDIA):
            stage = 2
        else:
            break
        counts[stage] += 1
    return Hit(*counts) if sum(counts) else None


def test_a_block_evicted_to_host_is_held_on_host_until_its_last_medium_goes() -> None:
    idx = PrefixIndex()
    chain = [_h(i) for i in range(6)]
    idx.stored("w", chain)
    idx.removed("w", chain[3:], MEDIUM_DEVICE)
    idx.stored("w", chain[3:], MEDIUM_HOST)
    idx.stored("w", chain[5:], MEDIUM_DISK)
    assert idx.match_media(chain, 0.0) == {"w": Hit(3, 3, 0)}
    assert idx.match(chain, 0.0) == {"w": 3}  # device blocks only
    idx.removed("w", chain[4:], MEDIUM_HOST)  # block 5 is still on disk, block 4 nowhere
    assert idx.match_media(chain, 0.0) == {"w": Hit(3, 1, 0)}
    idx.removed("w", chain[:1], MEDIUM_DEVICE)  # the run starts with a miss
    assert idx.match_media(chain, 0.0) == {}
    assert idx.has_tiers()
    idx.cleared("w")
    assert not idx.has_tiers() and idx.match_media(chain[1:], 0.0) == {}
    with pytest.raises(ValueError, match="unknown KV medium"):
        idx.stored("w", chain, "tape")


def test_speculative_blocks_count_on_device_ahead_of_tier_blocks() -> None:
    idx = PrefixIndex(speculative_ttl_s=1.0)
    chain = [_h(i) for i in range(4)]
    idx.stored("w", chain[2:], MEDIUM_HOST)
    idx.add_speculative("w", chain[:2], now=0.0)
    assert idx.match_media(chain, 0.5) == {"w": Hit(2, 2, 0)}
    assert idx.match_media(chain, 1.5) == {}  # expired: the run starts with a miss


@pytest.mark.parametrize("seed", range(2))
def test_index_with_media_matches_a_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    universe = [_h(seed * 1000 + i) for i in range(90)]
    idx = PrefixIndex()  # reused: each trace ends by dropping its workers (slots reused)
    for _trace in range(500):
        workers = [f"w{i}" for i in range(rng.randint(1, 7))]
        ref = {w: {m: set() for m in MEDIA} for w in workers}
        for _op in range(rng.randint(3, 14)):
            w = rng.choice(workers)
            op = rng.random()
            batch = rng.sample(universe, rng.choice((1, 3, 20, 70, 90)))
            medium = rng.choice(MEDIA)
            if op < 0.45:
                idx.stored(w, batch, rng.choice(("", MEDIUM_DEVICE))
                           if medium == MEDIUM_DEVICE else medium)
                ref[w][medium] |= set(batch)
            elif op < 0.8:
                idx.removed(w, batch, medium)
                ref[w][medium] -= set(batch)
            elif op < 0.87:  # a snapshot (a reconnect): device, host-only, disk-only lists
                dev, host, disk = (set(rng.sample(universe, rng.randint(0, 60)))
                                   for _ in range(3))
                if rng.random() < 0.5:
                    idx.drop(w)  # the stream broke first
                idx.reset(w, list(dev), host=list(host), disk=list(disk))
                ref[w] = {MEDIUM_DEVICE: dev, MEDIUM_HOST: host, MEDIUM_DISK: disk}
            elif op < 0.93:
                idx.cleared(w)
                ref[w] = {m: set() for m in MEDIA}
            else:
                idx.drop(w)
                ref[w] = {m: set() for m in MEDIA}
            for _ in range(1):  # chains: a run of held blocks, then anything
                chain = rng.sample(universe, rng.randint(1, 90))
                if rng.random() < 0.5:  # lead with blocks some worker holds
                    pick = sorted(set().union(*ref[rng.choice(workers)].values()),
                                  key=universe.index)
                    chain = rng.sample(pick, min(len(pick), rng.randint(0, 70))) + chain
                    chain = list(dict.fromkeys(chain))
                subset = rng.sample(workers, rng.randint(1, len(workers)))
                want = {x: reference_hit(ref[x], chain) for x in subset}
                want = {x: hit for x, hit in want.items() if hit is not None}
                assert idx.match_media(chain, 0.0, subset) == want
                assert idx.match_media(chain, 0.0, subset, speculative=False) == want
                dev = {x: hit.device for x, hit in want.items() if hit.device}
                assert idx.match(chain, 0.0, subset) == dev
        for w in workers:
            assert idx.keys(w) == {int.from_bytes(h[:8], "little")
                                   for h in ref[w][MEDIUM_DEVICE]}
        assert idx.has_tiers() == any(ref[w][m] for w in workers for m in TIER_MEDIA)
        for w in workers:
            idx.drop(w)
        assert not idx.has_tiers() and idx.num_blocks() == 0 and not idx.workers()


TIER_MEDIA = (MEDIUM_HOST, MEDIUM_DISK)
