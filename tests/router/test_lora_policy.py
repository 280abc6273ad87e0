"""LoRA in the router's core, on plain values: which workers serve a name, how a request
for an adapter is hashed (as the engine keys it), the affinity scorer, and the cache-aware
policy keeping an adapter's requests on its replica until load says otherwise."""

from __future__ import annotations

import random

import pytest

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.protocol.block_hash import hash_block_chain, request_hash_keys
from tandem.router import prompt as prompts
from tandem.router.core import Router, RouterSettings
from tandem.router.scorers import SCORERS, RoutingContext
from tandem.router.workers import LoRAReport, Worker, WorkerLoad

DIGESTS = {"sql": "5a" * 32, "code": "c0" * 32}  # what the workers report (by weights)


def lora_worker(wid: str, adapters=(), running=(), waiting=(), resident=(), slots=2,
                queue=0, model="base", digests=DIGESTS) -> Worker:
    w = Worker(id=wid, model=model, ready=True, block_size=4,
               load=WorkerLoad(num_running=queue, running_loras=frozenset(running),
                               waiting_loras=frozenset(waiting),
                               resident_loras=frozenset(resident), max_loras=slots))
    assert w.apply_lora_report(LoRAReport({a: digests.get(a, "") for a in adapters}, slots,
                                          "engine-1", 1))
    return w


def router(*workers: Worker) -> Router:
    r = Router(RouterSettings(seed=0), lambda model: None)
    for w in workers:
        r.add_worker(w)
    return r


def test_names_resolve_to_base_and_adapter():
    r = router(lora_worker("a", ["sql", "code"]), lora_worker("b", ["sql"]),
               lora_worker("c", model="other"))
    assert r.models() == ["base", "code", "other", "sql"]
    assert r.base_model("sql") == ("base", "sql")
    assert r.base_model("base") == ("base", None)
    assert r.base_model("nope") == ("nope", None)
    parsed = prompts.ParsedPrompt("code", list(range(40)), "", "", False)
    decision, ctx = r.route(parsed, "code", 0.0)
    assert decision.worker.id == "a" and ctx.lora == "code"
    decision, _ = r.route(parsed, "sql", 0.0, exclude={"a"})
    assert decision.worker.id == "b"
    assert r.route(parsed, "code", 0.0, exclude={"a"})[0] is None  # nobody else holds it


