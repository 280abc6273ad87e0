"""The write-tracking simulation (`kv_sim`) over thousands of seeded random traces: no chunk
ever reads a KV slot that was not written with its token, nothing uncomputed reaches the
prefix cache or a `BlockStored` event, every pin is released, outputs are exact.

The traces run in two processes (CI has two cores), each over its own share of the seeds.
A second set runs a sliding-window model: blocks behind every query's window are freed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from multiprocessing.pool import Pool

import pytest

from .kv_sim import SimViolation, run_trace, sim_tokenizer
from .sim_pool import num_procs, split, start_pool

NUM_TRACES = 20_000
NUM_WINDOW_TRACES = 2_000
COUNTS = ("traces", "steps", "finished", "preemptions", "errors", "draft_tokens", "accepted",
          "window_freed", "long_finished")


def _run_seeds(seeds: range, window: bool = False) -> dict:
    """Traces for `seeds`: the first violations and what the traces exercised."""
    logging.disable(logging.CRITICAL)  # injected faults log a traceback each
    tok = sim_tokenizer()
    stats: dict = dict.fromkeys(COUNTS, 0)
    stats["violations"] = []
    for seed in seeds:
        try:
            sim = run_trace(seed, tok, window=window)
        except SimViolation as exc:
            stats["violations"].append(str(exc))
            if len(stats["violations"]) >= 5:
                break
            continue
        stats["traces"] += 1
        stats["steps"] += sim.steps
        stats["finished"] += sim.done
        stats["preemptions"] += sim.sched.num_preemptions
        stats["errors"] += sim.failed_steps
        stats["window_freed"] += sim.kv.window_freed_blocks
        stats["long_finished"] += sim.long_done
        if sim.engine.speculator is not None:
            spec = sim.engine.speculator.stats()
            stats["draft_tokens"] += spec.num_draft_tokens
            stats["accepted"] += spec.num_accepted_tokens
    return stats


@pytest.fixture(scope="module")
def sim_pool() -> Iterator[Pool]:
    """The worker processes, spawned once for both sets of traces."""
    with start_pool() as pool:
        yield pool


def _run_parallel(pool: Pool, num: int, window: bool = False) -> dict:
    parts = pool.map(functools.partial(_run_seeds, window=window), split(num, num_procs()))
    total = {k: sum(p[k] for p in parts) for k in COUNTS}
    total["violations"] = [v for p in parts for v in p["violations"]]
    return total


def test_random_traces_read_only_written_kv_and_cache_only_computed_blocks(sim_pool):
    stats = _run_parallel(sim_pool, NUM_TRACES)
    assert stats["violations"] == []
    assert stats["traces"] == NUM_TRACES
    # the traces exercised what they are meant to (not vacuous)
    assert stats["preemptions"] > NUM_TRACES
    assert stats["errors"] > NUM_TRACES // 10
    assert stats["finished"] > 5 * NUM_TRACES
    # speculation: drafts verified in every trace that speculates, some rejected
    assert stats["draft_tokens"] > 2 * NUM_TRACES
    assert 0.2 * stats["draft_tokens"] < stats["accepted"] < 0.9 * stats["draft_tokens"]


def _eager_caching(monkeypatch) -> None:
    """Put back the old behaviour: a block is registered when its slots are allocated,
    before the forward that writes them."""
    from tandem.engine.kv_cache.manager import KVCacheManager

    real = KVCacheManager.allocate_slots

    def eager(self, req, num_new, computed=None, max_free=None, num_external_tokens=0):
        computed = computed or []
        key = self._tail_key(req)
        tail = self._tails.get(key) if key else None
        takes = tail is not None and bool(computed) and computed[-1] is tail.block
        full = computed[:-1] if takes else computed
        base = (req.num_computed_tokens + len(full) * self.block_size
                + (len(tail.token_ids) if takes else 0))
        new = real(self, req, num_new, computed, max_free, num_external_tokens)
        if new is not None:
            saved = req.num_computed_tokens
            req.num_computed_tokens = min(base + num_new, req.num_tokens)
            self.commit_computed(req)
            req.num_computed_tokens = saved
        return new

    monkeypatch.setattr(KVCacheManager, "allocate_slots", eager)


def _count_flagged(seeds: range, window: bool = False) -> int:
    flagged = 0
    logging.disable(logging.CRITICAL)
    try:
        for seed in seeds:
            try:
                run_trace(seed, sim_tokenizer(), window=window)
            except SimViolation:
                flagged += 1
    finally:
        logging.disable(logging.NOTSET)
    return flagged


def test_the_simulation_flags_blocks_cached_when_allocated(monkeypatch):
    """The harness can fail: with the old behaviour its cache check flags most traces."""
    _eager_caching(monkeypatch)
    assert _count_flagged(range(50)) >= 40


def test_the_read_check_alone_flags_what_eager_caching_corrupts(monkeypatch):
    """With the cache and event checks off, the reads themselves go wrong under the old
    behaviour: a failed step's blocks stay cached and later chunks read their garbage."""
    from . import kv_sim

    _eager_caching(monkeypatch)
    monkeypatch.setattr(kv_sim.Sim, "after_schedule", lambda self, out: None)
    monkeypatch.setattr(kv_sim.Sim, "check_cache", lambda self: None)
    monkeypatch.setattr(kv_sim.Sim, "check_events", lambda self: self.kv.pool.take_events()
                        and None)
    assert _count_flagged(range(1000)) >= 5


