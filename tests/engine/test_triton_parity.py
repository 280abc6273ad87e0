"""With the Triton backend (and fused Triton ops; under the interpreter on the CPU), greedy
tokens equal transformers' on the same device — through chunked prefill, a prefill chunk after
a cached prefix and mixed prefill/decode batches: for the bundled SmolLM2 (where installed)
and a tiny random Llama built at test time (everywhere, the GPU image too). Interpreter steps
are slow: three prompts, three tokens each, five steps."""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tests.engine.test_hf_parity import CHATS, DEVICE, RAW_PROMPTS, _hf_greedy
from tests.engine.utils import make_tiny_model_dir

MAX_NEW = 3
# block 16, 25 tokens a step: the first chat prompt (40 tokens) is chunked beside the short
# prompt's decodes; the second chat shares its first block (24 common tokens); eager on a GPU
# too (decode graphs are test_cuda_graphs.py's)
ENGINE = {"attention_backend": "triton", "dtype": "float32", "block_size": 16,
          "num_kv_blocks": 32, "max_num_batched_tokens": 25, "enforce_eager": True}


def _check(llm: LLM, model, prompts: list[list[int]], monkeypatch) -> None:
    engine = llm.engine
    assert engine.runner.backend.name == "triton" and engine.runner.graphs is None
    assert [len(p) for p in prompts] == [5, 40, 39] and prompts[1][:24] == prompts[2][:24]
    refs = [_hf_greedy(model, p)[:MAX_NEW] for p in prompts]

    layouts = []
    build = engine.runner.backend.build_metadata

    def recording(layout, *args, **kw):
        layouts.append((layout.num_decodes, list(layout.query_lens), list(layout.seq_lens)))
        return build(layout, *args, **kw)

    monkeypatch.setattr(engine.runner.backend, "build_metadata", recording)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine.add_request("short", prompts[0], params)
    engine.add_request("chat-a", prompts[1], params)
    done: dict[str, list[int]] = {}
    steps = 0
    while len(done) < 3:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 2:  # chat-a's prompt is cached by now
            engine.add_request("chat-b", prompts[2], params)
        assert steps < 20
    assert [done["short"], done["chat-a"], done["chat-b"]] == refs
    assert engine.stats().prefix_cache_hits > 0
    # step 2: short's decode beside chat-a's second chunk; step 3: two decodes beside
    # chat-b's chunk after its cached first block (positions 16..38); then decodes only,
    # sorted by context length
    assert layouts == [(0, [5, 20], [5, 20]), (1, [1, 20], [6, 40]),
                       (2, [1, 1, 23], [7, 41, 39]), (2, [1, 1], [40, 42]), (1, [1], [41])]


@pytest.mark.slow
def test_triton_backend_greedy_tokens_match_transformers(hf_reference, monkeypatch):
    model, _ = hf_reference
    llm = LLM(**ENGINE)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(RAW_PROMPTS[0])] + [
        tok.encode(tok.apply_chat_template(c, add_generation_prompt=True),
                   add_special_tokens=False) for c in (CHATS[0], CHATS[2])]
    _check(llm, model, prompts, monkeypatch)


def test_triton_backend_greedy_tokens_match_transformers_on_a_tiny_model(tmp_path,
                                                                         monkeypatch):
    """The same steps on the engine's device (the GPU check runs this one): prompts of the
    bundled run's lengths, the last two sharing 24 tokens."""
    model = make_tiny_model_dir(tmp_path, "llama", seed=13, tokenizer="trained").to(DEVICE)
    llm = LLM(str(tmp_path), device=str(DEVICE), **ENGINE)
    rng = random.Random(13)
    ids = [rng.randrange(3, model.config.vocab_size) for _ in range(5 + 40 + 15)]
    prompts = [ids[:5], ids[5:45], ids[5:29] + ids[45:]]
    _check(llm, model, prompts, monkeypatch)
