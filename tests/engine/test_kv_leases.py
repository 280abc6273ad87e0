"""Leases on KV blocks held for readers outside the engine (`kv_cache/leases.py`, the
`KVCacheManager`'s lease calls): a seeded randomized simulation of thousands of traces of
requests stepping through a real `Scheduler`, kept blocks and leased cached runs, renewals,
releases, uses and expiries on a fake clock. Checked after every operation: each block's
reference count is exactly its running requests plus its live leases; each lease ends once
(released by its holder or expired), after which its handle is refused with `LeaseError`;
expiry ends exactly the leases whose time is up. At the end every block is free."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem.engine.kv_cache.leases import LeaseError, LeaseStats, PageLease
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.kv_connector.base import (
    ConnectorMetadata,
    ExternalMatch,
    FinishAction,
    KVConnectorScheduler,
)
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.protocol.block_hash import HashKeys, hash_block_chain

from .utils import finish_step, make_request

BS = 4
TRACES = 2000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Trace:
    """One random trace and its model of which leases live, until when."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.clock = Clock()
        self.num_blocks = rng.randint(6, 40)
        self.kv = KVCacheManager(self.num_blocks, BS)
        self.kv.clock = self.clock
        self.kv.keep_lease_s = rng.choice([0.5, 3.0, 20.0])
        self.sched = Scheduler(self.kv, max_num_seqs=rng.randint(1, 4),
                               max_num_batched_tokens=rng.choice([8, 16, 64]))
        self.live: dict[str, PageLease] = {}  # the model: live leases, by id
        self.ended: dict[str, str] = {}  # lease id -> "released" / "expired"
        self.ends: Counter[str] = Counter()  # lease id -> how many times it ended
        self.handles: list[PageLease] = []  # every handle ever given, live or not
        self.kept_owners: set[str] = set()
        self.prompts: list[list[int]] = []
        self.owners = 0

    # -- operations --------------------------------------------------------------------------
    def submit(self) -> None:
        rng = self.rng
        if self.prompts and rng.random() < 0.5:  # a shared prefix: prefix hits
            base = rng.choice(self.prompts)
            prompt = base[: rng.randint(1, len(base))] + [rng.randrange(500)
                                                          for _ in range(rng.randint(0, 6))]
        else:
            prompt = [rng.randrange(500) for _ in range(rng.randint(2, 5 * BS))]
        self.prompts.append(prompt)
        req = make_request(prompt, max_tokens=rng.randint(1, 3))
        req.keep_kv = rng.random() < 0.6
        self.sched.add_request(req)

    def step(self) -> None:
        out = self.sched.schedule()
        before = set(self.sched.requests)
        finish_step(self.sched, out)
        for rid in before - set(self.sched.requests):  # finished: kept under a lease
            lease = self.kv.leases.of_owner(rid)
            if lease is not None:
                assert lease.expires == self.clock.now + self.kv.keep_lease_s
                self.live[lease.lease_id] = lease
                self.handles.append(lease)
                self.kept_owners.add(rid)

    def abort(self) -> None:
        if self.sched.requests:
            rid = self.rng.choice(sorted(self.sched.requests))
            self.sched.finish(self.sched.requests[rid], RequestStatus.FINISHED_ABORTED)
            assert self.kv.leases.of_owner(rid) is None  # an abort keeps nothing

    def lease_kept(self) -> None:
        if not self.kept_owners:
            return
        rid = self.rng.choice(sorted(self.kept_owners))
        lease_s = self.rng.choice([0.2, 1.0, 5.0])
        lease = self.kv.lease_kept(rid, lease_s)
        old = next((x for x in self.live.values() if x.owner == rid), None)
        if old is None:
            assert lease is None  # released or expired: nothing kept any more
            return
        assert lease is not None and lease.lease_id == old.lease_id
        assert (lease.block_ids, lease.expires) == (old.block_ids, self.clock.now + lease_s)
        self.live[lease.lease_id] = lease
        self.handles.append(lease)

    def lease_cached(self) -> None:
        if not self.prompts:
            return
        prompt = self.rng.choice(self.prompts)
        hashes = hash_block_chain(prompt, BS, HashKeys())
        cached = self.kv.cached_prefix(hashes)
        self.owners += 1
        lease = self.kv.lease_cached(f"reader-{self.owners}", hashes,
                                     self.rng.choice([0.5, 2.0, 8.0]))
        assert lease.block_ids == tuple(b.block_id for b in cached)
        self.live[lease.lease_id] = lease
        self.handles.append(lease)

    def renew(self) -> None:
        handle = self._any_handle()
        if handle is None:
            return
        lease_s = self.rng.choice([0.3, 2.0, 10.0])
        if handle.lease_id in self.live:
            lease = self.kv.renew_lease(handle.lease_id, lease_s)
            assert lease.expires == self.clock.now + lease_s
            self.live[lease.lease_id] = lease
        else:
            self._refused(handle, lambda: self.kv.renew_lease(handle.lease_id, lease_s))

    def release(self) -> None:
        handle = self._any_handle()
        if handle is None:
            return
        released = self.kv.release_lease(handle.lease_id)
        assert released == (handle.lease_id in self.live)  # a second release: False
        if released:
            self._end(handle.lease_id, "released")

    def release_kept(self) -> None:
        if not self.kept_owners:
            return
        rid = self.rng.choice(sorted(self.kept_owners))
        live = next((x for x in self.live.values() if x.owner == rid), None)
        assert self.kv.release_kept(rid) == (live is not None)
        if live is not None:
            self._end(live.lease_id, "released")

    def use(self) -> None:
        handle = self._any_handle()
        if handle is None:
            return
        if handle.lease_id in self.live:
            blocks = self.kv.lease_blocks(handle.lease_id)
            assert tuple(b.block_id for b in blocks) == handle.block_ids
            assert all(b.ref_cnt >= 1 for b in blocks)
        else:
            self._refused(handle, lambda: self.kv.lease_blocks(handle.lease_id))

    def advance(self) -> None:
        self.clock.now += self.rng.choice([0.0, 0.1, 0.5, 2.0, 7.0])
        due = {i for i, x in self.live.items() if x.expires <= self.clock.now}
        gone = self.kv.expire_leases()
        assert {x.lease_id for x in gone} == due  # exactly those whose time is up
        for lease_id in due:
            self._end(lease_id, "expired")

    # -- checks ------------------------------------------------------------------------------
    def _any_handle(self) -> PageLease | None:
        return self.rng.choice(self.handles) if self.handles else None

    def _end(self, lease_id: str, why: str) -> None:
        del self.live[lease_id]
        self.ended[lease_id] = why
        self.ends[lease_id] += 1

    def _refused(self, handle: PageLease, call) -> None:
        why = "was released" if self.ended[handle.lease_id] == "released" else "expired"
        with pytest.raises(LeaseError, match=why):
            call()

    def check(self) -> None:
        holders: Counter[int] = Counter()
        for blocks in self.kv._blocks.values():  # running requests
            holders.update(b.block_id for b in blocks)
        for lease in self.live.values():
            holders.update(lease.block_ids)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
        free = sum(1 for b in self.kv.pool.blocks if b.ref_cnt == 0)
        assert self.kv.pool.num_free_blocks() == free
        assert all(n == 1 for n in self.ends.values())  # ended exactly once
        released = sum(1 for w in self.ended.values() if w == "released")
        assert self.kv.lease_stats() == LeaseStats(len(self.live), released,
                                                   len(self.ended) - released)

    def run(self) -> None:
        ops = [(self.submit, 4), (self.step, 8), (self.abort, 1), (self.lease_kept, 2),
               (self.lease_cached, 2), (self.renew, 2), (self.release, 2),
               (self.release_kept, 1), (self.use, 2), (self.advance, 3)]
        funcs, weights = zip(*ops, strict=True)
        for _ in range(self.rng.randint(10, 60)):
            self.rng.choices(funcs, weights)[0]()
            self.check()
        for rid in sorted(self.sched.requests):  # the end: every request goes
            self.sched.finish(self.sched.requests[rid], RequestStatus.FINISHED_ABORTED)
        self.clock.now += 1000.0
        self.advance()
        self.check()
        assert not self.live and set(self.ended) == {h.lease_id for h in self.handles}
        assert self.kv.pool.num_free_blocks() == self.num_blocks


