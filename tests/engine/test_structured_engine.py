"""Structured outputs inside the engine, on a tiny random-weight Llama (its outputs are
random, so only the grammar makes them valid): seeded random JSON schemas at temperature 0
and 1, choice and regex, n > 1 and seeds, a batch mixing constrained and unconstrained
requests, a grammar that cannot compile failing its request alone, a slow compile that
stalls nobody else, preemption, prefix caching, the overlapped loop, LoRA, and speculative
decoding (random drafts, n-gram and a draft model) giving the greedy tokens of no
speculation and never a token the grammar forbids."""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import pytest

from tandem import LLM, SamplingParams, StructuredOutputs
from tandem.engine.errors import InvalidRequestError
from tandem.engine.spec_decode import Proposal, Proposer, register_proposer
from tandem.engine.structured_manager import COMPILE_ERROR_PREFIX
from tests.structured_schemas import random_schema

VOCAB = 512  # the tiny model's (tests/engine/utils.py TINY_VOCAB)
MAX_TOKENS = 160


def _bounded(schema: dict) -> dict:
    """`schema` with every string at most 6 characters and every number an integer range:
    a random-weight model has no reason ever to close an unbounded string or number, so
    only bounded outputs can be expected to end within `max_tokens`."""
    out = dict(schema)
    if out.get("type") == "string" and "enum" not in out:
        out["minLength"] = min(out.get("minLength", 0), 2)
        out["maxLength"] = min(out.get("maxLength", 6), 6)
    elif out.get("type") == "number":
        out.update(type="integer", minimum=-50, maximum=50)
    elif out.get("type") == "array":
        out["items"] = _bounded(out["items"])
    elif out.get("type") == "object":
        out["properties"] = {k: _bounded(v) for k, v in out["properties"].items()}
    return out


def _json(schema: dict) -> StructuredOutputs:
    return StructuredOutputs.from_json_schema(schema, disable_any_whitespace=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 24))] for _ in range(n)]


def _ids(out) -> list[int]:  # noqa: ANN001 - RequestOutput
    return list(out.outputs[0].token_ids)


