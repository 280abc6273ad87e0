"""The KV manager's transfer hooks on plain values: kept blocks of finished `keep_kv`
requests, and importing a chain of blocks that arrives from another worker."""

from __future__ import annotations

from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.protocol.block_hash import HashKeys, hash_block_chain, root_hash
from tandem.protocol.kv_events import BlockStored

from .utils import make_request

BS = 4


def _run_to_end(sched: Scheduler, req) -> None:
    while not req.is_finished:
        out = sched.schedule()
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.append_output_token(9)
                if s.request.num_output_tokens >= s.request.max_tokens:
                    sched.finish(s.request, RequestStatus.FINISHED_LENGTH)


def test_a_keep_kv_request_keeps_its_blocks_until_released():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = make_request(list(range(10)), max_tokens=1)
    req.keep_kv = True
    sched.add_request(req)
    _run_to_end(sched, req)
    kept = kv.kept_blocks(req.request_id)
    assert kept is not None and len(kept) == 3 and all(b.ref_cnt == 1 for b in kept)
    assert kv.pool.num_free_blocks() == 13
    assert kv.release_kept(req.request_id) and not kv.release_kept(req.request_id)
    assert kv.pool.num_free_blocks() == 16 and all(b.ref_cnt == 0 for b in kept)


def test_aborted_or_preempted_keep_kv_requests_keep_nothing():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = make_request(list(range(10)), max_tokens=5)
    req.keep_kv = True
    sched.add_request(req)
    sched.update_after_step(sched.schedule())
    sched.finish(req, RequestStatus.FINISHED_ABORTED)
    assert kv.kept_blocks(req.request_id) is None
    assert kv.pool.num_free_blocks() == 16


def test_imported_blocks_are_pinned_registered_and_hit_by_the_next_request():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_events=True)
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    keys = HashKeys()
    chain = hash_block_chain(prompt, BS, keys)
    pinned, fresh = kv.import_blocks(chain)
    assert len(pinned) == 3 and fresh == [0, 1, 2]
    kv.commit_import(pinned, chain, root_hash(keys), prompt[:3 * BS])
    events = kv.pool.take_events()
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [tuple(chain)]
    assert kv.pool.num_free_blocks() == 5  # pinned: not evictable
    req = make_request(prompt, max_tokens=2)
    hit, tokens = kv.get_computed_blocks(req)
    assert hit == pinned and tokens == 3 * BS
    # a second import of the same chain reuses the cached blocks: nothing to write
    again, fresh2 = kv.import_blocks(chain)
    assert again == pinned and fresh2 == [] and all(b.ref_cnt == 2 for b in pinned)
    kv.unpin(again)
    kv.unpin(pinned)
    assert kv.pool.num_free_blocks() == 8
    assert kv.pool.get_cached_block(chain[0]) is pinned[0]  # still cached after unpinning


def test_an_import_is_pinned_whole_or_not_at_all():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    chain = hash_block_chain(list(range(20)), BS, HashKeys())  # 5 blocks
    assert kv.import_blocks(chain) == ([], []) and kv.pool.num_free_blocks() == 2
    pinned, fresh = kv.import_blocks(chain[:2])
    assert len(pinned) == 2 and fresh == [0, 1] and kv.pool.num_free_blocks() == 0
    kv.commit_import(pinned, chain, root_hash(HashKeys()), list(range(8)))
    assert kv.pool.get_cached_block(chain[1]) is pinned[1]
    assert kv.pool.get_cached_block(chain[2]) is None


def _import_with_tail(kv: KVCacheManager, prompt: list[int], rid: str):
    """What the decode side does for `prompt`: pin its full blocks before the last token and
    a block for the last one, register the full ones and stage the last (its partial tokens
    and, after them, the last token's slot)."""
    usable = (len(prompt) - 1) // BS
    chain = hash_block_chain(prompt[:usable * BS], BS, HashKeys())
    pinned, fresh = kv.import_blocks(chain, tail=True)
    assert len(pinned) == usable + 1 and fresh[-1] == usable  # the staged block: fresh
    kv.commit_import(pinned[:usable], chain, root_hash(HashKeys()), prompt[:usable * BS])
    kv.stage_tail(rid, pinned[usable], usable, prompt[usable * BS:len(prompt) - 1])
    return chain, pinned


def test_a_staged_tail_is_taken_over_and_only_the_last_token_is_computed():
    # a one-token tail; a block-aligned prompt (a 3-token tail); a last token that starts a
    # block (an empty staged block: the request still needs no free block)
    for n in (14, 16, 13):
        kv = KVCacheManager(num_blocks=12, block_size=BS)
        sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
        prompt = list(range(100, 100 + n))
        chain, pinned = _import_with_tail(kv, prompt, "r-tail")
        req = make_request(prompt, max_tokens=2, request_id="r-tail")
        sched.add_request(req)
        out = sched.schedule()
        [s] = out.scheduled
        assert (s.start, s.num_new_tokens) == (n - 1, 1) and s.samples
        assert req.num_cached_tokens == n - 1
        assert kv.block_ids("r-tail")[:len(pinned)] == [b.block_id for b in pinned]
        kv.unpin(pinned[:-1])  # the import's pins on the full blocks end
        kv.drop_tail("r-tail")  # a no-op: the request holds the partial block now
        assert all(b.ref_cnt == 1 for b in pinned)
        full = hash_block_chain(prompt, BS, HashKeys())
        if n % BS == 0:  # the step fills the partial block: cached once the step ran
            assert kv.pool.get_cached_block(full[-1]) is None
        sched.update_after_step(out)
        if n % BS == 0:
            assert kv.pool.get_cached_block(full[-1]) is pinned[-1]
        sched.finish(req, RequestStatus.FINISHED_ABORTED)
        assert kv.pool.num_free_blocks() == 12


