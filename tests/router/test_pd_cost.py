"""The cost-based P/D decision (`pd_cost`, `pd.plan` with `pd_decision="cost"`) on plain
`Router` / `Worker` objects with stated loads: each rule fires where it should, the ledger
of prompts sent to prefill workers, a seeded randomized check of the margins, and the
reasons in the router's metric."""

from __future__ import annotations

import math
import random

import pytest

from tandem.router import prompt as prompts
from tandem.router.pd import plan
from tandem.router.pd_cost import (
    LEDGER_TTL_S,
    PRIOR_BLOCK_S,
    STALL_WINDOW_S,
    TRANSFER_BYTES_PER_S,
    PrefillLedger,
    StallLedger,
    ahead_tokens,
    estimate,
    stalled_steps,
)
from tandem.router.workers import Worker, WorkerLoad
from tests.router.test_pd_app import LONG, cluster, counter, post  # noqa: F401 - fixture
from tests.router.test_pd_routing import BS, MODEL, W, build, parsed

R = 2e-3  # seconds per prefill token (the bundled model on one CPU core: ~2.7e-3)
STEP = 0.05  # a decode step, s


def loaded(router, name: str, **load) -> Worker:
    w = router.workers[f"http://{name}:8000"]
    w.load = WorkerLoad(**load)
    return w


def setup(prompt_tokens: int = 64, *, p: dict | None = None, d: dict | None = None,
          cap: int | None = None, **settings):
    """A decode worker "d" and a prefill worker "p1" with loads `d` / `p` (WorkerLoad fields),
    p1's chunk cap `cap`; `settings`: RouterSettings fields."""
    prompt = parsed(prompt_tokens)
    router = build([W("d", role="decode"), W("p1")], prompt, threshold=16)
    router.settings.pd_decision = "cost"
    for k, v in settings.items():
        setattr(router.settings, k, v)
    loaded(router, "d", **(d if d is not None else {"prefill_s_per_token": R,
                                                     "decode_step_s": STEP}))
    pw = loaded(router, "p1", **(p if p is not None else {"prefill_s_per_token": R}))
    pw.prefill_chunk_cap, pw.max_batched_tokens = cap, 2048 if cap is not None else None
    return router, prompt


def test_an_idle_prefill_worker_wins_over_a_decode_worker_with_streams():
    router, prompt = setup(d={"prefill_s_per_token": R, "decode_step_s": STEP,
                              "num_running": 4})
    route, _ = plan(router, prompt, MODEL, now=1.0)
    est = route.estimate
    assert route.prefill is not None and est.disaggregate and est.reason == ""
    blocks = math.ceil(64 / BS)
    assert est.remote_s == pytest.approx(64 * R + blocks * PRIOR_BLOCK_S + STEP)
    assert est.local_s == pytest.approx(64 * R + STEP)
    assert est.itl_cost_s == pytest.approx(4 * 64 * R)  # 4 streams stalled for the prefill


def test_a_prefill_backlog_keeps_a_short_prompt_local_and_retracts_the_pick():
    router, prompt = setup(p={"prefill_s_per_token": R, "pending_prefill_tokens": 1536,
                              "num_running": 1},
                           d={"prefill_s_per_token": R, "decode_step_s": STEP,
                              "num_running": 2})
    route, _ = plan(router, prompt, MODEL, now=1.0)
    est = route.estimate
    assert route.prefill is None and route.reason == "prefill_backlog"
    assert est.backlog_s == pytest.approx(1536 * R)  # no chunk cap known: the whole queue
    assert est.local_s + est.itl_cost_s == pytest.approx(64 * R + STEP + 2 * 64 * R)
    # the prefill pick's speculative blocks are taken back: later prompts do not count on them
    chain = prompts.block_hashes(prompt, MODEL, BS)
    assert router.index.match(chain, 1.5, ["http://p1:8000"]) == {}


