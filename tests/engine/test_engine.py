"""Engine behaviour on small random-weight models of each family (fast, exact)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError, QueueFullError

from .utils import make_tiny_model_dir

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(20)]
    out = []
    for i in range(n):
        body = [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]
        out.append(shared + body if i % 2 else body)  # half share a 20-token prefix
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model_dir(path, request.param)
    return request.param, str(path), model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run(path: str, prompts, max_tokens=12, **engine_args):
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20, **engine_args)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "pure-torch"])
def test_matches_transformers_greedy(tiny, native):
    family, path, model = tiny
    prompts = _prompts(6)
    # mistral: 60+40 tokens cross its window of 24
    ours, llm = _run(path, prompts, max_tokens=40, native_kernels=native)
    assert llm.engine.model.layers[0].self_attn.backend.name == ("cpu" if native else "torch")
    assert ours == [_hf_greedy(model, p, 40) for p in prompts]


@pytest.mark.parametrize("chunk,cap", [(1, 0), (7, 0), (64, 0), (64, 5)])
def test_chunk_size_and_prefix_caching_do_not_change_outputs(tiny, chunk, cap):
    _, path, _ = tiny
    prompts = _prompts(5, seed=1)
    ref, _ = _run(path, prompts, max_num_batched_tokens=4096, enable_prefix_caching=False)
    got, llm = _run(path, prompts, max_num_batched_tokens=chunk, enable_prefix_caching=True,
                    long_prefill_token_threshold=cap)
    assert got == ref
    again = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))  # warm cache
    assert [o.outputs[0].token_ids for o in again] == ref
    assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.kv.usage() == 0.0


def test_forced_preemption_keeps_outputs(tiny):
    family, path, _ = tiny
    prompts = _prompts(8, seed=2, lo=20, hi=40)
    ref, _ = _run(path, prompts, max_tokens=30)
    # 32 blocks of 4 tokens: ~2 requests fit at once, the rest are preempted and recomputed
    # (mistral frees the blocks behind its window of 24: 16 blocks, chunks of 16)
    small = (dict(num_kv_blocks=16, max_num_batched_tokens=16) if family == "mistral"
             else dict(num_kv_blocks=32))
    got, llm = _run(path, prompts, max_tokens=30, **small)
    assert llm.engine.stats().num_preemptions > 0
    assert got == ref


def test_prompt_logprobs_survive_preemption_once(tiny):
    """A preempted request recomputes its prompt; the prompt logprobs it already emitted are
    not emitted again, and the rest equal an unpressured run's."""
    _, path, _ = tiny
    prompts = _prompts(8, seed=7, lo=20, hi=40)
    params = SamplingParams(max_tokens=30, prompt_logprobs=2, **GREEDY)

    def run(**engine_args):
        llm = LLM(path, block_size=4, kv_cache_memory=64 << 20, **engine_args)
        return llm.generate(prompts, params), llm

    ref, _ = run()
    got, llm = run(num_kv_blocks=32, max_num_batched_tokens=24)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, g, r in zip(prompts, got, ref, strict=True):
        assert len(g.prompt_logprobs) == len(prompt) == len(r.prompt_logprobs)
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert set(a) == set(b)
            assert all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)


def test_seeded_sampling_same_alone_and_in_batch(tiny):
    _, path, _ = tiny
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20)
    prompts = _prompts(6, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate(prompts, [params] + [others] * 5)
    assert batch[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99,
                                ignore_eos=True)
    assert llm.generate([prompts[0]], other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_share_prompt_blocks(tiny):
    _, path, _ = tiny
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20)
    prompt = _prompts(1, seed=4, lo=40, hi=40)[0]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7,
                                                ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    # queries: 3 samples x 40 prompt tokens; samples 2 and 3 hit the 9 full blocks of sample 1
    assert llm.engine.kv.prefix_hits == 2 * 9 * 4


def test_bad_input_is_rejected_with_the_field_named(tiny):
    _, path, _ = tiny
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20, max_model_len=128, max_waiting=2)
    eng = llm.engine
    cases = [
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**9], SamplingParams(), "prompt"),
        (list(range(100, 228)), SamplingParams(), "prompt"),  # 128 tokens: no room left
        (list(range(100, 200)), SamplingParams(max_tokens=29), "max_tokens"),
    ]
    for prompt, params, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            eng.add_request("bad", prompt, params)
        assert info.value.param == field
    for field, kwargs in [("temperature", dict(temperature=-1)), ("top_p", dict(top_p=0)),
                          ("top_p", dict(top_p=1.5)), ("logprobs", dict(logprobs=21)),
                          ("n", dict(n=0)), ("max_tokens", dict(max_tokens=0)),
                          ("min_tokens", dict(min_tokens=5, max_tokens=2)),
                          ("stop", dict(stop=[""]))]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == field
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    eng.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        eng.add_request("c", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    # the valid ones still complete
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].finish_reason
    assert done == {"a": "length", "b": "length"}


def test_failing_step_fails_only_its_requests(tiny, monkeypatch):
    _, path, _ = tiny
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20)
    eng = llm.engine
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    real = eng.runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(sched)

    monkeypatch.setattr(eng.runner, "execute", flaky)
    outs = eng.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "error"
    assert eng.kv.usage() == 0.0
    eng.add_request("y", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[-1].request_id == "y" and outs[-1].outputs[0].finish_reason == "length"


def test_abort_frees_blocks(tiny):
    _, path, _ = tiny
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20)
    eng = llm.engine
    eng.add_request("z", list(range(100, 150)), SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    assert eng.kv.usage() > 0
    assert eng.abort_request("z")
    assert eng.kv.usage() == 0.0
    outs = eng.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()
