"""Every architecture against transformers: a tiny random-weight model of each family is
built with transformers here (2-3 layers, a sharded checkpoint with an index, the trained
test tokenizer), with settings that exercise what is distinctive about it (rope scaling,
q/k norms, fused checkpoint tensors, partial rotary dims, windows shorter than the prompts).
The engine's greedy tokens equal transformers' greedy `generate` and its prompt logprobs are
within float32 tolerance: one request at a time, then all in one batch through a KV pool
too small for them (preemption) with chunked prefill, then again (prefix-cache hits); a
tensor-parallel (TP = 2) engine with n-gram speculation gives the same greedy tokens.

To add a family: write a `_make_<name>()` returning the transformers model (seeded, small,
`initializer_range` wide enough for clear argmax winners) and add one `CASES` entry; the
fixtures and tests below run it. Also see test_model_registry.py for config-level tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.engine.kv_cache.manager import cdiv
from tests.engine.utils import TINY_VOCAB, write_tiny_tokenizer

BLOCK = 4
MAX_NEW = 12
SHAPE = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             initializer_range=0.1, bos_token_id=1, eos_token_id=2)


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights (ones at init) drawn around 1, so that a misplaced norm shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def _make_llama3() -> tuple[transformers.PreTrainedModel, dict]:
    """Llama 3.1-style `llama3` rope scaling; config.json written with the legacy keys
    (`rope_theta`, `rope_scaling`) real hub checkpoints carry."""
    cfg = transformers.LlamaConfig(
        **SHAPE, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})
    legacy = {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}
    return transformers.LlamaForCausalLM(cfg), legacy


def _make_llama_yarn() -> tuple[transformers.PreTrainedModel, dict]:
    cfg = transformers.LlamaConfig(
        **SHAPE, max_position_embeddings=256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64})
    return transformers.LlamaForCausalLM(cfg), {}


def _make_mistral() -> tuple[transformers.PreTrainedModel, dict]:
    cfg = transformers.MistralConfig(**SHAPE, max_position_embeddings=256, sliding_window=7,
                                     head_dim=16, tie_word_embeddings=False)
    return transformers.MistralForCausalLM(cfg), {}


def _make_qwen2() -> tuple[transformers.PreTrainedModel, dict]:
    """q/k/v biases; layer 0 full attention, layer 1 in a window of 9 (`max_window_layers`)."""
    cfg = transformers.Qwen2Config(**SHAPE, max_position_embeddings=256,
                                   use_sliding_window=True, sliding_window=9,
                                   max_window_layers=1, tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(cfg), {}


def _make_qwen3() -> tuple[transformers.PreTrainedModel, dict]:
    """q/k norms, a head_dim (24) independent of hidden / heads (16)."""
    cfg = transformers.Qwen3Config(**SHAPE, head_dim=24, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(cfg), {}


def _longrope(dims: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [round(1 + rng.random() * 3, 3) for _ in range(dims // 2)],
            "long_factor": [round(2 + rng.random() * 8, 3) for _ in range(dims // 2)]}


def _make_phi3() -> tuple[transformers.PreTrainedModel, dict]:
    """Fused qkv / gate_up checkpoint tensors; longrope with an attention factor (the
    context extended 4x: sqrt(1 + ln 4 / ln 64)); prompts stay in the original context."""
    cfg = transformers.Phi3Config(**SHAPE, max_position_embeddings=256,
                                  original_max_position_embeddings=64,
                                  rope_parameters=_longrope(16, 1), tie_word_embeddings=False,
                                  pad_token_id=0)
    return transformers.Phi3ForCausalLM(cfg), {}


def _make_phi4_mini() -> tuple[transformers.PreTrainedModel, dict]:
    """Phi-4-mini's layout: partial rotary dims (0.75 of 16), tied embeddings, longrope."""
    cfg = transformers.Phi3Config(**SHAPE, max_position_embeddings=256,
                                  original_max_position_embeddings=64,
                                  partial_rotary_factor=0.75,
                                  rope_parameters={**_longrope(12, 2),
                                                   "partial_rotary_factor": 0.75},
                                  tie_word_embeddings=True, pad_token_id=0)
    return transformers.Phi3ForCausalLM(cfg), {}


def _make_gemma3() -> tuple[transformers.PreTrainedModel, dict]:
    """Gemma 3 text: sliding layers (window 6, shorter than every prompt) with their own
    RoPE base around a global layer with linear rope scaling; (1 + w) norms, q/k norms,
    four norms per layer, scaled embeddings, gelu-tanh, query_pre_attn_scalar 20 (not
    head_dim), tied embeddings. config.json with the legacy keys hub checkpoints carry
    (`sliding_window_pattern` 3: layer 2 of 0-3 global; `rope_local_base_freq`)."""
    sliding, full = "sliding_attention", "full_attention"
    cfg = transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 4}, head_dim=24, max_position_embeddings=256,
        sliding_window=6, layer_types=[sliding, sliding, full, sliding],
        query_pre_attn_scalar=20, pad_token_id=0, attn_implementation="eager",
        rope_parameters={sliding: {"rope_type": "default", "rope_theta": 1000.0},
                         full: {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}})
    legacy = {"layer_types": None, "sliding_window_pattern": 3, "rope_theta": 50000.0,
              "rope_local_base_freq": 1000.0, "rope_scaling": {"rope_type": "linear",
                                                               "factor": 4.0}}
    return transformers.Gemma3ForCausalLM(cfg), legacy


