"""The scheduler and KV manager under memory pressure, on plain values: what joins the prefix
cache and when, which request is preempted, who is admitted past a blocked head, and what
the prefix-hit counters and `num_cached_tokens` report."""

from __future__ import annotations

from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.protocol.block_hash import HashKeys, hash_block_chain, root_hash
from tandem.protocol.kv_events import BlockStored

from .utils import finish_step, make_request

BS = 4


_ran = finish_step  # the forward of `out` completed: progress, sampled tokens, finishes


def _step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    _ran(sched, out)
    return out


def test_blocks_join_the_cache_and_events_go_out_only_after_the_step():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_events=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = make_request(list(range(100, 110)), max_tokens=2)  # 2 full blocks + 2 tokens
    sched.add_request(req)
    out = sched.schedule()
    assert kv.pool.cached_hashes() == [] and kv.pool.take_events() == []
    _ran(sched, out)
    chain = hash_block_chain(req.prompt_token_ids, BS, HashKeys())
    assert set(kv.pool.cached_hashes()) == set(chain)
    [event] = kv.pool.take_events()
    assert isinstance(event, BlockStored) and event.block_hashes == tuple(chain)


def test_a_failed_or_aborted_step_leaves_no_hash_for_what_it_did_not_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_events=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    req = make_request(list(range(100, 120)), max_tokens=2)
    sched.add_request(req)
    _step(sched)  # tokens 0..7: two blocks computed
    sched.schedule()  # tokens 8..15 scheduled; the forward fails, the request is failed
    sched.finish(req, RequestStatus.FINISHED_ERROR)
    chain = hash_block_chain(req.prompt_token_ids, BS, HashKeys())
    assert set(kv.pool.cached_hashes()) == set(chain[:2])
    again = make_request(req.prompt_token_ids, max_tokens=2)
    assert kv.get_computed_blocks(again)[1] == 8  # hits only what was computed


