"""ChurnTracker (decayed uncached tokens per worker) and its effect through `Router.route`:
distinct cold prefix groups spread evenly over equally loaded workers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem.router import prompt as prompts
from tandem.router.churn import ChurnTracker
from tandem.router.core import Router, RouterSettings
from tandem.router.policy import DEFAULT_WEIGHTS
from tandem.router.workers import Worker, WorkerLoad

# (worker, tokens, now) additions, then (worker, now) -> expected value; half-life 30 s.
# Powers of two, so the decay is exact in floating point.
CASES = [
    ("fresh", [("a", 100, 0.0)], ("a", 0.0), 100.0),
    ("one half-life", [("a", 100, 0.0)], ("a", 30.0), 50.0),
    ("two half-lives", [("a", 100, 0.0)], ("a", 60.0), 25.0),
    ("three, from a later start", [("a", 100, 10.0)], ("a", 100.0), 12.5),
    ("adds decay the old part first", [("a", 100, 0.0), ("a", 100, 30.0)], ("a", 30.0), 150.0),
    ("... and then decay together", [("a", 100, 0.0), ("a", 100, 30.0)], ("a", 60.0), 75.0),
    ("a query before the last add neither decays nor grows", [("a", 64, 30.0)], ("a", 0.0),
     64.0),
    ("a late add counts in full, no decay", [("a", 64, 30.0), ("a", 32, 0.0)], ("a", 30.0),
     96.0),
    ("negative tokens count as none", [("a", 64, 0.0), ("a", -500, 0.0)], ("a", 0.0), 64.0),
    ("an unknown worker has none", [("a", 64, 0.0)], ("b", 0.0), 0.0),
    ("workers are separate", [("a", 64, 0.0), ("b", 16, 0.0)], ("b", 30.0), 8.0),
]


@pytest.mark.parametrize(("adds", "query", "want"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_tracker_decays_by_half_life(adds, query, want):
    t = ChurnTracker(half_life_s=30.0)
    for worker, tokens, now in adds:
        t.add(worker, tokens, now)
    assert t.value(*query) == want


def test_tracker_drop_forgets_one_worker():
    t = ChurnTracker(half_life_s=30.0)
    t.add("a", 100, 0.0)
    t.add("b", 100, 0.0)
    t.drop("a")
    t.drop("never-seen")  # a no-op
    assert t.value("a", 0.0) == 0.0 and t.value("b", 0.0) == 100.0
    assert t.workers() == ["b"]


@pytest.mark.parametrize("half_life", [0.0, -1.0, float("nan")])
def test_tracker_rejects_a_non_positive_half_life(half_life):
    with pytest.raises(ValueError, match="half-life"):
        ChurnTracker(half_life)


# -- through Router.route --------------------------------------------------------------------
BS = 16
PREFIX = 512  # tokens per group's system prompt, as in the shared-prefix benchmark
CAPACITY_BLOCKS = 4 * PREFIX // BS  # each worker's KV cache holds ~4 groups' prefixes


def group_prompt(group: int) -> prompts.ParsedPrompt:
    """A distinct 512-token prompt per group (differs from the first block on)."""
    ids = [100 + group * 1000 + i for i in range(PREFIX)]
    return prompts.ParsedPrompt(model="m", token_ids=ids, text="", cache_salt="", stream=False)


def idle_router(seed: int, n_workers: int = 4, events: bool = True,
                **settings: object) -> Router:
    """`events` False: workers that publish no KV events (the approximate index)."""
    router = Router(RouterSettings(seed=seed, **settings), lambda model: None)
    for i in range(n_workers):
        router.add_worker(Worker(id=f"http://w{i}:8000", model="m", ready=True, block_size=BS,
                                 events_connected=events,
                                 load=WorkerLoad(num_total_blocks=CAPACITY_BLOCKS)))
    return router


def spread(router: Router, seed: int) -> Counter[str]:
    """Route 8 distinct cold groups one after another (Poisson arrivals, 1 req/s); nothing
    is ever confirmed in the index, so every request is cold. Winners -> groups routed."""
    arrivals = random.Random(seed)
    now, winners = 0.0, Counter()
    for group in range(8):
        now += arrivals.expovariate(1.0)
        decision, ctx = router.route(group_prompt(group), "m", now)
        assert decision is not None and decision.reason == "load"
        assert decision.matched_tokens == 0 and ctx.prompt_tokens == PREFIX
        winners[decision.worker.id] += 1
    return winners


@pytest.mark.parametrize("seed", range(12))
def test_cold_groups_spread_two_per_worker(seed):
    """The property the shared-prefix benchmark needs: 8 cold groups on 4 idle, equally
    loaded workers land 2 per worker, whatever the tie-breaking seed and arrival times."""
    assert sorted(spread(idle_router(seed), seed).values()) == [2, 2, 2, 2]


def test_without_churn_cold_groups_land_by_coin_flip():
    """The contrast: with the load scorers alone, some seed piles 3+ groups on one worker."""
    load_only = {k: v for k, v in DEFAULT_WEIGHTS.items() if k != "cache_churn"}
    assert any(max(spread(idle_router(seed, weights=load_only), seed).values()) > 2
               for seed in range(12))


def test_route_charges_uncached_tokens_and_remove_worker_drops_them():
    router = idle_router(0, n_workers=1, churn_half_life_s=10.0)
    decision, _ = router.route(group_prompt(0), "m", now=0.0)
    assert decision is not None
    wid = decision.worker.id
    assert router.churn.value(wid, 0.0) == PREFIX
    # the same group again within the speculative TTL: all 32 blocks match, nothing new
    decision, ctx = router.route(group_prompt(0), "m", now=1.0)
    assert decision is not None and decision.matched_tokens == PREFIX
    assert ctx.churn_tokens == {wid: pytest.approx(PREFIX * 0.5 ** 0.1)}
    assert router.churn.value(wid, 10.0) == pytest.approx(PREFIX / 2)
    router.remove_worker(wid)
    assert router.churn.value(wid, 10.0) == 0.0


def test_refund_takes_back_a_charge_and_never_goes_negative():
    t = ChurnTracker(half_life_s=30.0)
    t.add("a", 100, 0.0)
    t.refund("a", 60, 0.0)
    assert t.value("a", 0.0) == 40.0
    t.refund("a", 500, 0.0)
    assert t.value("a", 0.0) == 0.0
    t.refund("never-seen", 10, 0.0)  # a no-op
    assert t.workers() == ["a"]


def test_retract_undoes_what_route_recorded_for_a_failed_attempt():
    router = idle_router(0, n_workers=2, churn_half_life_s=10.0)
    first, _ = router.route(group_prompt(0), "m", now=0.0)
    assert first is not None and first.charged_tokens == PREFIX
    wid = first.worker.id
    # the attempt failed before any byte: the retry goes elsewhere, and the worker is
    # charged nothing and holds nothing for this prompt
    router.retract(first, now=0.001)
    assert router.churn.value(wid, 0.001) == 0.0
    again, ctx = router.route(group_prompt(0), "m", now=0.002, exclude=[wid])
    assert again is not None and again.worker.id != wid
    assert router.index.match(ctx.chain(again.worker), 0.003).get(wid) is None
    router.retract(first, now=0.004)  # twice is harmless
    assert router.churn.value(again.worker.id, 0.002) == PREFIX


def test_retract_leaves_speculative_blocks_a_later_routing_refreshed():
    router = idle_router(0, n_workers=1)
    first, ctx = router.route(group_prompt(0), "m", now=0.0)
    second, _ = router.route(group_prompt(0), "m", now=0.5)  # same worker, same prefix
    assert first is not None and second is not None
    router.retract(first, now=0.6)
    chain = ctx.chain(first.worker)
    assert router.index.match(chain, 0.7)[first.worker.id] == len(chain)


def test_retract_takes_back_an_approximate_routing_unless_a_later_one_refreshed_it():
    """Workers without KV events: the router's own LRU of what it sent is the index. A
    failed attempt's blocks leave it; blocks an earlier success put there, or a later
    routing refreshed, stay."""
    router = idle_router(0, n_workers=1, events=False)
    wid = "http://w0:8000"
    first, ctx = router.route(group_prompt(0), "m", now=0.0)
    chain = ctx.hashes[(BS, "")]
    assert router.approx.match(chain, [wid]) == {wid: len(chain)}
    router.retract(first, now=0.1)
    assert router.approx.match(chain, [wid]) == {}
    ok, _ = router.route(group_prompt(0), "m", now=0.2)  # succeeds: stays
    failed, _ = router.route(group_prompt(0), "m", now=0.3)  # adds nothing new
    router.retract(failed, now=0.4)
    assert router.approx.match(chain, [wid]) == {wid: len(chain)}
    a, _ = router.route(group_prompt(1), "m", now=0.5)
    b, ctx1 = router.route(group_prompt(1), "m", now=0.6)  # refreshes a's blocks
    router.retract(a, now=0.7)
    assert router.approx.match(ctx1.hashes[(BS, "")], [wid]) == {wid: len(ctx1.hashes[(BS, "")])}
    assert ok is not None and b is not None
