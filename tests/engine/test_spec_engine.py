"""Speculative decoding in the real engine on the bundled model: greedy outputs are token for
token those without speculation, whatever the drafts (an oracle proposer that is right or
wrong at random, n-gram, and the self-draft), alone and in mixed batches, with prefix
caching and chunked prefill on, under preemption, with stop strings and `max_tokens` cutting
inside an accepted run; KV accounting is exact afterwards (every block back in the pool)."""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.spec_decode import Proposal, Proposer, register_proposer

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog, the quick "
    "brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list of numbers.",
    "List the days of the week, one per line.",
    "What is the capital of France? Answer in one sentence.",
    "Copy this list: alpha, beta, gamma, delta, epsilon, zeta, eta, theta.",
    "Tell me a short story about a robot who learns to paint.",
]
ORACLE: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> the reference output ids
P_RIGHT = {"p": 0.7}


@register_proposer("test-oracle")
class OracleProposer(Proposer):
    """Proposes the reference continuation, each token kept with probability P_RIGHT (else a
    random token): accepted runs of every length and rejections at every position."""

    def __init__(self, ctx) -> None:  # noqa: ANN001 - ProposerContext
        self.rng = random.Random(1234)
        self.vocab = ctx.vocab_size
        self.calls = 0

    def propose(self, requests, num_tokens, hidden_states=None):  # noqa: ANN001, ANN201
        self.calls += 1
        out = []
        for req, k in zip(requests, num_tokens, strict=True):
            ref = ORACLE.get(tuple(req.prompt_token_ids))
            done = req.num_output_tokens
            if ref is None or done >= len(ref):
                out.append(None)
                continue
            drafts = [t if self.rng.random() < P_RIGHT["p"] else self.rng.randrange(self.vocab)
                      for t in ref[done : done + k]]
            out.append(Proposal(drafts))
        return out


def _greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


@pytest.fixture(scope="module")
def base() -> LLM:
    # 256 blocks (4,096 tokens) hold every batch here; the default pool (a tenth of RAM,
    # zero-filled) would cost the test worker gigabytes
    return LLM(max_num_batched_tokens=64, num_kv_blocks=256, seed=0)


@pytest.fixture(scope="module")
def prompts(base: LLM) -> list[list[int]]:
    return [_chat_ids(base, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(base: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, no speculation."""
    refs = []
    for p in prompts:
        base.engine.reset_prefix_cache()
        refs.append(list(base.generate([p], _greedy())[0].outputs[0].token_ids))
    for p, r in zip(prompts, refs, strict=True):
        ORACLE[tuple(p)] = r
    return refs


def _assert_drained(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.requests and not eng.kv._blocks
    assert eng.kv.pool.num_free_blocks() == eng.state.num_kv_blocks


@pytest.fixture(scope="module")
def oracle() -> LLM:
    # a small budget: chunked prefill; a small pool: preemption with the whole batch
    return LLM(max_num_batched_tokens=64, num_kv_blocks=20, seed=0,
               speculative_config={"method": "test-oracle", "num_speculative_tokens": 5,
                                   "adaptive": False})


@pytest.mark.parametrize("p_right", [0.0, 0.6, 1.0])
def test_oracle_drafts_never_change_greedy_outputs(oracle, prompts, reference, p_right):
    P_RIGHT["p"] = p_right
    eng = oracle.engine
    before = eng.stats()
    outs = oracle.generate(prompts, _greedy())
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == reference
    st = eng.stats()
    drafts = st.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafts > 0
    if p_right == 1.0:
        assert accepted == drafts  # the reference is the target's own argmax
    if p_right == 0.0:
        assert accepted < drafts // 10  # random tokens: almost never the argmax
    _assert_drained(oracle)


def test_under_preemption_and_alone_vs_batched(oracle, prompts, reference):
    """Eight requests (two prompts twice, with cache hits) on 20 blocks: preempted
    repeatedly while speculating; each equals its reference."""
    P_RIGHT["p"] = 0.8
    eng = oracle.engine
    pre = eng.stats().num_preemptions
    batch = prompts + prompts[:2]
    outs = oracle.generate(batch, _greedy())
    assert [list(o.outputs[0].token_ids) for o in outs] == reference + reference[:2]
    assert eng.stats().num_preemptions > pre
    _assert_drained(oracle)


def test_stop_and_max_tokens_cut_inside_an_accepted_run(oracle, base, prompts, reference):
    """Stop strings taken from the middle of each reference (so they end inside accepted
    runs), with and without the stop string in the output, and a small max_tokens: text,
    tokens and finish reason equal the run without speculation (one batch each)."""
    P_RIGHT["p"] = 1.0
    tok = oracle.get_tokenizer()
    batch, params = [], []
    for p, ref in zip(prompts, reference, strict=True):
        text = tok.decode(ref)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        params += [_greedy(max_tokens=7)]
        if stop.strip():
            params += [_greedy(stop=[stop]), _greedy(stop=[stop], include_stop_str_in_output=True)]
        batch += [p] * (len(params) - len(batch))
    want = base.generate(batch, params)
    got = oracle.generate(batch, params)
    assert sum(w.outputs[0].finish_reason == "stop" for w in want) >= 4
    for w, g in zip(want, got, strict=True):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.text, list(g.token_ids), g.finish_reason) == (
            w.text, list(w.token_ids), w.finish_reason)
    _assert_drained(oracle)


def test_logprobs_of_accepted_drafts_match(oracle, base, prompts):
    P_RIGHT["p"] = 1.0
    params = _greedy(max_tokens=16, logprobs=3)
    want = base.generate(prompts[:2], params)
    got = oracle.generate(prompts[:2], params)
    for w, g in zip(want, got, strict=True):
        assert list(w.outputs[0].token_ids) == list(g.outputs[0].token_ids)
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lw.keys() == lg.keys()
            for t in lw:
                assert abs(lw[t] - lg[t]) < 1e-3


def test_opt_out_and_penalties_do_not_speculate(oracle, prompts, reference):
    P_RIGHT["p"] = 1.0
    eng = oracle.engine
    before = eng.stats().spec_num_drafts
    out = oracle.generate(prompts[:1], _greedy(speculative=False))[0]
    assert list(out.outputs[0].token_ids) == reference[0]
    oracle.generate(prompts[:1], _greedy(max_tokens=8, repetition_penalty=1.2))
    assert eng.stats().spec_num_drafts == before


def test_ngram_greedy_equality_and_acceptance(base, prompts, reference):
    llm = LLM(max_num_batched_tokens=64, num_kv_blocks=256, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    outs = llm.generate(prompts, _greedy())
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    st = llm.engine.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    _assert_drained(llm)
