"""Prompt logprobs stay within what the memory profile reserves: at most
`prompt_logprobs_rows` prompt positions per step (the scheduler shortens chunks), and the
profiling step computes that many rows' float32 log-softmax beside the sampled rows."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine import memory, scheduler
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler import Scheduler, prompt_logprobs_rows

from .utils import finish_step, make_request, make_tiny_model_dir


def _rows(s) -> int:
    """Prompt-logprobs rows a scheduled chunk computes (as the model runner counts them)."""
    req = s.request
    if req.prompt_logprobs_pos is None:
        return 0
    first = max(s.start, req.prompt_logprobs_pos)
    return max(0, min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1) - first)


def _run(sched: Scheduler, reqs) -> list[list[tuple[str, int, int]]]:
    """Steps until every request finishes; each step's (request, start, tokens), with the
    prompt-logprobs rows it computes checked against the bound."""
    steps = []
    while not all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs):
        out = sched.schedule()
        rows = [(s.request, _rows(s)) for s in out.scheduled]
        assert out.scheduled and sum(n for _, n in rows) <= sched.max_prompt_logprobs_rows
        finish_step(sched, out)
        for req, n in rows:
            req.advance_prompt_logprobs(n)
        steps.append([(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled])
        assert len(steps) < 100
    return steps


def test_the_bound_is_the_larger_of_max_num_seqs_and_256_within_the_budget():
    assert prompt_logprobs_rows(8, 1024) == 256
    assert prompt_logprobs_rows(512, 8192) == 512
    assert prompt_logprobs_rows(8, 100) == 100


def test_a_steps_prompt_logprobs_rows_are_bounded_across_its_requests():
    kv = KVCacheManager(num_blocks=512, block_size=4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1024)
    a = make_request(list(range(700)), max_tokens=1, request_id="a", prompt_logprobs=0)
    b = make_request(list(range(300)), max_tokens=1, request_id="b", prompt_logprobs=2)
    c = make_request(list(range(100)), max_tokens=1, request_id="c")
    for r in (a, b, c):
        sched.add_request(r)
    steps = _run(sched, [a, b, c])
    # a takes the step's 256 rows; b (asking too) waits, c (not asking) runs beside a
    assert steps[0] == [("a", 0, 256), ("c", 0, 100)]
    assert steps[1] == [("a", 256, 256)]
    assert steps[2] == [("a", 512, 188), ("b", 0, 69)]  # a: 187 rows, b: the 69 left
    assert steps[3] == [("b", 69, 231)]
    assert a.prompt_logprobs_pos is None and b.prompt_logprobs_pos is None


def test_without_prompt_logprobs_chunks_are_not_shortened():
    kv = KVCacheManager(num_blocks=512, block_size=4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1024)
    a = make_request(list(range(700)), max_tokens=1, request_id="a")
    sched.add_request(a)
    assert _run(sched, [a]) == [[("a", 0, 700)]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plp")
    make_tiny_model_dir(path, "llama", tokenizer="trained")
    return str(path)


def test_bounded_steps_give_the_same_prompt_logprobs(tiny_path, monkeypatch):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (150, 90)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)

    def run(min_rows: int):
        monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_MIN_ROWS", min_rows)
        llm = LLM(tiny_path, block_size=4, kv_cache_memory=32 << 20, max_num_seqs=2,
                  max_num_batched_tokens=256, enable_prefix_caching=False)
        sched = llm.engine.scheduler
        schedule, rows = sched.schedule, []

        def counted():
            out = schedule()
            rows.append(sum(_rows(s) for s in out.scheduled))
            return out

        sched.schedule = counted
        return llm.generate(prompts, params), rows, sched.max_prompt_logprobs_rows

    ref, ref_rows, big = run(256)
    got, rows, bound = run(32)
    assert (big, bound) == (256, 32)
    assert max(ref_rows) == 238 and max(rows) == 32 and sum(rows) == sum(ref_rows) == 238
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(r.prompt_logprobs) == len(r.prompt_token_ids)
        for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert set(a) == set(b)
            assert all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)


def test_the_profiling_step_computes_the_bounded_prompt_logprobs_rows(tiny_path, monkeypatch):
    llm = LLM(tiny_path, block_size=4, kv_cache_memory=32 << 20, max_num_seqs=4,
              max_num_batched_tokens=512)
    runner = llm.engine.runner
    seen = []
    real = memory.prompt_logprobs_work

    def spy(logits, k=20):
        seen.append(tuple(logits.shape))
        return real(logits, k)

    monkeypatch.setattr(memory, "prompt_logprobs_work", spy)
    # profile_peak reads CUDA's allocator: here only the step it profiles runs
    monkeypatch.setattr(memory, "profile_peak",
                        lambda run, device: run() is None or memory.ProfileResult(0, None))
    memory.profile_steps(runner.model, runner.backend, len(llm.engine.model.layers), 512, 4,
                         512, torch.device("cpu"), runner.sampler)
    vocab = llm.engine.state.vocab_size
    assert seen == [(prompt_logprobs_rows(4, 512), vocab)] == [(256, vocab)]
    layout = memory.dummy_layout(300, 512, runner.backend.block_size)
    caches = [runner.backend.allocate_kv_cache(1) for _ in llm.engine.model.layers]
    logits = memory.dummy_step(runner.model, runner.backend, caches, layout, 4,
                               torch.device("cpu"), runner.sampler, 296)
    assert logits.shape == (300, vocab) and seen[-1] == (296, vocab)  # 4 + 296 = all 300
    lp = memory.prompt_logprobs_work(logits[:3].to(torch.bfloat16))
    assert lp.dtype == torch.float32 and torch.allclose(lp.exp().sum(-1), torch.ones(3))
