"""KV cache groups of hybrid models (kv_cache/groups.py, kv_cache/hybrid.py): layers of
different windows keep one block table per group over one shared pool, sliding groups free
their blocks behind the window. The grouping, prefix hits, a seeded write-tracking
simulation (kv_sim_hybrid.py) and a tiny Gemma 3 against transformers on a pool that only
fits its prompts because the sliding layers free their blocks."""

from __future__ import annotations

import pytest

from tandem.engine.errors import ConfigError, InvalidRequestError
from tandem.engine.kv_cache.groups import kv_group_layout
from tandem.engine.kv_cache.hybrid import HybridKVCacheManager, group_key
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model_build import sequence_blocks
from tandem.engine.scheduler import Scheduler
from tests.engine.kv_sim_hybrid import HybridSim
from tests.engine.utils import finish_step, make_request

BS = 4


def test_layers_group_by_window_in_equal_groups():
    s, f = 6, None
    assert kv_group_layout([s, s, s]) is None and kv_group_layout([f, f]) is None
    # 10 local, 2 global: groups of 2 layers (5 local groups, 1 global), 2 tensors
    gemma = kv_group_layout([s] * 5 + [f] + [s] * 5 + [f])
    assert gemma.group_size == 2 and gemma.windows == (s,) * 5 + (f,)
    assert gemma.layer_group == (0, 0, 1, 1, 2, 5, 2, 3, 3, 4, 4, 5)
    assert gemma.layer_slot == (0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1)
    assert gemma.tensors_of(["a", "b"]) == ["a", "b", "a", "b", "a", "a", "b", "a", "b",
                                            "a", "b", "b"]
    # Gemma 3 1B: 22 local, 4 global -> groups of 4, the last local group padded
    one_b = kv_group_layout([f if i % 6 == 5 else s for i in range(26)])
    assert one_b.group_size == 4 and one_b.windows == (s,) * 6 + (f,)
    assert one_b.layer_group.count(5) == 2  # 22 = 5 * 4 + 2
    # counts within 1.25x of each other: one group per kind (the smaller one padded)
    near = kv_group_layout([s] * 9 + [f] * 8)
    assert near.group_size == 9 and near.windows == (s, f)
    assert near.layer_slot == tuple(range(9)) + tuple(range(8))
    with pytest.raises(ValueError):
        near.tensors_of(["a"])


def test_a_hybrid_sequence_needs_each_groups_bound():
    arch = ModelArchConfig("mistral", vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           sliding_window=4096,
                           layer_types=("sliding_attention", "full_attention"))
    groups = kv_group_layout(arch.layer_windows)
    # the full group all 8192 blocks, the sliding one cdiv(4096 + 1022, 16) + 1 = 321
    assert sequence_blocks(arch, 131_072, 16, 1024, groups) == (8192 + 321, 1)
    assert sequence_blocks(arch, 131_072, 16, 1024) == (8192, 0)  # one table


def _run(sched: Scheduler, steps: int = 200) -> None:
    for _ in range(steps):
        if not sched.has_unfinished():
            return
        finish_step(sched, sched.schedule())
    raise AssertionError("did not finish")


def test_sliding_groups_free_behind_the_window_and_a_hit_needs_only_their_window():
    """Window 6 and full attention: a 40-token prompt in chunks of 8 frees 6 blocks of the
    sliding group before its last chunk (a query at 32 reads 27.., block 6 on) and none of
    the full group's; the same prompt again hits 36 tokens
    (9 blocks) taking the full group's 9 and the sliding group's last 2 (a query at 36
    reads 31..36, blocks 7 and 8), the rest null entries."""
    kv = HybridKVCacheManager(40, BS, (6, None))
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8)
    prompt = list(range(100, 140))
    first = make_request(prompt, max_tokens=1)
    sched.add_request(first)
    most = 0
    while sched.has_unfinished():
        out = sched.schedule()
        most = max(most, kv.resident_blocks(first.request_id))
        finish_step(sched, out)
    assert most <= kv.max_blocks(41, 8) == 11 + cdiv(6 + 8 - 2, BS) + 1
    assert kv.window_freed_blocks == 6 and kv.pool.num_free_blocks() == 39
    again = make_request(prompt, max_tokens=1)
    hit, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 36
    full_hashes = again.update_block_hashes(BS)[:9]
    assert kv.plain == 1  # the full group's keys are the hashes, the sliding one's tagged
    assert [b.block_hash for b in hit.groups[1]] == full_hashes
    assert [b.block_id for b in hit.groups[0][:7]] == [0] * 7
    assert [b.block_hash for b in hit.groups[0][7:]] == [group_key(0, h, 1)
                                                        for h in full_hashes[7:]]
    sched.add_request(again)
    out = sched.schedule()
    assert kv.group_block_ids(again.request_id)[0][:7] == [0] * 7
    assert kv.resident_blocks(again.request_id) == 2 + 9 + 2  # + the last block, each group
    finish_step(sched, out)
    _run(sched)
    assert kv.pool.num_free_blocks() == 39


