"""Draft-model and EAGLE speculation under tensor parallelism (vLLM's
`draft_tensor_parallel_size=1`): the proposer runs on rank 0 alone, unsharded, while the
target runs sharded on every rank; greedy tokens equal TP = 1's with the same proposer, and
the proposals themselves are the same (equal draft and accepted counts).

The proposer never gets rank 0's shard: its embedding and LM head are vocabulary slices
whose collectives the other ranks would not join, so a proposer calling them would hang
the engine. `ProposerContext` refuses a sharded target outright."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.llm import LLM
from tandem.engine.model.loader import load_model
from tandem.engine.parallel.tp import TPGroup, TPPlan, wrap_tp
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode import ProposerContext, SpeculativeConfig
from tandem.engine.spec_decode.target import load_heads, sharded_modules
from tests.engine.utils import make_tiny_model_dir

CPU = torch.device("cpu")
SHAPE = dict(hidden_size=96, intermediate_size=192, num_attention_heads=12,
             num_key_value_heads=6)
ENGINE = dict(block_size=4, num_kv_blocks=80, max_num_batched_tokens=48, num_threads=1,
              max_model_len=128)
# adaptive off: every decode-ready request proposes k tokens, however poor the proposer
EAGLE = {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False}
# the bundled model's first 20 of 30 layers: some drafts accepted, most rejected
DRAFT = {"method": "draft", "model": "self", "draft_num_layers": 20,
         "num_speculative_tokens": 3, "adaptive": False}
BUNDLED = dict(num_kv_blocks=64, max_model_len=256, num_threads=1)


def _run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list, tuple[int, int]]:
    """Greedy token ids, and (draft tokens, accepted tokens); the engine shut down."""
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    return got, (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)


def test_bundled_model_tp3_with_a_draft_model_matches_tp1() -> None:
    """The draft (the bundled model's own first layers) is a view of the target at TP = 1;
    at TP = 3 rank 0 loads it again, whole, beside its third of the target."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Tensor parallelism splits"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    one = LLM(speculative_config=DRAFT, **BUNDLED)
    assert one.engine.speculator.proposer.shared
    ref, ref_spec = _run(one, prompts, params)
    llm = LLM(tensor_parallel_size=3, speculative_config=DRAFT, **BUNDLED)
    draft = llm.engine.speculator.proposer
    got, spec = _run(llm, prompts, params)
    assert got == ref
    assert spec == ref_spec and spec[0] > spec[1] > 0, spec  # the same drafts, some accepted
    assert not draft.shared and sharded_modules(draft.model) == []
    assert draft.model.config.num_layers == 20 and draft.model.config.vocab_size == 49152


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp_spec") / "tiny"
    make_tiny_model_dir(path, "llama", seed=5, **SHAPE)
    return str(path)


def test_eagle_head_at_tp2_matches_tp1(tiny: str) -> None:
    """A random EAGLE head (seeded: the same at both sizes) chains through the target's
    embedding and LM head: at TP = 2 an unsharded copy on rank 0, never the shards."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 4000) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref, ref_spec = _run(LLM(tiny, speculative_config=EAGLE, **ENGINE), prompts, params)
    llm = LLM(tiny, tensor_parallel_size=2, speculative_config=EAGLE, **ENGINE)
    eagle = llm.engine.speculator.proposer
    got, spec = _run(llm, prompts, params)
    assert got == ref
    assert spec == ref_spec and spec[0] > 0, spec
    assert type(eagle.embed_tokens) is nn.Embedding and type(eagle.lm_head) is nn.Linear
    assert eagle.embed_tokens.num_embeddings == eagle.lm_head.out_features == 49152
    assert eagle.lm_head.weight is eagle.embed_tokens.weight  # tied, as the checkpoint is


def test_unsharded_heads_are_the_checkpoints(tiny: str, tmp_path) -> None:
    """`load_heads`: the embedding and LM head as the checkpoint has them, tied or not."""
    untied = tmp_path / "untied"
    make_tiny_model_dir(untied, "qwen2", seed=3, vocab_size=512)
    for path in (tiny, untied):
        weights = load_model(path).weights
        heads = load_heads(path, CPU, torch.float32)
        assert torch.equal(heads.embed_tokens.weight, weights["model.embed_tokens.weight"])
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        assert torch.equal(heads.lm_head.weight, head)
        assert (heads.lm_head.weight is heads.embed_tokens.weight) == (path == tiny)
        assert heads.config.vocab_size == head.shape[0]


def test_a_sharded_target_never_reaches_a_proposer(tiny: str) -> None:
    """Rank 0's shard (vocabulary-parallel embedding and LM head, row-parallel layers) is
    refused by `ProposerContext`, before any proposer could call into it."""
    model, _ = _tiny_model(tiny)
    cfg = SpeculativeConfig(method="eagle")
    ProposerContext(cfg, None, model, tiny, CPU, torch.float32, 49152, 4, 128, 4)  # whole
    wrap_tp(model, TPPlan.build(model.config, 0, 2), TPGroup(2))  # no collective runs
    assert sharded_modules(model)
    with pytest.raises(ValueError, match="tensor-parallel shard"):
        ProposerContext(cfg, None, model, tiny, CPU, torch.float32, 49152, 4, 128, 4)


def _tiny_model(path: str):  # noqa: ANN202 - (LlamaForCausalLM, AttentionBackend)
    from tandem.engine.spec_decode.draft_runner import load_model as load_draft

    return load_draft(path, EngineConfig(model=path, device="cpu", dtype="float32"), CPU,
                      torch.float32, 128, 4)


@pytest.mark.parametrize("value", [2, 0, True, 1.0, "1"])
def test_draft_tensor_parallel_size_other_than_one_is_refused(value) -> None:
    spec = {"method": "draft", "model": "self", "draft_tensor_parallel_size": value}
    with pytest.raises(ConfigError, match=r"^speculative_config\.draft_tensor_parallel_size "
                                          r"must be 1 or null, got .*: draft models run "
                                          r"unsharded on rank 0$"):
        EngineConfig(tensor_parallel_size=2, speculative_config=spec)


def test_draft_tensor_parallel_size_one_is_accepted_with_any_tp() -> None:
    for tp in (1, 2):
        for method in ("draft", "eagle"):
            spec = {"method": method, "draft_tensor_parallel_size": 1,
                    **({"model": "self"} if method == "draft" else {})}
            cfg = EngineConfig(tensor_parallel_size=tp, speculative_config=spec)
            assert cfg.speculative_config.draft_tensor_parallel_size == 1