def test_a_chunk_cap_bounds_the_wait_behind_a_long_prompt():
    """With a 256-token per-request cap a 64-token prompt waits for one capped chunk of the
    one request ahead, not its 1,536 tokens: the idle-ish prefill worker wins again."""
    kw = {"p": {"prefill_s_per_token": R, "pending_prefill_tokens": 1536, "num_running": 1},
          "d": {"prefill_s_per_token": R, "decode_step_s": STEP, "num_running": 5}}
    route, _ = plan(*setup(cap=256, **kw), MODEL, now=1.0)
    assert route.estimate.backlog_s == pytest.approx(256 * R)
    assert route.prefill is not None
    route, _ = plan(*setup(cap=None, **kw), MODEL, now=1.0)
    assert route.prefill is None and route.reason == "prefill_backlog"


def test_a_slow_prefill_worker_loses_even_idle():
    router, prompt = setup(p={"prefill_s_per_token": 20 * R})
    route, _ = plan(router, prompt, MODEL, now=1.0)
    assert route.prefill is None and route.reason == "local_faster"


def test_the_itl_weight_trades_ttft_for_the_streams():
    kw = {"p": {"prefill_s_per_token": R, "pending_prefill_tokens": 600},
          "d": {"prefill_s_per_token": R, "decode_step_s": STEP, "num_running": 12}}
    assert plan(*setup(**kw), MODEL, now=1.0)[0].prefill is not None  # 12 streams spared
    # TTFT alone: at equal rates the transfer makes local faster even with an idle prefill
    # worker
    route, _ = plan(*setup(pd_itl_weight=0.0, **kw), MODEL, now=1.0)
    assert route.prefill is None and route.reason == "local_faster"


def test_rules_that_keep_the_prefill_worker():
    backlog = {"prefill_s_per_token": R, "pending_prefill_tokens": 100_000}
    # too long to prefill where it decodes (pd_max_local_prefill): queued all the same
    route, _ = plan(*setup(1100, p=backlog), MODEL, now=1.0)
    assert route.prefill is not None and route.estimate.disaggregate
    # the threshold rule ignores backlogs
    route, _ = plan(*setup(p=backlog, pd_decision="threshold"), MODEL, now=1.0)
    assert route.prefill is not None and route.estimate is None
    # an unmeasured prefill worker: the threshold rule
    route, _ = plan(*setup(p={"pending_prefill_tokens": 100_000}), MODEL, now=1.0)
    assert route.prefill is not None and route.estimate is None
    # below the threshold: local before any estimate
    route, _ = plan(*setup(15, p=backlog), MODEL, now=1.0)
    assert route.reason == "below_threshold" and route.estimate is None


def test_an_unmeasured_decode_worker_is_costed_at_the_prefill_workers_rate():
    router, prompt = setup(p={"prefill_s_per_token": R, "pending_prefill_tokens": 1536},
                           d={"num_running": 1})
    route, _ = plan(router, prompt, MODEL, now=1.0)
    assert route.estimate.local_s == pytest.approx(64 * R)
    assert route.reason == "prefill_backlog"


def test_the_transfer_cost_measured_then_from_block_bytes():
    d = Worker(id="d", block_size=BS, load=WorkerLoad(prefill_s_per_token=R))
    p = Worker(id="p", load=WorkerLoad(prefill_s_per_token=R))
    est = estimate(d, p, 160, 160, (0, 0), 1.0)
    assert est.remote_s == pytest.approx(160 * R + 10 * PRIOR_BLOCK_S)
    d.load.kv_block_bytes = 737_280  # the bundled model's block, float32
    est = estimate(d, p, 160, 160, (0, 0), 1.0)
    assert est.remote_s == pytest.approx(160 * R + 10 * 737_280 / TRANSFER_BYTES_PER_S)
    d.load.peer_pull_s_per_block = 0.05  # measured: wins over the prior
    est = estimate(d, p, 160, 160, (0, 0), 1.0)
    assert est.remote_s == pytest.approx(160 * R + 10 * 0.05)
    assert not est.disaggregate and est.reason == "local_faster"


