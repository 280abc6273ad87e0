"""Greedy continuations of the bundled SmolLM2 equal transformers' greedy `generate`."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams

pytestmark = pytest.mark.slow

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


def _hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=MAX_NEW, do_sample=False,
                             num_beams=1, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def prompts_and_refs(real_llm, hf_reference):
    model, hf_tok = hf_reference
    tok = real_llm.get_tokenizer()
    prompts = [tok.encode(p) for p in RAW_PROMPTS]
    for chat in CHATS:
        text = tok.apply_chat_template(chat, add_generation_prompt=True)
        ref_text = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text == ref_text
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts, [_hf_greedy(model, p) for p in prompts]


def test_greedy_matches_transformers_one_at_a_time(real_llm, prompts_and_refs):
    prompts, refs = prompts_and_refs
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for prompt, ref in zip(prompts, refs, strict=True):
        out = real_llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == ref


def test_greedy_matches_transformers_in_one_mixed_batch(real_llm, prompts_and_refs):
    prompts, refs = prompts_and_refs
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = real_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert [o.prompt_token_ids for o in outs] == prompts


def test_chunking_prefix_cache_and_preemption_keep_real_model_outputs(prompts_and_refs):
    """Chunks of 7 tokens, a warm prefix cache and a KV pool too small for the batch."""
    from tandem import LLM

    prompts, refs = prompts_and_refs
    # the longest request needs 5 blocks of 16; 6 blocks cannot hold two chat requests at once
    llm = LLM(dtype="float32", block_size=16, num_kv_blocks=6, max_num_batched_tokens=7)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().prefix_cache_hits > 0  # the chat prompts share a system prompt