def test_a_hit_stops_where_a_sliding_groups_window_was_evicted():
    """A 45-token prompt computed: every full block cached in both groups, then the sliding
    group's block 10 evicted. A hit of 11 blocks (its first query at 44 reads 39..44,
    blocks 9 and 10) is out; one of 10 (35..40: blocks 8 and 9) takes the full group's 10
    blocks and the sliding group's 8 and 9."""
    kv = HybridKVCacheManager(40, BS, (6, None))
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    req = make_request(list(range(100, 145)), max_tokens=1)
    sched.add_request(req)
    _run(sched)
    hashes = req.update_block_hashes(BS)
    assert kv.get_computed_blocks(make_request(list(range(100, 145))))[1] == 44
    block = kv.pool.get_cached_block(kv.key(0, hashes[10]))
    del kv.pool._cached[block.block_hash]
    block.block_hash = None
    hit, num_hit = kv.get_computed_blocks(make_request(list(range(100, 145))))
    assert num_hit == 10 * BS
    assert [b.block_hash for b in hit.groups[0]] == [None] * 8 + [kv.key(0, h)
                                                                  for h in hashes[8:10]]
    assert [b.block_hash for b in hit.groups[1]] == hashes[:10]


@pytest.mark.parametrize("start", range(0, 240, 60))
def test_seeded_traces_keep_every_groups_reads_exact(start):
    """60 seeded random traces each (layer mixes, pools that preempt, shared prefixes,
    aborts): see kv_sim_hybrid.py for the invariants checked on every step."""
    freed = hits = preempted = 0
    for seed in range(start, start + 60):
        sim = HybridSim(seed)
        sim.run(60)
        freed += sim.kv.window_freed_blocks > 0
        hits += sim.kv.prefix_hits > 0
        preempted += sim.sched.num_preemptions > 0
    assert freed > 50 and hits > 30 and preempted > 10


def test_what_hybrid_groups_refuse():
    kv = HybridKVCacheManager(8, BS, (6, None))
    with pytest.raises(ConfigError, match="kv_cache_groups=False"):
        kv.pin_cached([])
    with pytest.raises(ConfigError, match="KV connector"):
        kv.connector = object()  # type: ignore[assignment]
    with pytest.raises(ConfigError):
        kv.free(make_request([1, 2, 3]), keep=True)
    assert not kv.supports_keep and KVCacheManager(8, BS).supports_keep


# -- a tiny Gemma 3 against transformers ----------------------------------------------------
def kv_bytes_per_layer(llm) -> int:  # noqa: ANN001 - an LLM
    return llm.engine.runner.backend.bytes_per_block()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tests.engine.test_architectures import build_case

    return build_case("gemma3", tmp_path_factory)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_tiny_gemma3_frees_its_sliding_layers_blocks_and_matches_transformers(gemma3,
                                                                              backend):
    """Layers (local, local, global, local), window 6: 4 groups of one layer on one
    physical tensor. 24 blocks (23 usable, the memory of 6 blocks of all four layers) run
    prompts of 14-27 tokens + 12 alone and batched twice (preempting): transformers' greedy
    tokens, blocks freed. Without freeing a 39-token request
    needs 40 blocks; on one block table the same memory (6 blocks) cannot take it."""
    from tandem import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(gemma3.path, dtype="float32", block_size=BS, num_kv_blocks=24,
              max_num_batched_tokens=4, max_num_seqs=8, num_threads=1,
              attention_backend=backend)
    kv = llm.engine.kv
    assert isinstance(kv, HybridKVCacheManager) and kv.windows == (6, 6, 6, None)
    assert llm.engine.state.kv_bytes_per_block == kv_bytes_per_layer(llm)
    longest = max(len(p) for p in gemma3.prompts) + 12
    assert kv.max_blocks(longest, 4, keep=True) == 4 * cdiv(longest, BS) > 23
    for ids, ref in zip(gemma3.prompts, gemma3.greedy, strict=True):
        assert llm.generate([ids], params)[0].outputs[0].token_ids == ref
    assert llm.engine.stats().kv_window_freed_blocks > 0
    for _ in range(2):
        outs = llm.generate(gemma3.prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == gemma3.greedy
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert kv.pool.num_free_blocks() == 23
    one_table = LLM(gemma3.path, dtype="float32", block_size=BS, num_kv_blocks=6,
                    num_threads=1, kv_cache_groups=False, attention_backend=backend)
    assert type(one_table.engine.kv) is KVCacheManager
    with pytest.raises(InvalidRequestError, match="exceeds the KV cache"):
        one_table.generate([max(gemma3.prompts, key=len)], params)


def test_tiny_gemma3_prefix_hit_reads_only_the_sliding_groups_window(gemma3):
    """Prompt 2 twice on a roomy pool: the second hits 24 of its 27 tokens although its
    sliding groups' early blocks were freed (and may be evicted), same tokens. KV events
    name the full-attention group's blocks: the prompt's 9 full blocks (6 of the prompt,
    3 of its output), under their plain hashes."""
    from tandem import LLM, SamplingParams
    from tandem.protocol.kv_events import BlockStored

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(gemma3.path, dtype="float32", block_size=BS, num_kv_blocks=64,
              max_num_batched_tokens=4, num_threads=1, enable_kv_events=True)
    a, b = (llm.generate([gemma3.prompts[2]], params)[0] for _ in range(2))
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 24)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == gemma3.greedy[2]
    stored = [h for e in llm.engine.take_kv_events() if isinstance(e, BlockStored)
              for h in e.block_hashes]
    assert len(stored) == (27 + 12 - 1) // BS and all(len(h) == 32 for h in stored)
    assert sorted(stored) == sorted(llm.engine.kv.pool.cached_hashes())


