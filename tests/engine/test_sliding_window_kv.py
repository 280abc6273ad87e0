"""Sliding-window models free the KV blocks behind every query's window: the manager's
bound and bookkeeping, the scheduler's capacity math, every attention backend reading a
table whose out-of-window entries are the null block, and a tiny Mistral whose greedy
tokens equal transformers' on a KV pool too small for its prompts without freeing."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, get_backend
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv, uniform_window
from tandem.engine.scheduler import Scheduler
from tests.engine.test_engine import _hf_greedy
from tests.engine.utils import finish_step, make_request

BS = 4


def _run_to_end(sched: Scheduler, max_steps: int = 500) -> int:
    """Step `sched` (fake forwards) until nothing is left; returns the steps taken."""
    for step in range(max_steps):
        if not sched.has_unfinished():
            return step
        finish_step(sched, sched.schedule())
    raise AssertionError("the requests did not finish")


# -- the manager ----------------------------------------------------------------------------
def test_uniform_window_only_when_every_layer_slides_alike():
    assert uniform_window([8, 8, 8]) == 8
    assert uniform_window([None, None]) is None
    assert uniform_window([8, None, 8]) is None  # Gemma 3: local and global layers
    assert uniform_window([8, 16]) is None


def test_models_free_only_when_every_layer_slides():
    """Mistral (every layer slides) frees; Gemma 3's local/global mix keeps every block (one
    block table serves all layers); so does full attention."""
    from tandem.engine.model.config import ModelArchConfig

    dims = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=8)
    mistral = ModelArchConfig("mistral", sliding_window=16, **dims)
    gemma = ModelArchConfig("mistral", sliding_window=16, layer_types=(
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"),
        **dims)
    assert uniform_window(mistral.layer_windows) == 16
    assert uniform_window(gemma.layer_windows) is None
    assert uniform_window(ModelArchConfig("llama", **dims).layer_windows) is None


def test_the_null_block_is_block_0_out_of_circulation():
    kv = KVCacheManager(6, BS, sliding_window=5)
    assert kv.null_block is kv.pool.blocks[0]
    assert kv.pool.num_free_blocks() == kv.pool.num_usable_blocks == 5
    assert kv.usage() == 0.0
    with pytest.raises(ValueError):
        kv.pool.touch([kv.null_block])
    with pytest.raises(ValueError):
        kv.pool.free_blocks([kv.null_block])
    assert all(b.block_id for b in kv.pool.get_new_blocks(5))  # never handed out
    assert KVCacheManager(6, BS).pool.num_usable_blocks == 6  # no window: no null block


def test_blocks_behind_the_window_of_the_next_query_are_freed_and_stay_cached():
    """Window 6, blocks of 4: after c computed tokens the next query (position c) reads
    positions c - 5 .. c, so block i goes once 4 (i + 1) <= c - 5, i.e. c >= 4 i + 9."""
    kv = KVCacheManager(16, BS, sliding_window=6, enable_events=True)
    req = make_request(list(range(100, 130)), max_tokens=4)
    assert kv.allocate_slots(req, 30) is not None
    first = kv.block_ids(req.request_id)
    freed_at = {}
    for c in range(1, 31):
        req.num_computed_tokens = c
        kv.commit_computed(req)
        if kv.free_out_of_window(req):
            freed_at[c] = kv.block_ids(req.request_id).count(0)
    assert freed_at == {9: 1, 13: 2, 17: 3, 21: 4, 25: 5, 29: 6}
    ids = kv.block_ids(req.request_id)
    assert ids == [0] * 6 + first[6:]
    assert kv.resident_blocks(req.request_id) == 2 and kv.window_freed_blocks == 6
    assert kv.pool.num_free_blocks() == 15 - 2
    hashes = req.update_block_hashes(BS)
    for i, block_id in enumerate(first[:6]):  # hittable until evicted, but unreferenced
        block = kv.pool.get_cached_block(hashes[i])
        assert block is not None and block.block_id == block_id and block.ref_cnt == 0
    kv.free(req)
    assert kv.pool.num_free_blocks() == 15 and kv.usage() == 0.0


def test_a_prefix_hit_takes_no_block_behind_its_first_query_window():
    kv = KVCacheManager(16, BS, sliding_window=6)
    prompt = list(range(100, 130))
    first = make_request(prompt, max_tokens=1)
    kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.commit_computed(first)
    kv.free(first)
    again = make_request(prompt, max_tokens=1)
    computed, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 28 and len(computed) == 7
    free = kv.pool.num_free_blocks()
    assert kv.allocate_slots(again, 2, computed) is not None
    # the first query (position 28) reads 23..28: blocks 5 and 6 (and a new one for 28, 29)
    assert kv.block_ids(again.request_id)[:5] == [0] * 5
    assert [b.ref_cnt for b in computed] == [0] * 5 + [1, 1]
    assert kv.resident_blocks(again.request_id) == 3 and kv.pool.num_free_blocks() == free - 3


def test_kept_requests_keep_every_block():
    """A KV transfer's source (`keep_kv`) frees nothing: its reader needs the whole prompt."""
    kv = KVCacheManager(16, BS, sliding_window=6)
    req = make_request(list(range(100, 130)), max_tokens=1)
    req.keep_kv = True
    kv.allocate_slots(req, 30)
    req.num_computed_tokens = 30
    assert kv.free_out_of_window(req) == 0
    kv.free(req, keep=True)
    assert len(kv.kept_blocks(req.request_id)) == 8 and 0 not in [
        b.block_id for b in kv.kept_blocks(req.request_id)]


