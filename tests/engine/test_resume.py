"""Token replay (`ResumeState`): a request resumed with the first k tokens of an undisturbed
run produces exactly the rest of it (greedy and seeded sampling, penalties, stop strings,
min_tokens, logprobs), on a tiny random llama, in process."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import pytest

from tandem import LLM, SamplingParams, StructuredOutputs
from tandem.engine.errors import InvalidRequestError
from tandem.engine.request import ResumeState
from tandem.protocol.detokenizer import IncrementalDetokenizer

ENGINE_ARGS = dict(block_size=4, max_num_seqs=32, max_num_batched_tokens=256, seed=3,
                   enforce_eager=True, max_model_len=128)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_kv_blocks=256, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def overlapped(tiny_model):
    """The overlapped loop (`async_scheduling`, optimistic placeholders)."""
    return LLM(tiny_model, num_kv_blocks=256, async_scheduling=True, **ENGINE_ARGS)


def _run(llm: LLM, reqs: dict[str, tuple[list[int], SamplingParams, ResumeState | None]]):
    """Final outputs, from delta outputs (as the server streams them) joined."""
    engine = llm.engine
    for rid, (prompt, params, resume) in reqs.items():
        engine.add_request(rid, prompt, params, resume=resume, delta=True)
    final: dict[str, Joined] = {}
    done: set[str] = set()
    while len(done) < len(reqs):
        for out in engine.step():
            c = out.outputs[0]
            j = final.setdefault(out.request_id, Joined())
            j.text += c.text
            j.token_ids += list(c.token_ids)
            if c.logprobs is not None:
                j.logprobs = (j.logprobs or []) + list(c.logprobs)
            j.finish_reason, j.stop_reason = c.finish_reason, c.stop_reason
            if out.finished:
                done.add(out.request_id)
    return final


@dataclass
class Joined:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


def _streamed_chars(llm: LLM, ids) -> int:
    """Characters a stream had sent after `ids` (pushed one by one; none held back for
    a stop string): the most a client can have."""
    detok = IncrementalDetokenizer(llm.get_tokenizer())
    return sum(len(detok.push([t])) for t in ids)


def _params(rng: random.Random, text_pieces: list[str]) -> SamplingParams:
    kw: dict = {"max_tokens": rng.randint(6, 24), "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.4:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.6, 1.0, 1.3]), seed=rng.randrange(1 << 40))
        if rng.random() < 0.5:
            kw["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.8, 0.95])
    if rng.random() < 0.3:
        kw["repetition_penalty"] = 1.3
    if rng.random() < 0.3:
        kw.update(presence_penalty=0.5, frequency_penalty=0.7)
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(1, 8)
    if rng.random() < 0.5:
        kw["logprobs"] = rng.choice([0, 3])
    return SamplingParams(**kw)


@pytest.mark.parametrize("loop", ["serial", "overlapped"])
def test_resumed_requests_continue_the_undisturbed_output_exactly(loop, request):
    llm = request.getfixturevalue("llm" if loop == "serial" else "overlapped")
    rng = random.Random(42)
    vocab = llm.engine.state.vocab_size
    cases = {}
    for i in range(48):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))]
        cases[f"full-{i}"] = (prompt, _params(rng, []), None)
    full = _run(llm, cases)
    # second pass: some requests get a stop string that spans a token boundary, from the
    # undisturbed text (so the stop lands after the replayed part or across it)
    resumed, expect = {}, {}
    for i in range(48):
        prompt, params, _ = cases[f"full-{i}"]
        out = full[f"full-{i}"]
        if len(out.token_ids) < 2:
            continue
        k = rng.randint(1, len(out.token_ids) - 1)
        sent = rng.randint(0, _streamed_chars(llm, out.token_ids[:k]))
        resumed[f"res-{i}"] = (prompt, params, ResumeState(list(out.token_ids[:k]), sent))
        expect[f"res-{i}"] = (out, k, sent)
    assert len(resumed) >= 30
    got = _run(llm, resumed)
    for rid, (out, k, sent) in expect.items():
        r = got[rid]
        assert list(r.token_ids) == list(out.token_ids[k:]), rid
        assert r.text == out.text[sent:], rid
        assert r.finish_reason == out.finish_reason, rid
        if out.logprobs is not None:
            assert len(r.logprobs) == len(out.logprobs) - k
            for a, b in zip(r.logprobs, out.logprobs[k:], strict=True):
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a), rid


def test_a_stop_string_across_the_replay_boundary_still_stops(llm):
    prompt = list(range(40, 60))
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = _run(llm, {"a": (prompt, base, None)})["a"]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in out.token_ids]
    # last chars replayed + first chars new, where it first occurs
    k = next(i for i in range(3, 20) if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 2
             and out.text.find(pieces[i - 1][-2:] + pieces[i][:2])
             == len("".join(pieces[:i])) - 2)
    stop = pieces[k - 1][-2:] + pieces[k][:2]
    cut = out.text.find(stop)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    whole = _run(llm, {"b": (prompt, params, None)})["b"]
    sent = min(cut, _streamed_chars(llm, out.token_ids[:k]))
    got = _run(llm, {"c": (prompt, params, ResumeState(list(out.token_ids[:k]), sent))})["c"]
    assert whole.finish_reason == got.finish_reason == "stop"
    assert got.text == whole.text[sent:]
    assert got.stop_reason == stop


def test_bad_resumes_are_refused(llm):
    engine = llm.engine
    p = [5, 6, 7]
    with pytest.raises(InvalidRequestError, match="leave nothing"):
        engine.add_request("x1", p, SamplingParams(max_tokens=2), resume=ResumeState([1, 2]))
    with pytest.raises(InvalidRequestError, match="integers"):
        engine.add_request("x2", p, SamplingParams(max_tokens=8), resume=ResumeState([10**9]))
    with pytest.raises(InvalidRequestError, match="n == 1"):
        engine.add_request("x3", p, SamplingParams(max_tokens=8, n=2), resume=ResumeState([1]))
    assert not engine.has_unfinished_requests()


def test_a_resumed_structured_output_continues_its_grammar(llm):
    """The matcher accepts the replayed tokens before the first new one is masked: the
    resumed output is the undisturbed one's tail, and a replayed token the grammar refuses
    fails the request instead of being served."""
    rng = random.Random(5)
    vocab = llm.engine.state.vocab_size
    regex = StructuredOutputs(regex=r"[0-9]{4}-[a-z]{6,12}")
    cases, resumed, expect = {}, {}, {}
    for i in range(8):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
        params = SamplingParams(max_tokens=40, temperature=rng.choice([0.0, 1.0]), seed=i,
                                structured_outputs=regex)
        cases[f"g-{i}"] = (prompt, params, None)
    full = _run(llm, cases)
    for rid, (prompt, params, _) in cases.items():
        out = full[rid]
        assert re.fullmatch(r"[0-9]{4}-[a-z]{6,12}", out.text), out.text
        k = rng.randint(1, len(out.token_ids) - 1)
        sent = _streamed_chars(llm, out.token_ids[:k])
        resumed["r" + rid] = (prompt, params, ResumeState(list(out.token_ids[:k]), sent))
        expect["r" + rid] = (out, k, sent)
    got = _run(llm, resumed)
    for rid, (out, k, sent) in expect.items():
        assert got[rid].token_ids == list(out.token_ids[k:]), rid
        assert got[rid].text == out.text[sent:] and got[rid].finish_reason == "stop", rid
    tok = llm.get_tokenizer()
    letters = tok.encode("abc", add_special_tokens=False)  # the regex starts with digits
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=regex)
    bad = _run(llm, {"bad": ([7, 8, 9], params, ResumeState(letters))})["bad"]
    assert bad.finish_reason == "error" and bad.text == ""
