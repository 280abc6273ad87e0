"""GPU KV-cache sizing arithmetic (engine/memory.py) on plain ints, and the dummy step's
layout. The CUDA profile itself runs in bench/gpu_check.py."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.memory import (
    MemorySnapshot,
    dummy_layout,
    kv_cache_budget,
    requested_memory,
)

GiB = 1 << 30


def test_budget_is_the_requested_share_minus_what_the_engine_already_uses() -> None:
    # an H200: 140 GiB, 0.9 -> 126 GiB; 16 GiB of bf16 8B weights, 3 GiB of activations,
    # 0.5 GiB outside torch -> 106.5 GiB of KV cache
    total = 140 * GiB
    kv = kv_cache_budget(total, 0.9, 16 * GiB, 3 * GiB, GiB // 2, free_at_start=139 * GiB)
    assert kv == int(total * 0.9) - 16 * GiB - 3 * GiB - GiB // 2
    assert kv == 114_353_504_256 == int(106.5 * GiB)
    assert kv_cache_budget(1000, 0.5, 100, 50, 25) == 325
    assert kv_cache_budget(1000, 1.0, 0, 0, 0) == 1000


def test_randomized_budgets_add_up() -> None:
    rng = random.Random(21)
    for _ in range(500):
        total = rng.randrange(1 << 20, 200 * GiB)
        util = rng.uniform(0.05, 1.0)
        parts = [rng.randrange(0, total // 3) for _ in range(3)]
        requested = int(total * util)
        if requested - sum(parts) > 0:
            kv = kv_cache_budget(total, util, *parts, free_at_start=requested)
            assert kv + sum(parts) == requested and kv > 0
        else:
            with pytest.raises(ConfigError, match="no GPU memory left for the KV cache"):
                kv_cache_budget(total, util, *parts)


def test_nothing_left_names_every_number() -> None:
    with pytest.raises(ConfigError) as err:
        kv_cache_budget(80 * GiB, 0.5, 30 * GiB, 9 * GiB, 2 * GiB)
    msg = str(err.value)
    for part in ("gpu_memory_utilization 0.5", "80.00 GiB", "40.00 GiB", "weights take 30.00 GiB",
                 "activation peak 9.00 GiB", "non-torch memory 2.00 GiB",
                 "raise gpu_memory_utilization"):
        assert part in msg, part
    with pytest.raises(ConfigError):  # exactly nothing left is no cache either
        kv_cache_budget(1000, 0.5, 300, 100, 100)


def test_other_processes_must_leave_the_requested_share_free() -> None:
    # vLLM's start-up check: 0.9 of 80 GiB is 72 GiB, but another process holds 10 GiB
    with pytest.raises(ConfigError) as err:
        kv_cache_budget(80 * GiB, 0.9, GiB, GiB, 0, free_at_start=70 * GiB)
    msg = str(err.value)
    assert "free GPU memory at start-up (70.00 GiB of 80.00 GiB)" in msg
    assert "gpu_memory_utilization 0.9 asks for (72.00 GiB)" in msg
    assert requested_memory(80 * GiB, 72 * GiB, 0.9) == int(80 * GiB * 0.9)
    assert requested_memory(80 * GiB, 40 * GiB, 0.45) == 36 * GiB  # two workers sharing


def test_non_torch_memory_is_device_use_outside_the_allocator() -> None:
    snap = MemorySnapshot(free=60 * GiB, total=80 * GiB, reserved=15 * GiB,
                          allocated=14 * GiB, peak_allocated=14 * GiB)
    assert snap.non_torch == 5 * GiB  # 20 GiB in use, 15 of it through torch


@pytest.mark.parametrize(("tokens", "max_len", "bs"), [
    (2048, 8192, 16), (2048, 512, 16), (1, 64, 16), (129, 64, 16), (65, 64, 32), (7, 3, 4),
])
def test_dummy_layout_is_a_valid_prompt_step_over_block_zero(tokens: int, max_len: int,
                                                             bs: int) -> None:
    layout = dummy_layout(tokens, max_len, bs)
    assert sum(layout.query_lens) == layout.num_tokens == tokens
    assert layout.seq_lens == layout.query_lens  # prompts from scratch
    assert all(1 <= n <= max_len for n in layout.query_lens)
    assert max(layout.query_lens) == min(tokens, max_len)  # the largest attention possible
    ones = [n == 1 for n in layout.query_lens]
    assert layout.num_decodes == sum(ones) and ones == sorted(ones, reverse=True)
    for n, table in zip(layout.seq_lens, layout.block_tables, strict=True):
        assert table == [0] * cdiv(n, bs)
    assert layout.slot_mapping.tolist() == [i % bs for i in range(tokens)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.py)")
def test_a_cuda_engine_sizes_its_kv_cache_within_its_share(tmp_path):
    """The real profile: the engine's whole torch footprint, profiling step included, stays
    within total * gpu_memory_utilization, and the KV cache gets most of that share (a tiny
    model built here: the GPU image has no bundled model)."""
    import gc

    from tandem import LLM, SamplingParams
    from tests.engine.utils import make_tiny_model_dir

    # 128 KiB of bf16 KV a block (the bundled model's 360 KiB): ~230k blocks in 0.2 of an H200
    make_tiny_model_dir(tmp_path, "llama", seed=2, tokenizer="trained", hidden_size=256,
                        intermediate_size=512, num_hidden_layers=8, num_key_value_heads=4,
                        head_dim=64, max_position_embeddings=2048)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_reserved()  # by anything else in this process
    util = min(0.2, free / total * 0.9)
    llm = LLM(str(tmp_path), device="cuda", gpu_memory_utilization=util, max_model_len=2048,
              max_num_seqs=32, max_num_batched_tokens=2048)
    out = llm.generate(["The capital of France is"] * 4,
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    state = llm.engine.state
    kv = state.num_kv_blocks * state.kv_bytes_per_block
    requested = int(total * util)
    assert torch.cuda.max_memory_reserved() - held <= requested + (64 << 20)  # + rounding
    assert kv >= requested // 2  # the tiny model's weights and activations are small
    assert state.num_kv_blocks > 32 * cdiv(2048, state.block_size)  # no host-RAM cap on CUDA
    del llm, out
    gc.collect()
    torch.cuda.empty_cache()
