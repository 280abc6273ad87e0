"""Routing at fleet scale: a bounded candidate set per decision, the chain hashed once per
request (and memoized across requests), the collector kept off the index."""

from __future__ import annotations

import asyncio
import gc
import json
import random

from tandem.protocol.block_hash import hash_block_chain, request_hash_keys
from tandem.router import gcpolicy, stages
from tandem.router import prompt as prompts
from tandem.router.app import RouterServerSettings
from tandem.router.core import (
    FULL_SCAN_UP_TO,
    LEAST_LOADED,
    MAX_HITS,
    SAMPLE,
    Router,
    RouterSettings,
)
from tandem.router.index import PrefixIndex
from tandem.router.routes import RouterApp
from tandem.router.scorers import Filter, register_filter
from tandem.router.workers import Worker, WorkerLoad

N = 200
assert N > FULL_SCAN_UP_TO


@register_filter
class CountingFilter(Filter):
    name = "test_counting"
    calls = 0

    def keep(self, ctx, worker) -> bool:
        CountingFilter.calls += 1
        return True


def fleet(n: int = N, depth: int = 4, events: bool = True,
          filters: tuple[str, ...] = ("model", "role", "health")) -> Router:
    router = Router(RouterSettings(seed=1, filters=filters), lambda m: None)
    for i in range(n):
        router.add_worker(Worker(
            id=f"http://w{i}:8000", model="m", ready=True, events_connected=events,
            block_size=16, load=WorkerLoad(num_running=depth, num_total_blocks=4096,
                                           num_free_blocks=2048, kv_cache_usage=0.5)))
    return router


def prompt(ids: list[int]) -> prompts.ParsedPrompt:
    return prompts.parse("completions", {"model": "m", "prompt": ids}, None)


def test_a_large_fleet_filters_and_scores_a_bounded_candidate_set():
    router = fleet(filters=("model", "role", "health", "test_counting"))
    rng = random.Random(0)
    CountingFilter.calls = 0
    for d in range(50):
        decision, _ = router.route(prompt([rng.randrange(1000) for _ in range(64)]), "m",
                                   100.0 + d * 0.002)
        assert decision is not None and decision.reason == "load"
    # one snapshot of the whole fleet, then at most the bounded set per decision
    assert CountingFilter.calls <= N + 50 * (SAMPLE + LEAST_LOADED + MAX_HITS)


def test_a_prefix_holder_is_never_sampled_away():
    router = fleet()
    rng = random.Random(1)
    shared = [rng.randrange(1000) for _ in range(8 * 16)]
    holder = "http://w137:8000"
    router.index.stored(holder, hash_block_chain(shared, 16, request_hash_keys("m")))
    for d in range(100):
        decision, _ = router.route(prompt(shared + [rng.randrange(1000) for _ in range(64)]),
                                   "m", 100.0 + d * 0.002)
        assert (decision.worker.id, decision.reason, decision.matched_tokens) == \
            (holder, "prefix_hit", 8 * 16)
        router.retract(decision, 100.0 + d * 0.002)


def test_an_approximate_mode_holder_is_found_too():
    router = fleet(events=False)
    ids = list(range(64))
    first, _ = router.route(prompt(ids), "m", 100.0)
    again, _ = router.route(prompt(ids + [7] * 16), "m", 100.001)
    assert again.worker is first.worker and again.matched_tokens == 64


def test_an_idle_worker_in_a_busy_fleet_is_found_at_once():
    router = fleet(depth=5)
    router.workers["http://w77:8000"].load = WorkerLoad(num_total_blocks=4096,
                                                        num_free_blocks=4096)
    decision, _ = router.route(prompt(list(range(40))), "m", 100.0)
    assert decision.worker.id == "http://w77:8000"


def test_a_session_tokens_worker_is_always_a_candidate():
    router = fleet(depth=2)
    rng = random.Random(3)
    for d in range(20):
        decision, _ = router.route(prompt([rng.randrange(1000) for _ in range(48)]), "m",
                                   100.0 + d * 0.002, session="http://w150:8000")
        assert decision.worker.id == "http://w150:8000"
        router.retract(decision, 100.0 + d * 0.002)


