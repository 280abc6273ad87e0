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
from tandem.router.workers import Worker, WorkerLoad


def lora_worker(wid: str, adapters=(), running=(), waiting=(), resident=(), slots=2,
                queue=0, model="base") -> Worker:
    return Worker(id=wid, model=model, ready=True, block_size=4,
                  lora_adapters=frozenset(adapters), lora_slots=slots,
                  load=WorkerLoad(num_running=queue, running_loras=frozenset(running),
                                  waiting_loras=frozenset(waiting),
                                  resident_loras=frozenset(resident), max_loras=slots))


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
        chain = r.hashes(parsed, lora)[4]
        req = Request("r", ids, SamplingParams(max_tokens=1), 1,
                      hash_keys=request_hash_keys("base", lora, salt), lora_name=lora)
        assert chain == req.update_block_hashes(4)[: len(ids) // 4]
        for other in (None, "code" if lora == "sql" else "sql"):
            theirs = hash_block_chain(ids, 4, request_hash_keys("base", other, salt))
            assert not chain or not set(chain) & set(theirs)


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