@pytest.mark.parametrize("seed", range(3))
def test_router_hashes_adapter_prompts_exactly_as_the_engine(seed):
    """For random prompts, adapters and salts the router's chain equals the engine's block
    hashes of the same request; the base model's and another adapter's differ."""
    rng = random.Random(seed)
    r = router(lora_worker("a", ["sql", "code"]))
    for _ in range(200):
        ids = [rng.randrange(100) for _ in range(rng.randint(4, 40))]
        salt = rng.choice(["", "s1", "tenant=t;ns=ab"])
        lora = rng.choice(["sql", "code"])
        parsed = prompts.ParsedPrompt(lora, ids, "", salt, False)
        chain = r.hashes(parsed, lora)[(4, DIGESTS[lora])]
        req = Request("r", ids, SamplingParams(max_tokens=1), 1,
                      hash_keys=request_hash_keys("base", DIGESTS[lora], salt), lora_name=lora)
        assert chain == req.update_block_hashes(4)[: len(ids) // 4]
        other = DIGESTS["code" if lora == "sql" else "sql"]
        for theirs_keys in (None, other, lora):  # the base model, other weights, the name
            theirs = hash_block_chain(ids, 4, request_hash_keys("base", theirs_keys, salt))
            assert not chain or not set(chain) & set(theirs)


def test_each_worker_is_matched_with_the_weights_it_holds():
    """`sql` was replaced on worker b only (other weights, same name): b's index still holds
    the old weights' blocks, but the router hashes b's candidates with b's digest, so they
    do not count as cached there; a, holding the old weights, matches them."""
    old, new = DIGESTS["sql"], "99" * 32
    a = lora_worker("a", ["sql"])
    b = lora_worker("b", ["sql"], digests={"sql": new})
    r = router(a, b)
    for w in (a, b):
        w.events_connected = True
    ids = list(range(40))
    parsed = prompts.ParsedPrompt("sql", ids, "", "", False)
    stale = hash_block_chain(ids, 4, request_hash_keys("base", old, ""))
    r.index.stored("a", stale)
    r.index.stored("b", stale)  # b computed these before the replacement
    assert set(r.hashes(parsed, "sql")) == {(4, old), (4, new)}
    ctx = r.context(parsed, "sql", 0.0, [a, b])
    assert ctx.matched_tokens == {"a": 40}
    assert ctx.chain(a) == stale and ctx.chain(b) == hash_block_chain(
        ids, 4, request_hash_keys("base", new, ""))
    decision, _ = r.route(parsed, "sql", 0.0)
    assert decision.worker is a and decision.matched_tokens == 40


def test_adapter_reports_never_go_back_to_an_older_set():
    """A report older than the set held (a probe answered before a load, delivered after
    the load's own answer) is dropped; equal or newer ones apply; a restarted engine
    (new instance) starts over, and its predecessor's late reports are dropped too."""
    w = Worker(id="w")
    assert w.apply_lora_report(LoRAReport({}, 2, "e1", 3))
    assert w.apply_lora_report(LoRAReport({"x": "aa"}, 2, "e1", 4))  # the load's answer
    assert not w.apply_lora_report(LoRAReport({}, 2, "e1", 3))  # the stale probe
    assert not w.apply_lora_report(LoRAReport({}, 2))  # unversioned: older worker code path
    assert w.lora_adapters == {"x"} and w.serves("x") and w.lora_version == ("e1", 4)
    assert w.apply_lora_report(LoRAReport({"x": "aa"}, 2, "e1", 4))  # the same again
    assert w.apply_lora_report(LoRAReport({}, 2, "e2", 1))  # restarted: empty
    assert not w.apply_lora_report(LoRAReport({"x": "aa"}, 2, "e1", 9))  # the old engine
    assert w.lora_adapters == frozenset() and w.lora_version == ("e2", 1)


@pytest.mark.parametrize(("w", "want"), [
    (lora_worker("a", ["x"], running=["x"], slots=1), 1.0),
    (lora_worker("a", ["x"], waiting=["x"], running=["y"], slots=1), 1.0),
    (lora_worker("a", ["x"], resident=["x"], slots=1), 0.8),
    (lora_worker("a", ["x"], running=["y"], slots=2), 0.5),  # a free slot
    (lora_worker("a", ["x"], slots=0), 0.5),  # not reported yet
    (lora_worker("a", ["x"], running=["y"], slots=1), 0.0),  # its only slot is busy
])
def test_affinity_scorer(w, want):
    scorer = SCORERS["lora_affinity"]()
    assert scorer.score(RoutingContext("x", 10, lora="x"), [w]) == [want]
    assert scorer.score(RoutingContext("base", 10), [w]) == [1.0]


def test_policy_keeps_an_adapter_on_its_replica_while_load_allows():
    holder = lora_worker("a", ["x", "y"], running=["x"], slots=1, queue=3)
    other = lora_worker("b", ["x", "y"], slots=1, queue=0)
    r = router(holder, other)
    parsed = prompts.ParsedPrompt("x", list(range(8)), "", "", False)
    assert r.route(parsed, "x", 0.0)[0].worker.id == "a"  # joins the running adapter
    assert r.route(parsed, "y", 0.0)[0].worker.id == "b"  # a's slot is busy with x
    holder.load = WorkerLoad(num_running=12, running_loras=frozenset(["x"]), max_loras=1)
    assert r.route(parsed, "x", 0.0)[0].worker.id == "b"  # saturated: spill over


def test_a_report_keeps_bounded_adapters_and_instance():
    from tandem.router.workers import MAX_REPORTED_ADAPTERS

    named = {f"a{i}": "d" for i in range(MAX_REPORTED_ADAPTERS + 5)}
    r = LoRAReport.reported(named, 2, "i" * 500, 3)  # as GetLoad states one
    assert len(r.digests) == MAX_REPORTED_ADAPTERS and "a0" in r.digests
    assert r.instance == "i" * 128 and (r.slots, r.version) == (2, 3)
    assert LoRAReport.reported({"x": "d" * 129}).digests == {}
