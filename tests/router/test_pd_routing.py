"""The P/D decision (`pd.plan`) on plain `Router` / `Worker` objects: aggregated or
disaggregated, and which prefill worker."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tandem.router import prompt as prompts
from tandem.router.core import Router, RouterSettings
from tandem.router.pd import PREFILL_HEADER, plan
from tandem.router.workers import Worker

BS = 16
MODEL = "m"


def parsed(n_tokens: int, seed: int = 0, prompt_logits: bool = False
           ) -> prompts.ParsedPrompt:
    ids = [(seed * 7919 + i * 31) % 30000 + 100 for i in range(n_tokens)]
    return prompts.ParsedPrompt(model=MODEL, token_ids=ids, text="", cache_salt="",
                                stream=False, prompt_logits=prompt_logits)


@dataclass
class W:
    """A worker in a case: its role, the prompt's leading blocks it holds, its queue."""

    name: str
    role: str = "prefill"
    held: int = 0
    queue: int = 0
    grpc: bool = True
    ready: bool = True
    model: str = MODEL
    pd_capable: bool = True  # reports a KV-transfer backend in /ready (a Tandem worker)


def build(workers: list[W], prompt: prompts.ParsedPrompt, threshold: int = 16,
          bound: int = 0, local_cap: int = 1024) -> Router:
    router = Router(RouterSettings(seed=0, pd_threshold=threshold,
                                   pd_max_prefill_queue=bound, pd_max_local_prefill=local_cap),
                    lambda model: None)
    chain = prompts.block_hashes(prompt, MODEL, BS)
    for spec in workers:
        w = Worker(id=f"http://{spec.name}:8000", model=spec.model, role=spec.role,
                   grpc_target=f"{spec.name}:9000" if spec.grpc else None, block_size=BS,
                   ready=spec.ready, events_connected=True,
                   kv_transfer_backend="grpc" if spec.pd_capable else None)
        w.load.num_waiting = spec.queue
        router.add_worker(w)
        router.index.stored(w.id, chain[:spec.held])
    return router


@dataclass
class Case:
    name: str
    prompt_tokens: int
    workers: list[W] = field(default_factory=list)  # beside the decode worker "d"
    decode_held: int = 0  # leading prompt blocks the decode worker holds
    prefill: str | None = None  # the expected prefill worker; None: aggregated
    reason: str = ""  # when aggregated: the expected Route.reason
    bound: int = 0  # RouterSettings.pd_max_prefill_queue
    local_cap: int = 1024  # RouterSettings.pd_max_local_prefill
    decode_capable: bool = True  # the decode worker reports a KV-transfer backend
    prompt_logits: bool = False  # echo with logprobs