@pytest.mark.parametrize(("backlog", "others", "own", "cap", "budget", "ahead"), [
    (1536, 1, 64, None, None, 1536),  # no cap known: first come, first served
    (1536, 1, 64, 0, 2048, 1536),  # cap off
    (1536, 1, 64, 256, 2048, 256),  # one capped chunk of the one ahead
    (1536, 3, 64, 256, 2048, 768),
    (1536, 1, 600, 256, 2048, 768),  # 3 steps of its own, 256 of the other's each
    (1536, 10, 64, 256, 512, 448),  # the step budget less its own chunk
    (100, 3, 64, 256, 2048, 100),  # never more than the backlog
    (0, 0, 64, 256, 2048, 0),
])
def test_ahead_tokens(backlog, others, own, cap, budget, ahead):
    assert ahead_tokens(backlog, others, own, cap, budget) == ahead


def test_prompts_sent_count_as_backlog_until_the_next_load_report():
    router, prompt = setup(320, d={"prefill_s_per_token": R, "decode_step_s": STEP,
                                   "num_running": 1})
    p1 = router.workers["http://p1:8000"]
    first, _ = plan(router, prompt, MODEL, now=1.0)
    assert first.prefill is not None and first.estimate.backlog_s == 0.0
    assert router.pd_ledger.unseen(p1, 1.0) == (320, 1)
    second, _ = plan(router, parsed(320, seed=1), MODEL, now=1.1)  # behind the first
    assert second.estimate.backlog_s == pytest.approx(320 * R)
    p1.load = WorkerLoad(prefill_s_per_token=R, pending_prefill_tokens=640)  # a new report
    assert router.pd_ledger.unseen(p1, 1.2) == (0, 0)
    assert router.pd_ledger.unseen(p1, 1.2) == (0, 0)
    ledger = PrefillLedger()
    ledger.record(p1, 50, 0.0)
    assert ledger.unseen(p1, LEDGER_TTL_S) == (50, 1)
    assert ledger.unseen(p1, LEDGER_TTL_S + 0.01) == (0, 0)  # never reported: forgotten


def test_randomized_margins_and_monotonicity():
    """Over thousands of random loads: the chosen option's estimated TTFT is never worse than
    the other's by more than the rule's margin (disaggregated: the local prefill's weighted
    stall of the running streams; local: none, it is strictly faster), and more backlog on
    the prefill worker never turns a local verdict into a disaggregated one, more streams on
    the decode worker never the other way."""
    rng = random.Random(42)
    for _ in range(3000):
        r_p, r_d = rng.uniform(1e-5, 5e-3), rng.uniform(1e-5, 5e-3)
        cap = rng.choice([None, 0, 256, 512])
        p = Worker(id="p", prefill_chunk_cap=cap, max_batched_tokens=rng.choice([None, 2048]),
                   load=WorkerLoad(prefill_s_per_token=r_p,
                                   pending_prefill_tokens=rng.choice([0, rng.randrange(8192)]),
                                   num_running=rng.randrange(4), num_waiting=rng.randrange(4)))
        d = Worker(id="d", block_size=rng.choice([16, 32]), local_in_flight=rng.randrange(6),
                   load=WorkerLoad(prefill_s_per_token=rng.choice([0.0, r_d]),
                                   decode_step_s=rng.uniform(0.0, 0.1),
                                   num_running=rng.randrange(16),
                                   pending_prefill_tokens=rng.choice([0, rng.randrange(2048)]),
                                   kv_block_bytes=rng.choice([0, 1 << 20])))
        u_d = rng.randrange(16, 4096)
        u_p = rng.randrange(0, u_d + 1)
        unseen = (rng.randrange(4096), rng.randrange(4)) if rng.random() < 0.3 else (0, 0)
        weight = rng.choice([0.0, 0.5, 1.0, 2.0])
        max_local = rng.choice([0, 1024])
        est = estimate(d, p, u_d, u_p, unseen, weight, max_local)
        forced = 0 < max_local < u_d
        if est.disaggregate:
            assert forced or est.remote_s <= est.local_s + est.itl_cost_s + 1e-12
        else:
            assert not forced and est.local_s < est.remote_s
            assert est.local_s + est.itl_cost_s < est.remote_s
            assert est.reason == ("prefill_backlog"
                                  if est.remote_s - est.backlog_s <= est.local_s + est.itl_cost_s
                                  else "local_faster")
        more = (unseen[0] + rng.randrange(1, 4096), unseen[1] + 1)
        if not est.disaggregate:
            assert not estimate(d, p, u_d, u_p, more, weight, max_local).disaggregate
        if est.disaggregate:
            d.load.num_running += rng.randrange(1, 8)
            assert estimate(d, p, u_d, u_p, unseen, weight, max_local).disaggregate


