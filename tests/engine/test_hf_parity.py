"""Greedy continuations equal transformers' greedy `generate`, on the engine's device: for the
bundled SmolLM2 (where it is installed; the GPU image has no room for it) and for a tiny random
Llama whose tokenizer is trained at test time (everywhere, CPU and CUDA)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.kv_cache.manager import cdiv
from tests.engine.utils import make_tiny_model_dir

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to German: 'Good morning, how are you?'",
]
CHATS = [
    [{"role": "user", "content": "What is the boiling point of water in Fahrenheit?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about paged attention."}],
]
MAX_NEW = 24
TINY_BLOCK = 4


def _hf_greedy(model, ids: list[int]) -> list[int]:
    """transformers' greedy continuation, on the device the model is on."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=device),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                       device=device),
                             max_new_tokens=MAX_NEW, do_sample=False, num_beams=1,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _prompts(llm: LLM, hf_tok) -> list[list[int]]:
    """RAW_PROMPTS and CHATS as token ids; the chat template renders as transformers' does."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in RAW_PROMPTS]
    for chat in CHATS:
        text = tok.apply_chat_template(chat, add_generation_prompt=True)
        ref_text = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text == ref_text
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts


@dataclass
class Case:
    """An engine, its prompts, transformers' continuations, and the engine args of a small
    run: chunks of 7 tokens and a KV pool that holds the longest request but not two."""

    llm: LLM
    prompts: list[list[int]]
    refs: list[list[int]]
    small: dict[str, Any]


@pytest.fixture(scope="module")
def bundled_case(real_llm, hf_reference) -> Case:
    model, hf_tok = hf_reference
    prompts = _prompts(real_llm, hf_tok)
    # the longest request needs 5 blocks of 16; 6 blocks cannot hold two chat requests at once
    small = {"dtype": "float32", "block_size": 16, "num_kv_blocks": 6,
             "max_num_batched_tokens": 7}
    return Case(real_llm, prompts, [_hf_greedy(model, p) for p in prompts], small)


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory) -> Case:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-parity")
    model = make_tiny_model_dir(path, "llama", seed=11, tokenizer="trained").to(DEVICE)
    args = {"dtype": "float32", "device": str(DEVICE), "max_num_seqs": 16}
    llm = LLM(str(path), block_size=TINY_BLOCK, num_kv_blocks=256, **args)
    prompts = _prompts(llm, AutoTokenizer.from_pretrained(str(path)))
    longest = max(cdiv(len(p) + MAX_NEW, TINY_BLOCK) for p in prompts)
    small = {**args, "model": str(path), "block_size": TINY_BLOCK,
             "num_kv_blocks": longest + 1, "max_num_batched_tokens": 7}
    return Case(llm, prompts, [_hf_greedy(model, p) for p in prompts], small)


@pytest.fixture(params=[pytest.param("bundled", marks=pytest.mark.slow), "tiny"])
def case(request) -> Case:
    return request.getfixturevalue(f"{request.param}_case")


def test_greedy_matches_transformers_one_at_a_time(case):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for prompt, ref in zip(case.prompts, case.refs, strict=True):
        out = case.llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == ref


def test_greedy_matches_transformers_in_one_mixed_batch(case):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = case.llm.generate(case.prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == case.refs
    assert [o.prompt_token_ids for o in outs] == case.prompts


def test_chunking_prefix_cache_and_preemption_keep_real_model_outputs(case):
    """Chunks of 7 tokens, a warm prefix cache and a KV pool too small for the batch."""
    llm = LLM(**case.small)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(case.prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == case.refs
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().prefix_cache_hits > 0  # the chat prompts share their start


# bfloat16 greedy choices may differ from transformers' bfloat16 ones only where float32's
# two best tokens are within this many nats: both round activations to bfloat16, in
# different places (measured on a Zen 4 EPYC, 2026-12-06: 5 of 8 prompts equal for all 24
# tokens, the others parting at gaps of 0.005, 0.081 and 0.247 nats)
NEAR_TIE = 0.5


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@pytest.mark.slow
def test_bfloat16_greedy_matches_transformers_bfloat16_up_to_near_ties(bundled_case,
                                                                        hf_reference):
    """The bundled model with `dtype="bfloat16"` (bfloat16 weights, activations and KV
    cache; float32 accumulation in the linears and attention) against transformers' own
    bfloat16 forward: each prompt's greedy continuation equals transformers', or first
    parts from it at a near-tie, where both chosen tokens are float32's top two and within
    `NEAR_TIE` nats of each other."""
    model, _ = hf_reference
    hf16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(dtype="bfloat16", kv_cache_memory=256 << 20, max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(bundled_case.prompts, params)
    equal = 0
    for prompt, out in zip(bundled_case.prompts, outs, strict=True):
        got, ref = list(out.outputs[0].token_ids), _hf_greedy(hf16, prompt)
        k = _prefix(got, ref)
        if k == MAX_NEW:
            equal += 1
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ref[:k]])).logits[0, -1]
        top = logits.double().log_softmax(-1).topk(2)
        gap = float(top.values[0] - top.values[1])
        print(f"parted at token {k}: engine {got[k]}, transformers {ref[k]}, float32 top two "
              f"{top.indices.tolist()} {gap:.3f} nats apart")
        assert {got[k], ref[k]} == set(top.indices.tolist())
        assert gap <= NEAR_TIE
    print(f"bfloat16: {equal} of {len(outs)} continuations equal transformers' bfloat16")
    assert equal >= len(outs) // 2
