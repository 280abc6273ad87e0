"""Greedy continuations equal transformers' greedy `generate`, on the engine's device: for the
bundled SmolLM2 (where it is installed; the GPU image has no room for it) and for a tiny random
Llama whose tokenizer is trained at test time (everywhere, CPU and CUDA)."""

from __future__ import annotations

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