def test_a_staged_tail_is_used_only_where_it_continues_the_prompt_and_never_leaks():
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(100, 114))
    _, pinned = _import_with_tail(kv, prompt, "other-tokens")
    # a request under that id whose tail tokens differ: the full blocks hit, the tail is
    # computed, and the staged block goes back to the pool when the request ends
    changed = prompt[:12] + [7, 8]
    req = make_request(changed, max_tokens=1, request_id="other-tokens")
    sched.add_request(req)
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(12, 2)]
    assert pinned[-1].block_id not in kv.block_ids("other-tokens")
    sched.update_after_step(out)
    sched.finish(req, RequestStatus.FINISHED_LENGTH)
    kv.unpin(pinned[:-1])
    assert kv.pool.num_free_blocks() == 12
    # staged, then the request is aborted while it waits: freed with it
    _, pinned = _import_with_tail(kv, prompt, "waiting")
    req = make_request(prompt, max_tokens=1, request_id="waiting")
    sched.add_request(req)
    sched.finish(req, RequestStatus.FINISHED_ABORTED)
    kv.unpin(pinned[:-1])
    assert kv.pool.num_free_blocks() == 12
    # staged for a request that never arrives: `drop_tail` (the import's unpin) frees it
    _, pinned = _import_with_tail(kv, prompt, "never")
    kv.unpin(pinned[:-1])
    kv.drop_tail("never")
    kv.drop_tail("never")
    assert kv.pool.num_free_blocks() == 12
    # prompt logprobs bypass the cache: the tail is not taken either
    _, pinned = _import_with_tail(kv, prompt, "logprobs")
    req = make_request(prompt, max_tokens=1, request_id="logprobs", prompt_logprobs=1)
    sched.add_request(req)
    assert [(s.start, s.num_new_tokens) for s in sched.schedule().scheduled] == [(0, 14)]
    sched.finish(req, RequestStatus.FINISHED_ABORTED)
    kv.unpin(pinned[:-1])
    assert kv.pool.num_free_blocks() == 12


def test_an_import_pins_the_staged_block_only_with_every_full_block():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    chain = hash_block_chain(list(range(12)), BS, HashKeys())
    assert kv.import_blocks(chain, tail=True) == ([], [])  # no room for the staged block
    assert kv.pool.num_free_blocks() == 3
    pinned, fresh = kv.import_blocks(chain[:2], tail=True)
    assert len(pinned) == 3 and fresh == [0, 1, 2] and pinned[2].block_hash is None


def test_a_cancelled_caller_cannot_kill_the_engine_thread():
    """An `AsyncLLMEngine.call` whose caller gave up before the engine thread got to it
    still runs (it may hold resources), and settling its cancelled future does not raise
    in the engine thread (it used to: InvalidStateError killed the loop)."""
    import concurrent.futures
    import threading

    from tandem.engine.async_engine import AsyncLLMEngine, _Call

    class FakeEngine:
        config = type("C", (), {"enable_kv_events": False, "kv_offload_host_bytes": 0})()
        last_step_idle = False

        def stats(self):
            return None

        def has_unfinished_requests(self):
            return False

        def step(self):
            return []

        def expire_leases(self):
            return False

    engine = AsyncLLMEngine(FakeEngine())  # type: ignore[arg-type]
    try:
        ran = threading.Event()
        call_done: concurrent.futures.Future = concurrent.futures.Future()
        call_done.cancel()
        engine._send(_Call(lambda e: ran.set(), call_done))
        assert ran.wait(5)
        ok: concurrent.futures.Future = concurrent.futures.Future()
        engine._send(_Call(lambda e: "alive", ok))
        assert ok.result(timeout=5) == "alive" and engine.alive
    finally:
        engine.shutdown()


def test_requests_taken_in_count_in_the_load_before_the_next_step_ends():
    """`snapshot` (what GetLoad and /metrics report) includes requests the engine thread has
    taken in even while the step that follows is still running: a long prefill step must
    not hide a growing queue from routers (conditional disaggregation reads it)."""
    import threading

    from tandem.engine.async_engine import AsyncLLMEngine, _Call

    release = threading.Event()
    stepping = threading.Event()

    class FakeEngine:
        config = type("C", (), {"enable_kv_events": False, "kv_offload_host_bytes": 0})()
        last_step_idle = False
        queued = 0

        def stats(self):
            return self.queued

        def has_unfinished_requests(self):
            return self.queued > 0

        def step(self):
            stepping.set()
            assert release.wait(10)  # a long step
            return []

        def expire_leases(self):
            return False

    fake = FakeEngine()
    engine = AsyncLLMEngine(fake)  # type: ignore[arg-type]
    try:
        import concurrent.futures

        done: concurrent.futures.Future = concurrent.futures.Future()

        def take(e: FakeEngine) -> None:
            e.queued += 3

        engine._send(_Call(take, done))
        done.result(timeout=5)
        assert stepping.wait(5)  # the step that follows is running and blocked
        assert engine.snapshot == 3
    finally:
        release.set()
        engine.shutdown()