def _allowed(llm: LLM, spec: StructuredOutputs, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of `spec` accepts `token_ids` one by one."""
    matcher = llm.engine.structured.compiler.compile_now(spec).matcher()
    return all(matcher.accept_tokens([t]) for t in token_ids)


def _params(spec: StructuredOutputs | None, temperature: float = 0.0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), temperature=temperature,
                          structured_outputs=spec, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> LLM:
    return LLM(model=tiny_model, num_threads=1, seed=0, max_num_batched_tokens=256)


SCHEMAS = [_bounded(random_schema(seed)) for seed in range(8)]


def test_random_schemas_give_valid_json_at_temperature_0_and_1(llm):
    prompts = _prompts(len(SCHEMAS))
    params = [_params(_json(s), temperature=t, seed=i if t else None)
              for t in (0.0, 1.0) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(prompts * 2, params)
    for out, schema, sp in zip(outs, SCHEMAS * 2, params, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, schema)
        jsonschema.validate(json.loads(c.text), schema)
        assert c.token_ids[-1] in llm.engine.eos_token_ids  # the grammar ended: EOS, not text
        assert _allowed(llm, sp.structured_outputs, list(c.token_ids))
    # without the grammar the same model gives no JSON at all
    free = llm.generate(prompts[:2], _params(None, max_tokens=30))
    for out in free:
        with pytest.raises(ValueError):
            json.loads(out.outputs[0].text)


def test_choice_and_regex_constrain_exactly(llm):
    choice = StructuredOutputs(choice=("red", "green", "blue", "a longer choice"))
    regex = StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}")
    prompts = _prompts(6, seed=1)
    for t in (0.0, 1.0):
        outs = llm.generate(prompts * 2, [_params(choice, t)] * 6 + [_params(regex, t)] * 6)
        for out in outs[:6]:
            assert out.outputs[0].text in choice.choice
            assert out.outputs[0].finish_reason == "stop"
        for out in outs[6:]:
            assert re.fullmatch(regex.regex, out.outputs[0].text), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"


def test_n_samples_each_follow_the_grammar_and_seeds_repeat(llm):
    spec = _json(SCHEMAS[3])
    sp = _params(spec, temperature=1.0, n=4, seed=11)
    first = llm.generate(_prompts(1, seed=2), sp)[0]
    again = llm.generate(_prompts(1, seed=2), sp)[0]
    assert len(first.outputs) == 4
    for c in first.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS[3])
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]
    assert len({c.text for c in first.outputs}) > 1  # each sample its own matcher and draw


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llm):
    prompts = _prompts(6, seed=3)
    alone = [_ids(o) for o in llm.generate(prompts[:3], _params(None, max_tokens=24))]
    mixed = llm.generate(prompts, [_params(None, max_tokens=24)] * 3
                         + [_params(_json(SCHEMAS[i])) for i in range(3)])
    assert [_ids(o) for o in mixed[:3]] == alone
    for out, schema in zip(mixed[3:], SCHEMAS, strict=False):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_grammar_that_cannot_compile_fails_its_request_alone(llm):
    bad = StructuredOutputs(grammar="root ::= undefined_rule")
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.check_structured_outputs(_params(bad))
    assert err.value.param == "structured_outputs"
    prompts = _prompts(3, seed=4)
    outs = llm.generate(prompts, [_params(None, max_tokens=8), _params(bad),
                                  _params(_json(SCHEMAS[0]))])
    assert outs[0].error is None and len(_ids(outs[0])) == 8
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert outs[1].error.startswith(COMPILE_ERROR_PREFIX) and "undefined_rule" in outs[1].error
    assert outs[2].outputs[0].finish_reason == "stop"
    # a malformed spec is refused by SamplingParams itself
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs=StructuredOutputs(json="[1]"))
    assert err.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs=StructuredOutputs())  # no constraint


def test_a_slow_compile_stalls_no_other_request(llm, monkeypatch):
    eng = llm.engine
    backend = eng.structured.compiler.backend
    release = threading.Event()
    compile_ = backend.compile

    def slow(spec):  # noqa: ANN001, ANN202
        if spec.regex == "(slow)+":
            assert release.wait(30)
        return compile_(spec)

    monkeypatch.setattr(backend, "compile", slow)
    prompts = _prompts(2, seed=5)
    slow_spec = StructuredOutputs(regex="(slow)+")
    eng.add_request("slow", prompts[0], _params(slow_spec, max_tokens=6))
    eng.add_request("free", prompts[1], _params(None, max_tokens=12))
    done = {}
    for _ in range(200):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if "free" in done:
            break
    assert len(_ids(done["free"])) == 12  # every step of it ran while the grammar compiled
    assert "slow" not in done and eng.scheduler.num_waiting == 1
    assert eng.scheduler.requests["slow"].num_computed_tokens == 0
    release.set()
    while "slow" not in done:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert re.fullmatch("(slow)+", done["slow"].outputs[0].text)


def test_preemption_keeps_each_matcher(tiny_model, llm):
    prompts = _prompts(6, seed=6)
    params = [_params(_json(SCHEMAS[i]), max_tokens=80) for i in range(6)]
    want = [_ids(o) for o in llm.generate(prompts, params)]
    small = LLM(model=tiny_model, num_threads=1, seed=0, block_size=4, num_kv_blocks=30,
                max_num_batched_tokens=64)
    outs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [_ids(o) for o in outs] == want


def test_prefix_cached_prompt_with_a_grammar(llm):
    prompt = _prompts(1, seed=7)[0] * 3  # several full blocks
    sp = _params(_json(SCHEMAS[5]))
    first = llm.generate([prompt], sp)[0]
    second = llm.generate([prompt], sp)[0]
    assert second.num_cached_tokens >= 16
    assert _ids(second) == _ids(first)
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMAS[5])


def test_overlapped_loop_gives_the_serial_outputs(tiny_model, llm):
    prompts = _prompts(6, seed=8)
    params = ([_params(None, max_tokens=20)] * 3
              + [_params(_json(SCHEMAS[i]), temperature=1.0, seed=i) for i in range(3)])
    want = [_ids(o) for o in llm.generate(prompts, params)]
    overlapped = LLM(model=tiny_model, num_threads=1, seed=0, max_num_batched_tokens=256,
                     async_scheduling=True)
    assert [_ids(o) for o in overlapped.generate(prompts, params)] == want


def test_lora_request_with_a_grammar(tmp_path, tiny_model):
    from tandem import LoRARequest
    from tests.engine.utils import make_peft_adapter

    with open(f"{tiny_model}/config.json") as f:
        base = json.load(f)
    make_peft_adapter(tmp_path / "ad", base, rank=4, seed=1)
    lora_llm = LLM(model=tiny_model, num_threads=1, seed=0, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("ad", 1, str(tmp_path / "ad"))
    prompts = _prompts(2, seed=9)
    sp = _params(_json(SCHEMAS[1]))
    with_ad = lora_llm.generate(prompts, sp, lora_request=lora)
    base_out = lora_llm.generate(prompts, sp)
    for out in with_ad + base_out:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[1])
    assert [_ids(o) for o in with_ad] != [_ids(o) for o in base_out]


# -- speculative decoding ----------------------------------------------------------------
REFERENCE: dict[tuple[int, ...], list[int]] = {}  # prompt -> greedy output without speculation
P_RIGHT = {"p": 0.5}


@register_proposer("test-grammar-oracle")
class OracleProposer(Proposer):
    """Proposes the reference continuation, each token kept with probability P_RIGHT, else a
    random token (most of which the grammar forbids)."""

    def __init__(self, ctx) -> None:  # noqa: ANN001 - ProposerContext
        self.rng = random.Random(99)
        self.vocab = ctx.vocab_size

    def propose(self, requests, num_tokens, hidden_states=None):  # noqa: ANN001, ANN201
        out = []
        for req, k in zip(requests, num_tokens, strict=True):
            ref = REFERENCE.get(tuple(req.prompt_token_ids), [])[req.num_output_tokens:]
            drafts = [t if self.rng.random() < P_RIGHT["p"] else self.rng.randrange(self.vocab)
                      for t in ref[:k]]
            drafts += [self.rng.randrange(self.vocab) for _ in range(k - len(drafts))]
            out.append(Proposal(drafts))
        return out


SPEC_CASES = {
    "oracle": {"method": "test-grammar-oracle", "num_speculative_tokens": 4, "adaptive": False},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3, "adaptive": False},
    "draft": {"method": "draft", "model": "self", "draft_num_layers": 1,
              "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_speculation_with_a_grammar_gives_the_greedy_tokens(tiny_model, llm, case):
    rng = random.Random(case)
    prompts = _prompts(6, seed=10)
    specs = [_json(SCHEMAS[rng.randrange(len(SCHEMAS))]) for _ in range(4)] + [
        StructuredOutputs(regex=r"(ab|abc|b){2,9}"), StructuredOutputs(choice=("aaa", "ab"))]
    params = [_params(s) for s in specs]
    want = [_ids(o) for o in llm.generate(prompts, params)]
    for p, ids in zip(prompts, want, strict=True):
        REFERENCE[tuple(p)] = ids
    spec_llm = LLM(model=tiny_model, num_threads=1, seed=0, max_num_batched_tokens=256,
                   speculative_config=SPEC_CASES[case])
    for p_right in (0.0, 0.5, 1.0) if case == "oracle" else (None,):
        P_RIGHT["p"] = p_right
        outs = spec_llm.generate(prompts, params)
        assert [_ids(o) for o in outs] == want
    st = spec_llm.engine.stats()
    assert st.spec_num_drafts > 0
    if case != "ngram":
        assert st.spec_num_accepted_tokens > 0
    # sampled: the drafts' distribution is rejection-sampled against the masked target
    sampled = spec_llm.generate(prompts, [_params(s, 1.0, seed=i) for i, s in enumerate(specs)])
    for out, spec in zip(sampled, specs, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        assert _allowed(spec_llm, spec, _ids(out))


def test_tensor_parallel_ranks_give_the_one_rank_tokens(tiny_model, llm):
    """Rank 0 alone samples (the logits are gathered to it), so it alone applies the
    bitmask: two ranks give one rank's greedy constrained tokens."""
    prompts = _prompts(4, seed=12)
    params = [_params(_json(SCHEMAS[i])) for i in range(4)]
    want = [_ids(o) for o in llm.generate(prompts, params)]
    tp = LLM(model=tiny_model, num_threads=1, seed=0, max_num_batched_tokens=256,
             tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        got = [_ids(o) for o in tp.generate(prompts, params)]
    finally:
        tp.engine.shutdown()
    assert got == want


def test_the_grammar_applies_after_the_reasoning_end_tag(llm):
    """`reasoning_end_token_ids`: the output is free up to and including the end tag, then
    follows the grammar."""
    regex = StructuredOutputs(regex=r"[0-9]{2,5}")
    prompt = _prompts(1, seed=13)[0]
    free = _ids(llm.generate([prompt], _params(None, max_tokens=24))[0])
    # two of the model's own tokens, first seen after a few others, stand for `</think>`
    at = next(i for i in range(2, 22) if not any(
        free[j:j + 2] == free[i:i + 2] for j in range(i)))
    end = tuple(free[at:at + 2])
    out = llm.generate([prompt], _params(regex, reasoning_end_token_ids=end))[0]
    ids = _ids(out)
    assert ids[:at + 2] == free[:at + 2]  # thinking: unconstrained (the same greedy tokens)
    answer = llm.get_tokenizer().decode(ids[at + 2:], skip_special_tokens=True)
    assert re.fullmatch(regex.regex, answer), answer
    assert out.outputs[0].finish_reason == "stop"
    with pytest.raises(InvalidRequestError):
        SamplingParams(reasoning_end_token_ids=())


def test_the_backend_is_chosen_by_config_and_flag(tiny_model):
    import argparse

    from tandem.engine.config import EngineConfig
    from tandem.engine.errors import ConfigError
    from tandem.serving.worker import add_engine_args, engine_config

    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    assert engine_config(p.parse_args([])).structured_outputs_backend == "llguidance"
    args = p.parse_args(["--structured-outputs-backend", "xgrammar"])
    assert engine_config(args).structured_outputs_backend == "xgrammar"
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'outlines'"):
        p.parse_args(["--structured-outputs-backend", "outlines"])
    with pytest.raises(ConfigError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")
    xg = LLM(model=tiny_model, num_threads=1, seed=0, structured_outputs_backend="xgrammar")
    outs = xg.generate(_prompts(2, seed=14), [_params(_json(SCHEMAS[2])),
                                               _params(StructuredOutputs(regex=r"[a-c]{3}"))])
    assert xg.engine.structured.backend_name == "xgrammar"
    assert type(xg.engine.structured.compiler.backend).__name__ == "XGrammarBackend"
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMAS[2])
    assert re.fullmatch("[a-c]{3}", outs[1].outputs[0].text)


def test_a_missing_grammar_library_stops_the_engine_at_start(tiny_model, monkeypatch):
    import sys

    from tandem.engine.errors import ConfigError
    from tandem.engine.structured import base

    monkeypatch.delitem(base._REGISTRY, "llguidance", raising=False)
    monkeypatch.setitem(sys.modules, "tandem.engine.structured.llguidance_backend", None)
    with pytest.raises(ConfigError, match="'llguidance' is not installed"):
        LLM(model=tiny_model, num_threads=1)


def test_disaggregated_prefill_leaves_the_grammar_to_the_decode_side(tiny_model, llm):
    """P/D: the prefill worker computes the prompt's pages with a throwaway greedy token and
    no grammar (it never builds one); the decode worker imports them, computes the prompt's
    last token and samples every output token under its grammar: the aggregated tokens."""
    import asyncio

    import grpc

    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.kvtransfer.client import RemotePrefill, RemotePrefillSettings
    from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service
    from tandem.protocol.web import PREFILL_HEADER
    from tandem.serving.metrics import ServerMetrics
    from tandem.serving.pd import PrefillImports
    from tests.kvtransfer.fake_prefill import CHANNEL_OPTIONS

    name = "tiny-pd"
    prompt = _prompts(1, seed=15)[0] * 3
    sp = _params(_json(SCHEMAS[6]))
    want = _ids(llm.generate([prompt], sp)[0])

    def engine() -> AsyncLLMEngine:
        return AsyncLLMEngine(LLMEngine(EngineConfig(
            model=tiny_model, block_size=4, num_kv_blocks=64, num_threads=1,
            served_model_name=name)))

    async def main(prefill: AsyncLLMEngine, decode: AsyncLLMEngine) -> tuple[list, int]:
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        service = KVTransferService(lambda: prefill, name, "prefill")
        add_kv_transfer_service(server, service)
        target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        settings = RemotePrefillSettings(backend="grpc", timeout_s=30)
        remote = RemotePrefill(decode, name, settings)
        imports = PrefillImports(lambda: remote, settings, ServerMetrics(name, lambda: None),
                                 name)
        try:
            imported = await imports.fetch({PREFILL_HEADER: target}, decode, "pd", [prompt], "")
            nbytes = sum(x.bytes for x in imported)
            try:
                _, q = await decode.add(prompt, sp, "pd-0")
                while not (out := await q.get()).finished:
                    pass
            finally:
                imports.unpin(imported)
        finally:
            await remote.close()
            await service.close()
            await server.stop(0)
        return out, nbytes

    prefill, decode = engine(), engine()
    try:
        out, nbytes = asyncio.run(main(prefill, decode))
        assert nbytes > 0 and out.num_cached_tokens >= 8  # the prompt's pages came over
        assert _ids(out) == want
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[6])
        assert prefill.engine._structured is None  # no grammar on the prefill side
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_logprobs_are_those_of_the_masked_logits_and_finite(llm):
    """As vLLM: logprobs come from the logits after the grammar's mask, so a forced token's
    logprob is 0 and a forbidden one's -inf, reported as LOGPROB_FLOOR (finite JSON)."""
    from tandem.engine.sampler import LOGPROB_FLOOR

    spec = StructuredOutputs(choice=("aaa", "ab"))
    out = llm.generate(_prompts(1, seed=16), _params(spec, logprobs=5))[0].outputs[0]
    assert out.text in spec.choice and len(out.logprobs) == len(out.token_ids)
    forced = 0
    for tid, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert all(LOGPROB_FLOOR <= v <= 0.0 for v in entry.values())
        allowed = [v for v in entry.values() if v > LOGPROB_FLOOR]
        if len(allowed) == 1:  # the grammar allowed one token: it has all the mass
            forced += 1
            assert entry[tid] == pytest.approx(0.0, abs=1e-5)
            assert list(entry.values()).count(LOGPROB_FLOOR) == len(entry) - 1
    assert forced >= 1


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_step_waiting_only_for_a_grammar_is_not_idle(tiny_model, monkeypatch, overlapped):
    """The serving loop sleeps after an idle step until a command arrives: a step that ran
    nothing because a grammar compiles must not count as idle, or the request would wait
    for the loop's safety wake-up."""
    eng = LLM(model=tiny_model, num_threads=1, seed=0, async_scheduling=overlapped).engine
    backend = eng.structured.compiler.backend
    release = threading.Event()
    compile_ = backend.compile
    monkeypatch.setattr(backend, "compile",
                        lambda spec: (release.wait(30), compile_(spec))[1])
    eng.add_request("r", _prompts(1, seed=17)[0], _params(StructuredOutputs(regex="[xy]{4}")))
    for _ in range(3):
        assert eng.step() == [] and not eng.last_step_idle
    release.set()
    outs = []
    while not (outs and outs[-1].finished):
        outs += eng.step()
    assert re.fullmatch("[xy]{4}", outs[-1].outputs[0].text)
    assert eng.step() == [] and eng.last_step_idle  # nothing left: idle again