def test_cold_load_spreads_evenly_over_a_uniform_fleet():
    router = fleet(depth=0)
    rng = random.Random(2)
    for d in range(2 * N):
        decision, _ = router.route(prompt([rng.randrange(1000) for _ in range(40)]), "m",
                                   100.0 + d * 0.002)
        decision.worker.local_in_flight += 1  # as the proxy counts it
    depths = sorted(w.local_in_flight for w in router.workers.values())
    assert depths[-1] <= 3 and depths[0] >= 1


def test_a_stale_snapshot_falls_back_to_the_whole_fleet_and_exclusions_hold():
    router = fleet()
    router.route(prompt(list(range(40))), "m", 100.0)  # snapshot: every worker ready
    for w in router.workers.values():
        w.ready = False
    late = router.workers["http://w5:8000"]
    late.ready = True
    decision, _ = router.route(prompt(list(range(40))), "m", 100.01)
    assert decision.worker is late
    decision, _ = router.route(prompt(list(range(40))), "m", 100.02, exclude=[late.id])
    assert decision is None


def test_a_retry_reuses_the_first_attempts_hash_chains(monkeypatch):
    ra = RouterApp(fleet(n=3), RouterServerSettings())
    body = asyncio.run(stages.parse_body(
        ra, "completions", json.dumps({"model": "m", "prompt": list(range(64))}).encode(),
        "application/json", None))
    calls = []
    real = prompts.block_hashes
    monkeypatch.setattr(prompts, "block_hashes",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    routing = stages.Routing(ra, "rid", body, 0.0, None, None)
    first = routing.pick(set())
    second = routing.pick({first.worker.id})
    assert second.worker.id != first.worker.id
    assert len(calls) == 1


def test_the_chain_memo_is_exact_and_bounded(monkeypatch):
    memo = prompts.ChainMemo(max_bytes=3 * prompts.SEGMENT_BLOCKS * 16 * 4)
    monkeypatch.setattr(prompts, "MEMO", memo)
    rng = random.Random(3)
    base = [rng.randrange(50000) for _ in range(prompts.SEGMENT_BLOCKS * 16 * 5)]
    for _ in range(60):
        cut = rng.randrange(len(base))
        ids = base[:cut] + [rng.randrange(50000) for _ in range(rng.randrange(0, 900))]
        bs, salt = rng.choice((16, 16, 1, 7)), rng.choice(("", "s"))
        parsed = prompts.ParsedPrompt("m", ids, "", salt, False)
        want = hash_block_chain(ids, bs, request_hash_keys("m", None, salt))
        assert prompts.block_hashes(parsed, "m", bs) == want
        assert prompts.block_hashes(parsed, "m", bs) == want  # from the memo
        assert memo.bytes <= memo.max_bytes
    assert memo.bytes > 0


def _tracked_refs(root: object) -> int:
    """Referents of every collector-tracked container reachable from `root` (its state,
    not its class or modules): what a full collection walks for it."""
    seen, todo, total = {id(root)}, [root], 0
    while todo:
        refs = [r for r in gc.get_referents(todo.pop()) if not isinstance(r, type)]
        total += len(refs)
        for r in refs:
            if gc.is_tracked(r) and id(r) not in seen:
                seen.add(id(r))
                todo.append(r)
    return total


def test_the_index_holds_no_collector_tracked_object_per_block():
    idx = PrefixIndex()
    rng = random.Random(4)
    for w in ("a", "b", "c"):
        for _ in range(20):
            idx.stored(w, [rng.randbytes(32) for _ in range(500)])
    assert idx.num_blocks() == 30_000
    assert _tracked_refs(idx) < 300


def test_settle_freezes_startup_objects():
    try:
        assert gcpolicy.settle() > 1000
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


def test_a_host_tier_holder_is_never_sampled_away():
    from tandem.protocol.kv_events import MEDIUM_HOST

    router = fleet()
    for w in router.workers.values():
        w.load.prefill_s_per_token, w.load.host_load_s_per_block = 1e-3, 1e-3
    rng = random.Random(2)
    shared = [rng.randrange(1000) for _ in range(8 * 16)]
    holder = "http://w101:8000"
    router.index.stored(holder, hash_block_chain(shared, 16, request_hash_keys("m")),
                        MEDIUM_HOST)
    for d in range(50):
        decision, ctx = router.route(prompt(shared + [rng.randrange(1000) for _ in range(64)]),
                                     "m", 100.0 + d * 0.002)
        assert decision.worker.id == holder and tuple(ctx.tier_hits[holder]) == (0, 8, 0)
        router.retract(decision, 100.0 + d * 0.002)