def test_max_blocks_bound():
    kv = KVCacheManager(64, BS, sliding_window=10)
    # a step of 8 tokens from position c reads c - 9 .. c + 7: 17 positions, 6 blocks at most
    assert kv.max_blocks(1000, 8) == cdiv(10 + 8 - 2, BS) + 1 == 5
    assert kv.max_blocks(1000, 8, keep=True) == 250
    assert kv.max_blocks(12, 8) == 3  # short requests: all their blocks
    assert KVCacheManager(64, BS).max_blocks(1000, 8) == 250


# -- the scheduler --------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 9])
def test_a_prompt_longer_than_the_pool_runs_in_chunks(window):
    """12 usable blocks (48 tokens), a 120-token prompt in chunks of 8: with a window it
    finishes, holding at most `max_blocks` blocks; without one it cannot (it preempts
    itself forever, and the engine refuses it at admission)."""
    kv = KVCacheManager(13, BS, sliding_window=window)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    req = make_request(list(range(100, 220)), max_tokens=6)
    bound = sched.max_blocks(126)
    assert bound == (cdiv(126, BS) if window is None else 5)
    sched.add_request(req)
    if window is None:
        with pytest.raises(AssertionError, match="did not finish"):
            _run_to_end(sched, max_steps=60)
        assert sched.num_preemptions > 0
        return
    most = 0
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        most = max(most, kv.resident_blocks(req.request_id))
        finish_step(sched, out)
    assert not sched.has_unfinished() and sched.num_preemptions == 0
    # the last step computes position 124: it reads 116.. (blocks 29 on), 0..28 are freed
    assert most <= bound and kv.window_freed_blocks == 29
    assert kv.pool.num_free_blocks() == 12


# -- the attention backends -----------------------------------------------------------------
MIXED = [(40, 1), (75, 1), (130, 1), (61, 9), (100, 28)]  # decodes, then chunks
DECODES = [(300, 1), (700, 1), (1100, 1)]  # long enough to split