def test_a_deferred_long_prefill_never_preempts_a_prompt_admitted_in_the_same_step():
    """The issue's first path: the deferred pass used to take the latest arrival, often a
    prompt the waiting pass had just admitted (its blocks registered, never computed)."""
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_events=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16,
                      long_prefill_token_threshold=8)
    long = make_request(list(range(200, 217)), max_tokens=1)  # 17 tokens
    sched.add_request(long)
    _step(sched)  # 8 computed, 2 blocks held; 9 left: a long prefill
    short = make_request(list(range(300, 312)), max_tokens=1)  # a chunk of 8: 2 blocks
    sched.add_request(short)
    out = sched.schedule()
    # long's chunk (tokens 8..15) needs 2 blocks, 1 is free: it sits out rather than take
    # the blocks of the prompt this step just admitted
    assert [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == [(short, 0, 8)]
    assert out.preempted == [] and long.status is RequestStatus.RUNNING
    short_chain = hash_block_chain(short.prompt_token_ids, BS, HashKeys())
    assert not set(short_chain) & set(kv.pool.cached_hashes())
    _ran(sched, out)
    assert set(short_chain[:2]) <= set(kv.pool.cached_hashes())
    while sched.has_unfinished():
        _step(sched)
    assert long.num_output_tokens == short.num_output_tokens == 1


def test_after_a_resume_the_running_pass_preempts_from_behind_not_what_it_scheduled():
    """The issue's second path: a resumed request sat at the end of `running` though it
    arrived first, so the victim (the latest arrival) could be one already scheduled."""
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    first = make_request(list(range(100, 107)), max_tokens=12)  # 7 tokens
    second = make_request(list(range(200, 207)), max_tokens=12)
    sched.add_request(first)
    sched.add_request(second)
    preempted = []
    for _ in range(30):
        if not sched.has_unfinished():
            break
        out = _step(sched)
        ran = {id(s.request) for s in out.scheduled}
        assert not any(id(v) in ran for v in out.preempted)
        preempted += out.preempted
        # running stays in arrival order whatever was preempted and resumed
        assert [r.arrival_seq for r in sched.running] == sorted(
            r.arrival_seq for r in sched.running)
    assert preempted and not sched.has_unfinished()
    assert second in preempted  # the later arrival gives way
    assert first.num_output_tokens == second.num_output_tokens == 12


def test_an_identical_prompt_waits_a_step_and_hits_instead_of_computing_twice():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(100, 118))  # 4 full blocks + 2
    a, b = make_request(prompt, max_tokens=2), make_request(prompt, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = _step(sched)
    assert [s.request for s in out.scheduled] == [a]  # b's blocks are being computed by a
    out = _step(sched)
    [sb] = [s for s in out.scheduled if s.request is b]
    assert (sb.start, sb.num_new_tokens) == (16, 2)
    assert kv.prefix_hits == 16 and kv.prefix_queries == 2 * 18


def test_a_different_prompt_does_not_wait_for_blocks_it_does_not_share():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_request(list(range(100, 118)), max_tokens=2)
    b = make_request(list(range(100, 104)) + list(range(500, 514)), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [a, b]  # only block 0 is shared: no wait
    assert kv.prefix_hits == 0


def _staged_import(kv: KVCacheManager, prompt: list[int], rid: str) -> list:
    """What the P/D decode side does: pin the full blocks before the last token and a block
    for the last one, register, stage."""
    usable = (len(prompt) - 1) // BS
    chain = hash_block_chain(prompt[:usable * BS], BS, HashKeys())
    pinned, fresh = kv.import_blocks(chain, tail=True)
    assert len(pinned) == usable + 1 and fresh == list(range(usable + 1))
    kv.commit_import(pinned[:usable], chain, root_hash(HashKeys()), prompt[:usable * BS])
    kv.stage_tail(rid, pinned[usable], usable, prompt[usable * BS:len(prompt) - 1])
    return pinned


def test_an_import_is_pinned_all_or_nothing_with_a_block_for_the_last_token():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    chain = hash_block_chain(list(range(16)), BS, HashKeys())
    assert kv.import_blocks(chain, tail=True) == ([], [])  # 5 blocks do not fit in 4
    assert kv.pool.num_free_blocks() == 4
    pinned, fresh = kv.import_blocks(chain[:3], tail=True)
    assert len(pinned) == 4 and fresh == [0, 1, 2, 3] and kv.pool.num_free_blocks() == 0
    assert KVCacheManager(4, BS, enable_caching=False).import_blocks(chain[:1]) == ([], [])


def test_an_import_of_a_block_the_cache_came_to_hold_pins_the_cached_one():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(100, 109))
    chain = hash_block_chain(prompt[:8], BS, HashKeys())
    pinned, _ = kv.import_blocks(chain)  # the pages are on their way...
    local = make_request(prompt, max_tokens=1)
    sched.add_request(local)
    _step(sched)  # ...while this worker computes the same blocks
    mine = [kv.pool.get_cached_block(h) for h in chain]
    kv.commit_import(pinned, chain, root_hash(HashKeys()), prompt[:8])
    assert pinned == mine and all(b.ref_cnt == 1 for b in pinned)
    kv.unpin(pinned)
    assert kv.pool.num_free_blocks() == 8


def test_a_staged_request_is_admitted_past_a_head_that_does_not_fit():
    """Pages pinned for a P/D request behind a blocked head would hold the pool while it
    waits; it needs no free block, so it goes first."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    runner = make_request(list(range(900, 907)), max_tokens=40)  # 2 blocks, keeps running
    sched.add_request(runner)
    _step(sched)
    head = make_request(list(range(100, 120)), max_tokens=2)  # 5 blocks: does not fit
    sched.add_request(head)
    prompt = list(range(300, 310))
    pinned = _staged_import(kv, prompt, "pd")  # 3 blocks pinned: 3 free
    pd = make_request(prompt, max_tokens=2, request_id="pd")
    sched.add_request(pd)
    out = sched.schedule()
    got = {s.request.request_id: (s.start, s.num_new_tokens) for s in out.scheduled}
    assert got == {runner.request_id: (7, 1), "pd": (9, 1)}
    assert head.status is RequestStatus.WAITING
    assert kv.pool.num_free_blocks() == 3 and pinned[-1].ref_cnt == 1


def test_a_stalled_step_admits_a_request_that_fits_behind_one_that_does_not():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    chain = hash_block_chain(list(range(500, 516)), BS, HashKeys())
    held, _ = kv.import_blocks(chain[:3])  # pinned outside the scheduler (3 of 6)
    head = make_request(list(range(100, 116)), max_tokens=2)  # 5 blocks: does not fit
    small = make_request([7, 8, 9], max_tokens=2)
    sched.add_request(head)
    sched.add_request(small)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [small]
    assert head.status is RequestStatus.WAITING
    kv.unpin(held)


def test_prefix_counters_count_an_admission_once_not_every_retry():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    blocker = make_request(list(range(100, 116)), max_tokens=6)  # 4 blocks, then 6 tokens
    sched.add_request(blocker)
    _step(sched)
    waiting = make_request(list(range(100, 108)) + list(range(600, 612)), max_tokens=1)
    sched.add_request(waiting)
    for _ in range(4):  # the blocker runs on; `waiting` (5 blocks) is retried each step
        _step(sched)
    assert kv.prefix_queries == 16  # the blocker's admission only
    while waiting.status is not RequestStatus.RUNNING and sched.has_unfinished():
        _step(sched)
    assert kv.prefix_queries == 16 + 20 and kv.prefix_hits == 8


def test_num_cached_tokens_counts_prompt_tokens_the_request_never_computed():
    """Not frozen at the first admission: a preempted request that comes back with a longer
    hit counts the part others computed, not the part it computed itself."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    slow = make_request(prompt, max_tokens=1, priority=1)
    sched.add_request(slow)
    _step(sched)  # slow computes block 0 (tokens 0..3) itself
    assert slow.num_cached_tokens == 0
    sched.max_num_batched_tokens = 64
    # preempt it, then let a higher-priority twin compute the prompt
    sched._preempt(slow, SchedulerOutput())
    twin = make_request(prompt, max_tokens=1, priority=0)
    sched.add_request(twin)
    while twin.status is not RequestStatus.FINISHED_LENGTH:
        _step(sched)
    while slow.status is not RequestStatus.FINISHED_LENGTH:
        _step(sched)
    # its second admission hit 12 tokens; 4 of them it had computed itself
    assert slow.num_cached_tokens == 8
    assert twin.num_cached_tokens == 4  # block 0, computed by `slow`