@pytest.mark.parametrize("cluster", [{"pd_threshold": 16, "pd_decision": "cost"}],
                         indirect=True)
def test_the_cost_reasons_reach_the_metric(cluster):  # noqa: F811 - the fixture
    router, seen, targets = cluster
    core = router.core
    for w in core.workers.values():
        if w.role == "prefill":  # measured and deep in backlog: short prompts stay local
            w.load = WorkerLoad(prefill_s_per_token=R, pending_prefill_tokens=50_000)
        else:  # two streams to stall
            w.load = WorkerLoad(prefill_s_per_token=R, decode_step_s=STEP, num_running=2)
    seen.clear()
    assert post(router, f"a {LONG}").status_code == 200
    assert all(h is None for _, h in seen)
    assert counter(router.url, "tandem_router_aggregated_requests_total",
                   'reason="prefill_backlog"') == 1
    for w in core.workers.values():
        if w.role == "prefill":  # now slow but idle: local is faster still
            w.load = WorkerLoad(prefill_s_per_token=50 * R)
    assert post(router, f"b {LONG}").status_code == 200
    assert counter(router.url, "tandem_router_aggregated_requests_total",
                   'reason="local_faster"') == 1
    for w in core.workers.values():
        if w.role == "prefill":
            w.load = WorkerLoad(prefill_s_per_token=R)
        else:  # many streams to spare: the prefill worker
            w.load = WorkerLoad(prefill_s_per_token=R, decode_step_s=STEP, num_running=8)
    seen.clear()
    assert post(router, f"c {LONG}").status_code == 200
    assert {h for _, h in seen} <= {targets["p1"], targets["p2"]} and seen[-1][1] is not None
    assert counter(router.url, "tandem_router_disaggregated_requests_total") == 1
    # the backlog again, but the decode worker's stall budget is spent: sent away, counted
    core.settings.pd_stall_budget = 1e-6
    for w in core.workers.values():
        w.load = (WorkerLoad(prefill_s_per_token=R, pending_prefill_tokens=50_000)
                  if w.role == "prefill" else
                  WorkerLoad(prefill_s_per_token=R, decode_step_s=STEP, num_running=2))
    seen.clear()
    assert post(router, f"d {LONG}").status_code == 200
    assert seen[-1][1] is not None
    assert counter(router.url, "tandem_router_disaggregated_requests_total") == 2
    assert counter(router.url, "tandem_router_pd_stall_budget_overrules_total") == 1


BACKLOGGED = {"p": {"prefill_s_per_token": R, "pending_prefill_tokens": 1536, "num_running": 1},
              "d": {"prefill_s_per_token": R, "decode_step_s": STEP, "num_running": 2}}


