from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler import Scheduler

from .utils import finish_step, make_request


def _step(sched: Scheduler, token: int = 7):
    """Pretend to run the batch: advance progress and append a token where one is sampled."""
    out = sched.schedule()
    finish_step(sched, out, token)
    return out


def test_chunked_prefill_shares_budget_with_decodes():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    a = make_request(list(range(6)), max_tokens=3)
    sched.add_request(a)
    out = sched.schedule()
    assert [(s.request is a, s.start, s.num_new_tokens) for s in out.scheduled] == [(True, 0, 6)]
    sched.update_after_step(out)
    a.append_output_token(1)
    b = make_request(list(range(100, 120)), max_tokens=2)
    sched.add_request(b)
    out = sched.schedule()
    # decode of a (1 token) first, then a 9-token chunk of b
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        (a.request_id, 6, 1), (b.request_id, 0, 9)]
    assert not out.scheduled[1].samples


def test_a_capped_long_prefill_yields_the_step_to_a_prompt_behind_it():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16,
                      long_prefill_token_threshold=6)
    long, short = make_request(list(range(40)), max_tokens=1), make_request([7] * 5, 1)
    sched.add_request(long)
    out = _step(sched)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 6)]
    sched.add_request(short)
    out = _step(sched)  # the short prompt alone: its first token does not wait for a chunk
    assert [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == [(short, 0, 5)]
    assert short.status is RequestStatus.FINISHED_LENGTH and short.output_token_ids == [7]
    steps = 2
    while long.status is not RequestStatus.FINISHED_LENGTH:
        out = _step(sched)
        assert [s.request for s in out.scheduled] == [long]
        assert out.num_batched_tokens <= 6
        steps += 1
    assert steps == 2 + 6  # ceil(34 / 6) more
    assert long.output_token_ids == [7] and not sched._yielded


def _long_running(num_blocks: int, prompt_len: int, max_num_seqs: int = 8):
    """A scheduler (budget 16, cap 6) that has run the first chunk of a long prompt."""
    sched = Scheduler(KVCacheManager(num_blocks=num_blocks, block_size=4), max_num_seqs,
                      max_num_batched_tokens=16, long_prefill_token_threshold=6)
    long = make_request(list(range(prompt_len)), max_tokens=1)
    sched.add_request(long)
    _step(sched)
    return sched, long


def test_a_long_prefill_yields_at_most_its_cap_in_tokens_of_steps_in_a_row():
    sched, long = _long_running(256, 200)
    ran = []
    for i in range(9):  # a 5-token prompt arrives before every step
        sched.add_request(make_request([100 + i] * 5, 1))
        out = _step(sched)
        ran.append(any(s.request is long for s in out.scheduled))
        assert out.num_batched_tokens in (5, 11)
    # yields 5 tokens, then 10 (>= 6): runs alongside the third short prompt, and again
    assert ran == [False, False, True] * 3


def test_waiting_prompts_that_fill_every_step_do_not_starve_a_long_prefill():
    sched, long = _long_running(512, 60, max_num_seqs=64)
    progress = [long.num_computed_tokens]
    for i in range(12):  # more short prompts arrive than a step holds
        for j in range(4):
            sched.add_request(make_request([1000 + 10 * i + j] * 5, 1))
        _step(sched)
        progress.append(long.num_computed_tokens)
    assert all(progress[k + 3] > progress[k] for k in range(len(progress) - 3)), progress


def test_decodes_do_not_make_a_long_prefill_yield():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16,
                      long_prefill_token_threshold=6)
    chat = make_request([5] * 3, max_tokens=20)
    sched.add_request(chat)
    _step(sched)
    long = make_request(list(range(30)), max_tokens=1)
    sched.add_request(long)
    for _ in range(5):
        out = _step(sched)
        assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(chat, 1), (long, 6)]
    assert long.status is RequestStatus.FINISHED_LENGTH


def test_without_a_cap_the_prompt_behind_a_long_one_waits_for_budget():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16)
    long, short = make_request(list(range(40)), max_tokens=1), make_request([7] * 5, 1)
    sched.add_request(long)
    _step(sched)
    sched.add_request(short)
    out = _step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(long, 16)]
    assert short.status is RequestStatus.WAITING


def test_priority_orders_waiting_and_preemption_picks_lowest_priority():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    low = make_request(list(range(8)), max_tokens=8, priority=5)
    high = make_request(list(range(50, 58)), max_tokens=8, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [high, low]  # both prefills, high first
    sched.update_after_step(out)
    for s in out.scheduled:
        s.request.append_output_token(1)
    # each holds 2 full blocks; the decode of token 9 needs a 3rd block each: no room
    out = sched.schedule()
    assert out.preempted == [low] and [s.request for s in out.scheduled] == [high]
    assert low.num_computed_tokens == 0 and low.status is RequestStatus.PREEMPTED
    assert low.output_token_ids == [1]  # generated tokens survive preemption


def test_abort_frees_blocks_immediately():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    r = make_request(list(range(20)), max_tokens=4)
    sched.add_request(r)
    _step(sched)
    assert kv.pool.num_free_blocks() < 16
    sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks() == 16 and not sched.has_unfinished()


def _check_invariants(sched: Scheduler, kv: KVCacheManager) -> None:
    refs = [0] * kv.pool.num_blocks
    for req in sched.running:
        for bid in kv.block_ids(req.request_id):
            refs[bid] += 1
    for _, _, req in sched._waiting:
        assert kv.block_ids(req.request_id) == []  # waiting requests hold no blocks
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in kv.pool._free)
    for h, block in kv.pool._cached.items():
        assert block.block_hash == h


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3),
                  st.integers(0, 2)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(4, 48), caching=st.booleans(), cap=st.integers(0, 8))
def test_random_add_step_abort_keeps_pool_consistent(ops, num_blocks, block_size, budget,
                                                     caching, cap):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, enable_events=True)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=budget,
                      long_prefill_token_threshold=cap)
    added = []
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prio, family = op
            # shared prefixes per family exercise prefix hits
            prompt = [family * 1000 + i for i in range(plen)]
            if (plen + max_tokens + block_size - 1) // block_size > num_blocks:
                continue  # the engine rejects what can never fit
            req = make_request(prompt, max_tokens=max_tokens, priority=prio)
            sched.add_request(req)
            added.append(req)
        elif op[0] == "step":
            _step(sched)
        elif added:
            victim = added[op[1] % len(added)]
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
        _check_invariants(sched, kv)
    for _ in range(2000):  # drain: everything admitted must finish
        if not sched.has_unfinished():
            break
        _step(sched)
        _check_invariants(sched, kv)
    assert not sched.has_unfinished()
    assert kv.pool.num_free_blocks() == num_blocks and kv.usage() == 0.0
    for req in added:
        if req.status is RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.max_tokens
