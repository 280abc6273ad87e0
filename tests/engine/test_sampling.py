"""Sampling features against independent references on a tiny random llama."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine

from .utils import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = make_tiny_model_dir(path, "llama", seed=5)
    llm = LLM(str(path), block_size=4, kv_cache_memory=64 << 20)
    return llm, model


def _prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _greedy(llm, prompt, **kw):
    kw = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, **kw}
    return llm.generate([prompt], SamplingParams(**kw))[0]


def test_stop_string_spanning_tokens_is_cut_and_not_returned(tiny):
    llm, _ = tiny
    prompt = _prompt(1)
    full = _greedy(llm, prompt, max_tokens=24).outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in full.token_ids]
    # a stop string made of the end of token 4 and the start of token 5
    k = 4
    prefix = "".join(pieces[:k])
    stop = pieces[k - 1][-2:] + pieces[k][:2]
    cut = full.text.find(stop)
    assert 0 <= cut <= len(prefix)
    out = _greedy(llm, prompt, max_tokens=24, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    kept = _greedy(llm, prompt, max_tokens=24, stop=[stop],
                   include_stop_str_in_output=True).outputs[0]
    assert kept.text == full.text[: cut + len(stop)]


def test_a_stop_string_completed_by_the_min_tokens_th_token_stops(tiny):
    """Stops count from the `min_tokens`-th token on (vLLM's rule): a stop string that token
    completes is caught, though the next token's text no longer contains it."""
    llm, _ = tiny
    prompt = _prompt(6)
    full = _greedy(llm, prompt, max_tokens=24).outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in full.token_ids]
    upto = "".join(pieces[:3])
    stop = upto[-3:]  # ends with the 3rd token's text
    assert len(pieces[2]) >= 1 and full.text.startswith(upto)
    assert full.text.find(stop) == len(upto) - 3  # nowhere earlier, so only token 3 ends it
    out = _greedy(llm, prompt, max_tokens=24, stop=[stop], min_tokens=3).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:3] and out.text == upto[:-3]
    # one token more of min_tokens and it no longer counts: the text runs on
    later = _greedy(llm, prompt, max_tokens=24, stop=[stop], min_tokens=4).outputs[0]
    assert later.finish_reason == "length" or len(later.token_ids) > 3


def test_stop_token_ids_and_min_tokens(tiny):
    llm, _ = tiny
    prompt = _prompt(2)
    ref = _greedy(llm, prompt).outputs[0].token_ids
    out = _greedy(llm, prompt, stop_token_ids=[ref[0]]).outputs[0]
    assert out.token_ids == ref[:1] and out.finish_reason == "stop"
    assert out.stop_reason == ref[0] and out.text == ""
    held = _greedy(llm, prompt, stop_token_ids=[ref[0]], min_tokens=3).outputs[0]
    assert ref[0] not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_logprobs_and_prompt_logprobs_match_the_reference_model(tiny):
    llm, model = tiny
    prompt = _prompt(3)
    out = _greedy(llm, prompt, max_tokens=6, logprobs=5, prompt_logprobs=3)
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    # prompt logprobs: entry i is for prompt token i given tokens < i; the first is None
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry[prompt[i]] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(3).indices.tolist()
        assert set(top) <= set(entry)
    lps = out.outputs[0].logprobs
    assert len(lps) == 6
    for j, (tid, entry) in enumerate(zip(out.outputs[0].token_ids, lps, strict=True)):
        pos = len(prompt) - 1 + j
        assert entry[tid] == pytest.approx(ref[pos, tid].item(), abs=1e-4)
        assert len(entry) == 5  # greedy: the chosen token is the top-1
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(e[t] for e, t in zip(lps, out.outputs[0].token_ids, strict=True)))


def test_repetition_penalty_matches_transformers(tiny):
    llm, model = tiny
    prompt = _prompt(4)
    ours = _greedy(llm, prompt, repetition_penalty=1.5).outputs[0].token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.5, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ours == ref[0, len(prompt):].tolist()


def test_presence_and_frequency_penalties_match_a_reference_loop(tiny):
    llm, model = tiny
    prompt = _prompt(5)
    ours = _greedy(llm, prompt, presence_penalty=0.7, frequency_penalty=1.3).outputs[0]
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(16):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=logits.shape[0]).float() if out else None
            if counts is not None:
                logits -= counts * 1.3 + (counts > 0).float() * 0.7
            nxt = int(logits.argmax())
            out.append(nxt)
            ids.append(nxt)
    assert ours.token_ids == out


def test_top_k_1_is_greedy_and_temperature_sampling_varies(tiny):
    llm, _ = tiny
    prompt = _prompt(6)
    greedy = _greedy(llm, prompt).outputs[0].token_ids
    topk1 = _greedy(llm, prompt, temperature=1.0, top_k=1, seed=3).outputs[0].token_ids
    assert topk1 == greedy
    samples = {tuple(_greedy(llm, prompt, temperature=1.5, seed=s).outputs[0].token_ids)
               for s in range(4)}
    assert len(samples) > 1


def test_async_engine_streams_and_cancel_frees_blocks(tiny):
    llm, _ = tiny
    reference = _greedy(llm, _prompt(7), max_tokens=20).outputs[0].token_ids
    engine = AsyncLLMEngine(llm.engine)  # from here on only the engine thread steps
    try:
        async def main():
            params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            deltas, final = [], None
            async for out in engine.generate(_prompt(7), params, "s1"):
                deltas.append(out.delta_text)
                final = out
            assert final.finished and "".join(deltas) == final.outputs[0].text
            assert final.outputs[0].token_ids == reference

            long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            stream = engine.generate(_prompt(8), long, "s2")
            first = await stream.__anext__()
            assert not first.finished
            await stream.aclose()  # the client went away
            for _ in range(100):
                if llm.engine.kv.usage() == 0.0 and not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert llm.engine.kv.usage() == 0.0

        asyncio.run(main())
    finally:
        engine.shutdown()