def _null_table_outputs(backend_name: str, window: int, bs: int, shapes: list,
                        num_sms: int = 1) -> tuple:
    """The same batch through `backend_name` twice: with full block tables, and with every
    entry wholly before the window of its sequence's first query pointed at the null block
    0 (the freed blocks then hold NaN, as reused blocks hold others' KV)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    h, kvh, d, nblocks = 6, 2, 32, 160
    spec = AttentionSpec(h, kvh, d, d ** -0.5, window)
    backend = get_backend(backend_name)(spec, bs, torch.float32, torch.device("cpu"))
    backend.num_sms = num_sms  # triton: decode-only batches split the KV over the SMs
    cache = backend.allocate_kv_cache(nblocks)
    free = list(range(1, nblocks))  # 0: the null block, never written
    rng.shuffle(free)
    tables, nulled, slots, q, k, v = [], [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(cdiv(total, bs))]
        k_all, v_all = torch.randn(total, kvh, d), torch.randn(total, kvh, d)
        for p in range(total):
            cache[0][table[p // bs], :, p % bs] = k_all[p]
            cache[1][table[p // bs], :, p % bs] = v_all[p]
        gone = max(0, cached - window + 1) // bs
        assert gone > 0
        tables.append(table)
        nulled.append([0] * gone + table[gone:])
        slots += [table[p // bs] * bs + p % bs for p in range(cached, total)]
        q.append(torch.randn(new, h, d))
        k.append(k_all[cached:])
        v.append(v_all[cached:])
    q, k, v = torch.cat(q), torch.cat(k), torch.cat(v)
    outs = []
    for which in (tables, nulled):
        c = (cache[0].clone(), cache[1].clone())
        if which is nulled:
            for full, part in zip(tables, nulled, strict=True):
                for b, n in zip(full, part, strict=True):
                    if n == 0:
                        c[0][b], c[1][b] = float("nan"), float("nan")
        layout = BatchLayout([n for _, n in shapes], [a + n for a, n in shapes],
                             [list(t) for t in which], torch.tensor(slots),
                             sum(n == 1 for _, n in shapes), bs)
        meta = backend.build_metadata(layout)
        assert getattr(meta, "num_splits", 1) == (1 if num_sms == 1 else 4)
        outs.append(backend.forward(q, k, v, c, meta))
        assert torch.count_nonzero(c[0][0]) == 0 and torch.count_nonzero(c[1][0]) == 0
    return outs


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
def test_backends_read_null_entries_outside_the_window_as_masked(backend_name):
    full, nulled = _null_table_outputs(backend_name, 21, 16, MIXED)
    assert torch.isfinite(nulled).all()
    torch.testing.assert_close(nulled, full, atol=1e-6, rtol=1e-6)


def test_triton_split_kv_decode_reads_null_entries_as_masked():
    full, nulled = _null_table_outputs("triton", 21, 16, DECODES, num_sms=132)
    assert torch.isfinite(nulled).all()
    torch.testing.assert_close(nulled, full, atol=1e-6, rtol=1e-6)


# -- a tiny Mistral, end to end -----------------------------------------------------------
WINDOW = 12
SMALL = dict(block_size=BS, num_kv_blocks=10, max_num_batched_tokens=8)  # 9 usable: 36 tokens


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    """A 2-layer random Mistral whose window (12) is far shorter than the prompts: its path,
    4 prompts (two share a 20-token prefix) and transformers' 12 greedy tokens for each."""
    from tests.engine.utils import make_tiny_model_dir

    path = tmp_path_factory.mktemp("mistral-w12")
    model = make_tiny_model_dir(path, "mistral", seed=5, sliding_window=WINDOW)
    prompts = _window_prompts(4)
    return str(path), prompts, [_hf_greedy(model, p, 12) for p in prompts]


def _window_prompts(n: int) -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(100, 40000) for _ in range(20)]
    return [(shared if i % 2 else []) + [rng.randrange(100, 40000)
                                         for _ in range(rng.randint(30, 50))]
            for i in range(n)]


def test_tiny_mistral_matches_transformers_on_a_pool_smaller_than_its_prompts(tiny_mistral):
    """Prompts of 30-70 tokens (+ 12 generated) on 9 usable blocks of 4 (36 tokens): alone,
    then in a batch that preempts and hits a shared prefix, greedy tokens equal
    transformers'; the blocks freed are counted in the engine's stats. Without freeing the
    engine refuses these requests (they exceed the KV cache)."""
    from tandem import LLM, SamplingParams

    path, prompts, refs = tiny_mistral
    assert all(cdiv(len(p) + 12, BS) > 9 for p in prompts)
    llm = LLM(path, dtype="float32", **SMALL)
    assert llm.engine.kv.sliding_window == WINDOW
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate([prompts[1]], params)[0]
    assert alone.outputs[0].token_ids == refs[1]
    assert llm.engine.stats().kv_window_freed_blocks > 0
    batch = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in batch] == refs
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_free_blocks == 9
    # blocks freed behind the window stay in the prefix cache (until evicted): the shared
    # 20-token prefix, freed while prompts[1] ran, is hit by prompts[3]
    llm = LLM(path, dtype="float32", **{**SMALL, "num_kv_blocks": 24})
    first = llm.generate([prompts[1]], params)[0]
    assert llm.engine.stats().kv_window_freed_blocks >= 5
    second = llm.generate([prompts[3]], params)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 20)
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [refs[1], refs[3]]


def test_tiny_mistral_overlapped_loop_on_the_torch_backend(tiny_mistral):
    """The overlapped loop (the next step scheduled, and blocks freed, before the previous
    one's tokens are committed) on the pure-torch backend, which reads null entries: the
    same tokens."""
    from tandem import LLM, SamplingParams

    path, prompts, refs = tiny_mistral
    llm = LLM(path, dtype="float32", async_scheduling=True, native_kernels=False, **SMALL)
    out = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                               ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == refs
    assert llm.engine.optimistic_steps > 0 and llm.engine.stats().kv_window_freed_blocks > 0


def test_the_window_freed_counter_is_exported():
    from prometheus_client import generate_latest

    from tandem.engine.core_types import EngineStats
    from tandem.serving.metrics import ServerMetrics

    stats = EngineStats(0, 0, 0.0, 9, 0, 0, 0, 0, 0, 0, 0, kv_window_freed_blocks=7)
    text = generate_latest(ServerMetrics("m", lambda: stats).registry).decode()
    assert 'tandem_kv_window_freed_blocks_total{model_name="m"} 7.0' in text
