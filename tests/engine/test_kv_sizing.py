"""How many KV blocks an engine allocates, and the GPU's one-sequence check, for a model
whose every layer slides with one window: a sequence holds at most its window's blocks
(plus the pool's null block), not a full max_model_len's."""

from __future__ import annotations

import pytest

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model_build import check_sequence_fits, sequence_blocks

DIMS = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8)


def test_a_sliding_window_sequence_needs_its_windows_blocks_and_the_null_block():
    mistral = ModelArchConfig("mistral", sliding_window=4096, **DIMS)
    llama = ModelArchConfig("llama", **DIMS)
    mixed = ModelArchConfig("mistral", sliding_window=4096, layer_types=(
        "sliding_attention", "full_attention"), **DIMS)
    # window 4096, steps of up to 1024 tokens: cdiv(4096 + 1022, 16) + 1 = 321 blocks
    assert sequence_blocks(mistral, 131_072, 16, 1024) == (321, 1)
    assert sequence_blocks(mistral, 1000, 16, 1024) == (63, 1)  # shorter than the bound
    assert sequence_blocks(llama, 131_072, 16, 1024) == (8192, 0)
    assert sequence_blocks(mixed, 131_072, 16, 1024) == (8192, 0)  # a global layer: all


def test_the_gpu_check_counts_the_window_bound_and_the_null_block():
    need, null = sequence_blocks(ModelArchConfig("mistral", sliding_window=4096, **DIMS),
                                 131_072, 16, 1024)
    check_sequence_fits(need + null, need, null, 16, 131_072, 1 << 30)  # a 322-block pool
    with pytest.raises(ConfigError) as e:
        check_sequence_fits(need, need, null, 16, 131_072, 1 << 30)
    assert str(e.value) == (
        "the KV cache holds 5120 tokens (1.00 GiB), less than one max_model_len (131072) "
        "sequence needs; raise gpu_memory_utilization (or kv_cache_memory bytes) or lower "
        "max_model_len to at most 5120")
    check_sequence_fits(8192, 8192, 0, 16, 131_072, 1 << 30)  # full attention: every block
    with pytest.raises(ConfigError, match="holds 131056 tokens"):
        check_sequence_fits(8191, 8192, 0, 16, 131_072, 1 << 30)


def test_the_cpu_pool_is_capped_at_max_num_seqs_windows(tmp_path):
    """A byte budget far above need: the pool is max_num_seqs window bounds plus the null
    block (not max_num_seqs full-length sequences), and a prompt longer than the usable
    blocks cover still runs."""
    from tandem import LLM, SamplingParams
    from tests.engine.utils import make_tiny_model_dir

    make_tiny_model_dir(tmp_path, "mistral", seed=2, sliding_window=8)  # 512 positions
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, max_num_seqs=3,
              max_num_batched_tokens=16, kv_cache_memory=1 << 30, enforce_eager=True)
    # per sequence min(cdiv(512, 4), cdiv(8 + 16 - 2, 4) + 1) = 7 blocks
    assert llm.engine.state.num_kv_blocks == 3 * 7 + 1
    assert llm.engine.state.num_usable_blocks == 21
    out = llm.generate([list(range(100, 190))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