def test_every_lease_ends_once_and_the_pool_is_whole_again():
    stats = Counter()
    for seed in range(TRACES):
        trace = Trace(seed)
        trace.run()
        stats.update(trace.ended.values())
    # the traces exercise both ends, many times
    assert stats["released"] > 1000 and stats["expired"] > 1000, stats


def test_a_lease_that_ended_is_refused_by_name_and_a_late_release_is_harmless():
    kv = KVCacheManager(8, BS)
    clock = Clock()
    kv.clock = clock
    prompt = list(range(10, 19))
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    req = make_request(prompt, max_tokens=1)
    req.keep_kv = True
    sched.add_request(req)
    finish_step(sched, sched.schedule())
    kept = kv.lease_kept(req.request_id, 1.0)
    assert kept is not None and len(kept.block_ids) == 3 and kv.pool.num_free_blocks() == 5
    clock.now += 1.0
    assert kv.expire_leases() == [kept] and kv.pool.num_free_blocks() == 8
    with pytest.raises(LeaseError, match=f"lease {kept.lease_id} expired") as err:
        kv.lease_blocks(kept.lease_id)
    assert err.value.expired  # a transport answers it as a deadline (DEADLINE_EXCEEDED)
    with pytest.raises(LeaseError, match="expired"):
        kv.renew_lease(kept.lease_id, 5.0)
    assert kv.release_lease(kept.lease_id) is False  # a late acknowledgement
    assert kv.lease_kept(req.request_id, 5.0) is None and not kv.release_kept(req.request_id)

    hashes = hash_block_chain(prompt, BS, HashKeys())
    lease = kv.lease_cached("peer", hashes, 30.0)  # the blocks are still cached
    assert len(lease.block_ids) == 2 and kv.pool.num_free_blocks() == 6
    with pytest.raises(ValueError, match="holds a lease already"):
        kv.lease_cached("peer", hashes, 30.0)
    assert kv.pool.num_free_blocks() == 6  # the refused lease pinned nothing
    with pytest.raises(ValueError, match=r"lease_s must be in \(0, 600\]"):
        kv.renew_lease(lease.lease_id, 601.0)
    assert kv.release_lease(lease.lease_id) and not kv.release_lease(lease.lease_id)
    with pytest.raises(LeaseError, match="was released") as err:
        kv.lease_blocks(lease.lease_id)
    assert not err.value.expired
    with pytest.raises(LeaseError, match="is unknown") as err:
        kv.lease_blocks("nope")
    assert not err.value.expired
    assert kv.pool.num_free_blocks() == 8
    assert kv.lease_stats() == LeaseStats(active=0, released=1, expired=1)