def test_the_simulation_flags_drafts_committed_without_rollback(monkeypatch):
    """The harness can fail on speculation: counting rejected drafts as computed (no
    rollback of their KV) is flagged in most traces that speculate."""
    from tandem.engine.scheduler import Scheduler

    real = Scheduler.update_after_step

    def no_rollback(self, out, accepted=None):
        real(self, out, {s.request.request_id: s.spec_token_ids for s in out.scheduled})

    monkeypatch.setattr(Scheduler, "update_after_step", no_rollback)
    assert _count_flagged(range(200)) >= 50


def test_sliding_window_traces_free_what_no_query_reads_and_stay_within_the_bound(sim_pool):
    """Every layer slides (window 2..12): chunks read only written KV inside their window,
    the null block is never written, every block is released once, a running request holds
    no block behind its window and at most `max_blocks`, and prompts longer than the pool
    finish with the reference's tokens (chunked prefill, preemption, prefix hits, imports,
    speculation with rollbacks)."""
    stats = _run_parallel(sim_pool, NUM_WINDOW_TRACES, window=True)
    assert stats["violations"] == []
    assert stats["traces"] == NUM_WINDOW_TRACES
    assert stats["window_freed"] > 30 * NUM_WINDOW_TRACES
    assert stats["long_finished"] > NUM_WINDOW_TRACES
    assert stats["preemptions"] > NUM_WINDOW_TRACES
    assert stats["errors"] > NUM_WINDOW_TRACES // 10
    assert 0.2 * stats["draft_tokens"] < stats["accepted"] < 0.9 * stats["draft_tokens"]


def test_the_window_simulation_flags_a_block_freed_one_position_early(monkeypatch):
    """Freeing a block while the oldest query of the next step still reads its last slot
    is caught by the read check."""
    from tandem.engine.kv_cache.manager import KVCacheManager

    def early(self, req, num_computed):
        w = self.sliding_window
        if w is None or req.keep_kv:
            return 0
        return max(0, num_computed - w + 2) // self.block_size

    monkeypatch.setattr(KVCacheManager, "_out_of_window", early)
    assert _count_flagged(range(50), window=True) >= 40


def test_the_window_simulation_flags_blocks_kept_behind_the_window(monkeypatch):
    """Without freeing (today's behaviour) the bound check flags most window traces."""
    from tandem.engine.kv_cache.manager import KVCacheManager

    monkeypatch.setattr(KVCacheManager, "free_out_of_window", lambda self, req: 0)
    assert _count_flagged(range(50), window=True) >= 40