def _make_mixtral() -> tuple[transformers.PreTrainedModel, dict]:
    """Mixtral: every layer a mixture of 4 experts of 96, top-2 renormalised; checkpoint
    names `block_sparse_moe.experts.{e}.w1 / w2 / w3`."""
    cfg = transformers.MixtralConfig(**SHAPE, max_position_embeddings=256, num_local_experts=4,
                                     num_experts_per_tok=2, tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(cfg), {}


def _make_qwen3_moe() -> tuple[transformers.PreTrainedModel, dict]:
    """Qwen3-MoE: q/k norms, 4 experts of 32, top-2 without renormalisation
    (`norm_topk_prob` false), layer 1 of 3 dense (`mlp_only_layers`); config.json says
    `num_experts` as hub checkpoints do."""
    cfg = transformers.Qwen3MoeConfig(**{**SHAPE, "num_hidden_layers": 3}, head_dim=16,
                                      max_position_embeddings=256, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      norm_topk_prob=False, mlp_only_layers=[1],
                                      tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(cfg), {"num_experts": 4, "rope_theta": 10000.0}


@dataclass(frozen=True)
class Arch:
    """`make()` -> (transformers model, keys to overwrite in its saved config.json);
    `tp`: also the TP = 2 + n-gram run (once per family: it starts a rank process)."""

    make: Callable[[], tuple[transformers.PreTrainedModel, dict]]
    tp: bool = True
    # how its tokenizer adds BOS (`_bos_tokenizer`): "" never, "config" `add_bos_token` in
    # tokenizer_config.json (Gemma's), "post_processor" tokenizer.json's (Llama 3's)
    bos: str = ""
    # blocks of the same KV memory as one block of every layer: a hybrid model's block
    # (`kv_cache/groups.py`) covers `group_size` of its layers (Gemma 3 here: 1 of 4;
    # Qwen2's 1 of 2, plus a table's worth: its batch would evict every prefix a hit
    # needs in both groups)
    pool_scale: int = 1


CASES: dict[str, Arch] = {
    "llama3": Arch(_make_llama3, bos="post_processor"),
    "llama-yarn": Arch(_make_llama_yarn, tp=False),
    "mistral": Arch(_make_mistral),
    "qwen2": Arch(_make_qwen2, pool_scale=3),
    "qwen3": Arch(_make_qwen3),
    "phi3": Arch(_make_phi3, tp=False),
    "phi4-mini": Arch(_make_phi4_mini),
    "gemma3": Arch(_make_gemma3, bos="config", pool_scale=4),
    "mixtral": Arch(_make_mixtral, tp=False),
    "qwen3-moe": Arch(_make_qwen3_moe),
}


def _prompts(seed: int) -> list[list[int]]:
    """Four prompts of 14-27 tokens, two sharing a 9-token start, one a repeated motif (for
    the n-gram proposer)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(9)]
    motif = [rng.randrange(3, TINY_VOCAB) for _ in range(5)]
    return [shared + [rng.randrange(3, TINY_VOCAB) for _ in range(12)],
            [rng.randrange(3, TINY_VOCAB) for _ in range(14)],
            shared + [rng.randrange(3, TINY_VOCAB) for _ in range(18)],
            motif * 5 + [motif[0]]]


@dataclass
class Case:
    name: str
    path: str
    prompts: list[list[int]]
    greedy: list[list[int]]  # transformers' greedy continuations
    prompt_logprobs: list[list[float]]  # transformers' logprob of each prompt token (from 1)


def _reference(model: transformers.PreTrainedModel, prompts: list[list[int]]
               ) -> tuple[list[list[int]], list[list[float]]]:
    greedy, logprobs = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                                 do_sample=False, num_beams=1, eos_token_id=None,
                                 pad_token_id=0)
            greedy.append(out[0, len(ids):].tolist())
            lp = torch.log_softmax(model(x).logits[0].double(), dim=-1)
            logprobs.append([lp[i - 1, t].item() for i, t in enumerate(ids) if i])
    return greedy, logprobs


def _bos_tokenizer(path, how: str) -> None:
    """Make the tiny tokenizer add BOS (id 1) to a text prompt as the family's hub
    tokenizers do (tokenizer.json's post-processor; Gemma's tokenizer_config.json also says
    `add_bos_token`, Llama 3's has no such key), and its chat template open with
    `bos_token` as theirs do."""
    if not how:
        return
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}" + config["chat_template"]
    if how == "config":
        config["add_bos_token"] = True
    else:
        del config["add_bos_token"], config["add_eos_token"]
    tok = json.loads((path / "tokenizer.json").read_text())
    bos, a, b = config["bos_token"], {"id": "A", "type_id": 0}, {"id": "B", "type_id": 1}
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": a}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": a},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": b}],
        "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}}}
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps(config))


_BUILT: dict[str, Case] = {}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    return build_case(request.param, tmp_path_factory)


def build_case(name: str, tmp_path_factory: pytest.TempPathFactory) -> Case:
    """The family's checkpoint and transformers' outputs, built once per session (other
    modules' tests of every family reuse them)."""
    if name in _BUILT:
        return _BUILT[name]
    torch.manual_seed(7)
    model, config_keys = CASES[name].make()
    model = model.eval()
    _perturb_norms(model, 3)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()  # sharded, with an index
    if config_keys:
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        (path / "config.json").write_text(json.dumps({**cfg, **config_keys}))
    write_tiny_tokenizer(path, TINY_VOCAB)
    _bos_tokenizer(path, CASES[name].bos)
    prompts = _prompts(len(name))
    _BUILT[name] = Case(name, str(path), prompts, *_reference(model, prompts))
    return _BUILT[name]


def _params(prompt_logprobs: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=0 if prompt_logprobs else None)


def _check_prompt_logprobs(out, ids: list[int], ref: list[float]) -> None:
    got = [d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    assert got == pytest.approx(ref, abs=2e-4)


def test_matches_transformers_alone_and_in_a_preempted_prefix_cached_batch(case: Case) -> None:
    longest = max(cdiv(len(p) + MAX_NEW, BLOCK) for p in case.prompts)
    llm = LLM(case.path, dtype="float32", block_size=BLOCK,
              num_kv_blocks=(longest + 2) * CASES[case.name].pool_scale,
              max_num_batched_tokens=16, max_num_seqs=8, num_threads=1)
    for ids, ref, ref_lp in zip(case.prompts, case.greedy, case.prompt_logprobs, strict=True):
        out = llm.generate([ids], _params(prompt_logprobs=True))[0]
        assert out.outputs[0].token_ids == ref
        _check_prompt_logprobs(out, ids, ref_lp)
    for _ in range(2):  # the second round starts from cached prefixes
        outs = llm.generate(case.prompts, _params())
        assert [o.outputs[0].token_ids for o in outs] == case.greedy
    stats = llm.engine.stats()
    # the pool cannot hold the batch: requests are preempted, unless their out-of-window
    # blocks were freed instead (sliding-window models)
    assert stats.num_preemptions > 0 or stats.kv_window_freed_blocks > 0
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("case", [n for n, a in CASES.items() if a.tp], indirect=True)
def test_tensor_parallel_with_ngram_speculation_matches_transformers(case: Case) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(case.path, dtype="float32", block_size=BLOCK, num_kv_blocks=64,
              tensor_parallel_size=2, speculative_config=spec, num_threads=2)
    try:
        outs = llm.generate(case.prompts, _params())
        drafts = llm.engine.stats().spec_num_draft_tokens
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == case.greedy
    assert drafts > 0



def test_phi3_lora_adapter_on_fused_modules_matches_the_merged_model(tmp_path) -> None:
    """A PEFT adapter trained on Phi-3 targets its fused `qkv_proj` and `gate_up_proj`: a
    request with it gives the greedy tokens of transformers on the merged weights."""
    from tandem import LoRARequest
    from tests.engine.utils import make_peft_adapter, merge_adapter

    torch.manual_seed(7)
    model, _ = _make_phi3()
    _perturb_norms(model.eval(), 3)
    base, adapter, merged = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    model.save_pretrained(base, max_shard_size="100KB")
    write_tiny_tokenizer(base, TINY_VOCAB)
    weights = make_peft_adapter(adapter, json.loads((base / "config.json").read_text()),
                                rank=4, alpha=8.0, std=0.2,
                                targets=("qkv_proj", "gate_up_proj", "o_proj", "down_proj"))
    merge_adapter(base, merged, weights, 8.0 / 4)
    prompts = _prompts(5)[:2]
    want, _ = _reference(transformers.Phi3ForCausalLM.from_pretrained(merged).eval(), prompts)
    plain, _ = _reference(model, prompts)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4, num_threads=1)
    lora = LoRARequest("phi", 1, str(adapter))
    got = llm.generate(prompts, _params(), lora_request=lora)
    assert [o.outputs[0].token_ids for o in got] == want
    assert want != plain  # the adapter changes the output; without it, the base model's
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _params())] == plain


@pytest.mark.parametrize("case", ["qwen3", "phi4-mini"], indirect=True)
def test_draft_model_speculation_matches_transformers(case: Case) -> None:
    """The draft model is built through the registry too (here the model drafts for
    itself: every draft accepted)."""
    spec = {"method": "draft", "model": case.path, "num_speculative_tokens": 3,
            "adaptive": False}
    llm = LLM(case.path, dtype="float32", block_size=BLOCK, speculative_config=spec,
              num_threads=1)
    outs = llm.generate(case.prompts, _params())
    assert [o.outputs[0].token_ids for o in outs] == case.greedy
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