class Deciding(KVConnectorScheduler):
    """A connector scheduler side that records allocations and keeps finished `keep_kv`
    requests' blocks for 2 s, except request "drop"'s."""

    def __init__(self) -> None:
        self.allocs: list[tuple[str, list[int]]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens) -> ExternalMatch:
        return ExternalMatch()

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        self.allocs.append((request.request_id, list(block_ids)))

    def build_connector_meta(self) -> ConnectorMetadata:
        return ConnectorMetadata()

    def request_finished(self, request, block_ids) -> FinishAction:
        return FinishAction(request.request_id != "drop", 2.0)


def test_the_connector_is_told_of_allocations_and_decides_what_a_finish_keeps():
    kv = KVCacheManager(16, BS)
    kv.clock = clock = Clock()
    kv.connector = side = Deciding()
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    for rid in ("keep", "drop"):
        req = make_request(list(range(20, 27)), max_tokens=3, request_id=rid)
        req.keep_kv = True
        sched.add_request(req)
    while sched.requests:
        finish_step(sched, sched.schedule())
    # each allocation that added blocks: the prompt's 2, then the one its 8th token opened
    assert [(rid, len(ids)) for rid, ids in side.allocs] == [
        ("keep", 2), ("drop", 2), ("keep", 1), ("drop", 1)]
    lease = kv.leases.of_owner("keep")
    assert lease is not None and lease.expires == clock.now + 2.0
    assert kv.kept_blocks("drop") is None and kv.pool.num_free_blocks() == 13
    clock.now += 2.0
    assert kv.expire_leases() == [lease] and kv.pool.num_free_blocks() == 16