def test_the_stall_budget_overrules_local_prefills_once_spent():
    """Budget 1 % of the steps over the 30 s window at a 50 ms step: 6 stalled steps. Each
    64-token local prefill stalls one step; the seventh goes to the prefill worker."""
    router, _ = setup(pd_stall_budget=0.01, **BACKLOGGED)
    verdicts = []
    for i in range(8):  # a new prompt each time: none is cached anywhere
        route, _ = plan(router, parsed(64, seed=i + 1), MODEL, now=1.0 + i * 0.01)
        verdicts.append(route.prefill is None)
        if route.prefill is None:
            assert route.reason == "prefill_backlog" and route.estimate.stalled_steps == 1
        else:
            assert route.estimate.over_budget and route.estimate.disaggregate
    assert verdicts == [True] * 6 + [False] * 2
    assert router.pd_stalls.share(router.workers["http://d:8000"], 2.0) == \
        pytest.approx(6 * STEP / STALL_WINDOW_S)
    # the window slides: 30 s on, the budget is whole again
    route, _ = plan(router, parsed(64, seed=99), MODEL, now=1.1 + STALL_WINDOW_S)
    assert route.prefill is None


def fresh(n: int, tokens: int = 64) -> list:
    return [parsed(tokens, seed=1000 + i) for i in range(n)]


def test_no_budget_an_idle_decode_worker_or_an_unmeasured_step_keeps_local():
    router, _ = setup(pd_stall_budget=0.0, **BACKLOGGED)  # no budget
    assert all(plan(router, p, MODEL, now=1.0)[0].prefill is None for p in fresh(20))
    idle = {"p": BACKLOGGED["p"], "d": {"prefill_s_per_token": R, "decode_step_s": STEP}}
    router, _ = setup(pd_stall_budget=0.001, **idle)  # no stream to stall
    assert all(plan(router, p, MODEL, now=1.0)[0].prefill is None for p in fresh(20))
    unmeasured = {"p": BACKLOGGED["p"], "d": {"prefill_s_per_token": R, "num_running": 3}}
    router, _ = setup(pd_stall_budget=0.001, **unmeasured)
    assert all(plan(router, p, MODEL, now=1.0)[0].prefill is None for p in fresh(20))


def test_stalled_steps_follow_the_decode_workers_chunk():
    w = Worker(id="d", block_size=BS)
    assert [stalled_steps(w, n) for n in (0, 1, 64, 5000)] == [0, 1, 1, 1]
    w.max_batched_tokens = 2048
    assert stalled_steps(w, 5000) == 3
    w.prefill_chunk_cap = 32
    assert [stalled_steps(w, n) for n in (32, 33, 64, 65)] == [1, 2, 2, 3]


def test_the_stall_budget_bounds_the_stalled_share_on_random_traces():
    """Seeded traces of local verdicts at random times, step times and prompt sizes: the
    share of a decode worker's steps that recorded local prefills stall, over any window,
    never exceeds the budget (plus nothing: a verdict past it is overruled)."""
    rng = random.Random(7)
    seen = {"local": 0, "over_budget": 0}
    for _ in range(300):
        budget = rng.choice([0.005, 0.01, 0.05, 0.2])
        step = rng.uniform(0.01, 0.2)
        tokens = rng.randint(17, 300)
        router, _ = setup(tokens, pd_stall_budget=budget,
                               p={"prefill_s_per_token": R,
                                  "pending_prefill_tokens": 100_000},
                               d={"prefill_s_per_token": R, "decode_step_s": step,
                                  "num_running": rng.randint(1, 40)},
                               pd_max_local_prefill=0)
        decode = router.workers["http://d:8000"]
        decode.prefill_chunk_cap = rng.choice([None, 16, 64])
        decode.max_batched_tokens = rng.choice([None, 256])
        now, local = 1.0, []
        for prompt in fresh(rng.randint(1, 60), tokens):
            now += rng.expovariate(2.0)
            route, _ = plan(router, prompt, MODEL, now=now)
            if route.prefill is None:
                local.append((now, route.estimate.stalled_steps))
                seen["local"] += 1
            else:
                assert route.estimate.over_budget
                seen["over_budget"] += 1
            held = sum(n for t, n in local if now - t <= STALL_WINDOW_S)
            assert held * step / STALL_WINDOW_S <= budget + 1e-12
        assert StallLedger().share(decode, now) == 0.0
    assert min(seen.values()) > 500, seen  # both verdicts, many times