def test_keep_kv_requests_are_refused_on_hybrid_groups(gemma3):
    """A KV transfer's source keeps its blocks: not on KV groups (P/D workers run one
    table, `--disable-hybrid-kv-cache-manager` as the flag spells it)."""
    from tandem import LLM, SamplingParams

    llm = LLM(gemma3.path, dtype="float32", block_size=BS, num_kv_blocks=64, num_threads=1)
    with pytest.raises(InvalidRequestError, match="cannot be kept"):
        llm.engine.add_request("k", gemma3.prompts[0], SamplingParams(max_tokens=2),
                               keep_blocks=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_gemma3_overlapped_loop_frees_blocks_on_torch_and_triton(gemma3, backend):
    """The overlapped loop (blocks freed before the previous step's tokens are committed)
    on the torch backend and on Triton (the interpreter here; its per-group metadata
    builders each stage their own uploads): transformers' tokens, blocks freed, preempted."""
    from tandem import LLM, SamplingParams

    llm = LLM(gemma3.path, dtype="float32", block_size=BS, num_kv_blocks=24,
              max_num_batched_tokens=4, num_threads=1, async_scheduling=True,
              attention_backend=backend)
    builders = llm.engine.runner.group_builders
    assert [b.layer_windows for b in builders] == [[6], [6], [6], [None]]
    outs = llm.generate(gemma3.prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                       ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == gemma3.greedy
    stats = llm.engine.stats()
    assert llm.engine.optimistic_steps > 0 and stats.kv_window_freed_blocks > 0
    assert stats.num_preemptions > 0


def test_tensor_parallel_ngram_speculation_on_kv_groups_matches_transformers(gemma3):
    """TP = 2 (each rank's plan carries every group's tables) with n-gram drafts verified
    over the groups' tables, on a pool (24 blocks, 6 of all four layers) that preempts:
    transformers' greedy tokens, twice, blocks freed
    behind the window, every block back in the pool."""
    from tandem import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(gemma3.path, dtype="float32", block_size=BS, num_kv_blocks=24,
              max_num_batched_tokens=8, tensor_parallel_size=2, speculative_config=spec,
              num_threads=2)
    try:
        assert isinstance(llm.engine.kv, HybridKVCacheManager)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for _ in range(2):
            outs = llm.generate(gemma3.prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == gemma3.greedy
        stats = llm.engine.stats()
        free = llm.engine.kv.pool.num_free_blocks()
    finally:
        llm.engine.shutdown()
    assert stats.kv_window_freed_blocks > 0 and stats.spec_num_draft_tokens > 0
    assert stats.num_preemptions > 0 and free == 23


def test_the_flag_and_p_d_roles_turn_kv_groups_off():
    from tandem.serving.worker import engine_config
    from tests.operator.test_render_content import worker_parser

    p = worker_parser()
    assert engine_config(p.parse_args([])).kv_cache_groups
    assert not engine_config(p.parse_args(["--disable-hybrid-kv-cache-manager"])
                             ).kv_cache_groups
    for role in ("prefill", "decode"):
        assert not engine_config(p.parse_args(["--role", role])).kv_cache_groups