CASES = [
    Case("no prefill workers: aggregated", 320, reason="no_prefill_worker"),
    Case("uncached below the threshold: aggregated", 15, [W("p1")], reason="below_threshold"),
    Case("uncached at the threshold: disaggregated", 16, [W("p1")], prefill="p1"),
    Case("long, a prefill worker holds the prefix: it wins", 320,
         [W("p1"), W("p2", held=12, queue=1)], prefill="p2"),
    Case("long, no prefix anywhere: the least loaded", 320,
         [W("p1", queue=3), W("p2", queue=0), W("p3", queue=2)], prefill="p2"),
    Case("the decode worker holds all but a few tokens: aggregated", 330, [W("p1")],
         decode_held=20, reason="below_threshold"),
    Case("the decode worker lacks exactly one block: disaggregated", 320, [W("p1")],
         decode_held=19, prefill="p1"),
    Case("a prefill worker with no known gRPC address is skipped", 320,
         [W("p1", grpc=False)], reason="no_prefill_worker"),
    Case("an unready prefill worker is skipped", 320, [W("p1", ready=False), W("p2")],
         prefill="p2"),
    Case("a prefill worker for another model is skipped", 320, [W("p1", model="other")],
         reason="no_prefill_worker"),
    Case("a both worker is no prefill candidate", 320, [W("b1", role="both", queue=9)],
         reason="no_prefill_worker"),
    Case("echo with logprobs (every prompt position's logits): aggregated", 320, [W("p1")],
         prompt_logits=True, reason="prompt_logprobs"),
    Case("a decode worker that cannot fetch pages: aggregated", 320, [W("p1")],
         decode_capable=False, reason="decode_not_capable"),
    Case("no queue bound: a busy prefill worker still takes the prefill", 320,
         [W("p1", queue=50)], prefill="p1"),
    Case("queue bound: a prefill worker at the bound is passed over, prefix or not", 320,
         [W("p1", held=12, queue=2), W("p2", queue=1)], bound=2, prefill="p2"),
    Case("queue bound: every prefill worker at it: aggregated", 320,
         [W("p1", queue=2), W("p2", queue=7)], bound=2, reason="prefill_busy"),
    Case("queue bound, all busy, too long to prefill locally: the best one anyway", 1500,
         [W("p1", queue=4), W("p2", queue=2)], bound=2, local_cap=1024, prefill="p2"),
    Case("queue bound, all busy, at the local cap: aggregated", 1024 + 5 * BS,
         [W("p1", queue=4)], decode_held=5, bound=2, local_cap=1024, reason="prefill_busy"),
    Case("queue bound, all busy, no local cap: aggregated however long", 1500,
         [W("p1", queue=4)], bound=2, local_cap=0, reason="prefill_busy"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_pd_decision(case: Case):
    prompt = parsed(case.prompt_tokens, prompt_logits=case.prompt_logits)
    decode = W("d", role="decode", held=case.decode_held, pd_capable=case.decode_capable)
    router = build([decode, *case.workers], prompt, bound=case.bound, local_cap=case.local_cap)
    route, ctx = plan(router, prompt, MODEL, now=1.0)
    assert route is not None and route.worker.id == "http://d:8000"
    assert route.uncached_tokens == case.prompt_tokens - case.decode_held * BS
    if case.prefill is None:
        assert route.prefill is None and route.headers() == {}
        assert route.reason == case.reason
    else:
        assert route.prefill is not None
        assert route.prefill.worker.id == f"http://{case.prefill}:8000"
        assert route.headers() == {PREFILL_HEADER: f"{case.prefill}:9000"}


def test_the_prefill_pick_is_recorded_as_speculative_blocks_and_sticks():
    prompt = parsed(320)
    router = build([W("d", role="decode"), W("p1"), W("p2")], prompt)
    first, _ = plan(router, prompt, MODEL, now=1.0)
    chosen = first.prefill.worker
    chain = prompts.block_hashes(prompt, MODEL, BS)
    assert router.index.match(chain, 1.5, [chosen.id]) == {chosen.id: len(chain)}
    other = next(w for w in router.workers.values() if w.role == "prefill" and w is not chosen)
    chosen.load.num_waiting = 1  # a little busier: the prefix hit still wins
    again, _ = plan(router, parsed(320 + 40), MODEL, now=1.5)
    assert again.prefill.worker is chosen and again.prefill.reason == "prefix_hit"
    assert other.id not in router.index.match(chain, 1.5, [other.id])


def test_no_prefill_worker_means_no_second_routing_pass():
    prompt = parsed(320)
    router = build([W("d", role="decode")], prompt)
    calls = []
    route_once = router.route
    router.route = lambda *a, **k: (calls.append(k.get("role")), route_once(*a, **k))[1]
    plan(router, prompt, MODEL, now=1.0)
    assert calls == ["decode"]


def test_a_retry_picks_a_new_decode_worker_and_keeps_the_prefill_worker():
    prompt = parsed(320)
    router = build([W("d1", role="decode"), W("d2", role="decode"), W("d3", role="decode"),
                    W("p1"), W("p2")], prompt)
    first, _ = plan(router, prompt, MODEL, now=1.0)
    kept = first.prefill
    kept.worker.load.num_waiting = 7  # now the busier one: kept all the same
    retry, _ = plan(router, prompt, MODEL, now=1.1, exclude={first.worker.id},
                    keep_prefill=kept)
    assert retry.worker is not first.worker and retry.prefill is kept
    kept.worker.ready = False  # gone: a fresh pick (on a decode worker without the blocks)
    third, _ = plan(router, prompt, MODEL, now=1.2, exclude={first.worker.id, retry.worker.id},
                    keep_prefill=kept)
    assert third.prefill is not None and third.prefill.worker is not kept.worker


def test_no_decode_worker_is_no_route():
    prompt = parsed(320)
    router = build([W("p1")], prompt)
    route, _ = plan(router, prompt, MODEL, now=1.0)
    assert route is None


def test_a_both_worker_decodes_disaggregated_requests():
    prompt = parsed(320)
    router = build([W("b", role="both"), W("p1")], prompt)
    route, _ = plan(router, prompt, MODEL, now=1.0)
    assert route.worker.id == "http://b:8000" and route.prefill.worker.id == "http://p1:8000"


@pytest.mark.parametrize(("chars", "threshold", "disaggregated"), [
    (2000, 16, True),  # ~500 tokens
    (40, 16, False),  # ~10 tokens
    (40, 10, True),
])
def test_approximate_mode_estimates_tokens_from_text(chars, threshold, disaggregated):
    prompt = prompts.ParsedPrompt(model=MODEL, token_ids=None, text="x" * chars,
                                  cache_salt="", stream=False)
    router = build([W("d", role="decode"), W("p1")], parsed(1), threshold=threshold)
    for w in router.workers.values():
        w.events_connected = False
    route, _ = plan(router, prompt, MODEL, now=1.0)
    assert (route.prefill is not None) is disaggregated


def test_a_decode_worker_that_cannot_fetch_pages_serves_aggregated():
    """A stock server (no KV-transfer backend in its /ready) would ignore the prefill header
    and prefill itself: the router does not pretend to disaggregate for it."""
    prompt = parsed(320)
    router = build([W("d", role="decode", pd_capable=False), W("p1")], prompt)
    route, _ = plan(router, prompt, MODEL, now=1.0)
    assert route is not None and route.worker.id == "http://d:8000"
    assert route.prefill is None and route.headers() == {}
