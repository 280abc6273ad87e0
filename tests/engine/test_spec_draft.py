"""The draft-model proposer (spec_decode/draft.py): its proposals against a cache-free
recompute of the same draft, self-drafts sharing the target's weights, the draft KV pool's
accounting, and the distributions random requests' drafts come from."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention.base import BatchLayout
from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.request import Request
from tandem.engine.sampler import SamplingRow, processed_probs, sampling_params
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode import ProposerContext, SpeculativeConfig, build_proposer
from tandem.engine.spec_decode.draft import DraftProposer
from tandem.engine.spec_decode.draft_runner import common_prefix, load_model

from .utils import make_request, make_tiny_model_dir

CPU = torch.device("cpu")
BS = 4
MAX_LEN = 96
VOCAB = 1024  # the tiny models' (the bundled tokenizer's files come along unused)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls: one torch thread (a shared CPU makes the thread pool's handoffs cost
    more than the work); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target path, 4-layer target model, path of a 2-layer draft of another seed)."""
    target = tmp_path_factory.mktemp("target")
    make_tiny_model_dir(target, "llama", seed=11, num_hidden_layers=4, vocab_size=VOCAB)
    draft = tmp_path_factory.mktemp("draft")
    make_tiny_model_dir(draft, "llama", seed=12, vocab_size=VOCAB)
    model, _ = load_model(target, _engine_config(target), CPU, torch.float32, MAX_LEN, BS)
    return target, model, draft


def _engine_config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=BS, **kw)


def _ctx(tiny, max_num_seqs: int = 8, vocab: int = VOCAB, chunk: int = 1024,
         **spec) -> ProposerContext:
    target, model, _ = tiny
    return ProposerContext(SpeculativeConfig(method="draft", **spec),
                           _engine_config(target, max_num_batched_tokens=chunk), model,
                           str(target), CPU, torch.float32, vocab, BS, MAX_LEN, max_num_seqs)


@torch.inference_mode()
def _logits(model, ids: list[int], first: int) -> torch.Tensor:
    """The logits after each of ids[first:], from scratch (a fresh cache, one prefill):
    [len(ids) - first, V] float32."""
    n = len(ids)
    backend = model.layers[0].self_attn.backend
    bs = backend.block_size
    caches = [backend.allocate_kv_cache(cdiv(n, bs)) for _ in model.layers]
    layout = BatchLayout([n], [n], [list(range(cdiv(n, bs)))], torch.arange(n), 0, bs)
    return model(torch.tensor(ids), torch.arange(n), caches, backend.build_metadata(layout),
                 torch.arange(first, n)).float()


def _greedy(model, ids: list[int], drafts: list[int]) -> list[int]:
    """The draft model's argmax after ids + drafts[:j] for each j (teacher-forced, so
    `drafts` is its greedy continuation exactly when this returns `drafts`)."""
    return _logits(model, ids + drafts[:-1], len(ids) - 1).argmax(dim=-1).tolist()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _simulate_verification(rng: random.Random, req, drafts: list[int]) -> None:
    """Accept a random prefix of `drafts`, then one token that is not the next draft."""
    a = rng.randint(0, len(drafts))
    for t in drafts[:a]:
        req.append_output_token(t)
    nxt = drafts[a] if a < len(drafts) else -1
    req.append_output_token(rng.choice([t for t in range(100, 110) if t != nxt]))


def _check_pool(p: DraftProposer) -> None:
    """Every block is free or held by exactly one request, which has KV only where it
    holds blocks."""
    held = [b.block_id for s in p.kv.seqs.values() for b in s.blocks]
    assert len(held) == len(set(held))
    assert p.kv.num_free_blocks() + len(held) == p.kv.pool.num_blocks
    assert all(len(s.blocks) >= cdiv(len(s.tokens), BS) for s in p.kv.seqs.values())


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _counting_forwards(p: DraftProposer) -> list[int]:
    """Record the number of tokens of each draft forward."""
    sizes: list[int] = []
    forward = p.kv.forward

    def counted(model, device, rows):
        sizes.append(sum(len(t) for _, t in rows))
        return forward(model, device, rows)

    p.kv.forward = counted
    return sizes


def test_batched_proposals_equal_the_drafts_own_recompute_across_rejections(tiny):
    """Three requests batched, six rounds with random acceptance and k: every proposal is
    the greedy continuation the draft model gives from scratch. Each call runs what its
    requests lack (longest common prefix with the draft KV) in forwards of at most
    `max_num_batched_tokens` = 8 tokens, then one forward per further draft position."""
    ctx = _ctx(tiny, model=str(tiny[2]), chunk=8)
    p = build_proposer(ctx)
    assert isinstance(p, DraftProposer) and not p.shared and len(p.model.layers) == 2
    sizes = _counting_forwards(p)
    rng = random.Random(0)
    reqs = [make_request(_prompt(rng, n), max_tokens=64) for n in (3, 11, 21)]
    for _ in range(6):
        ks = [rng.randint(1, 4) for _ in reqs]
        pending = sum(r.num_tokens - min(r.num_tokens - 1, _lcp(
            p.kv.seqs[r.request_id].tokens if r.request_id in p.kv.seqs else [],
            r.all_token_ids)) for r in reqs)
        sizes.clear()
        props = p.propose(reqs, ks)
        assert len(sizes) == cdiv(pending, 8) + max(ks) - 1 and max(sizes) <= 8
        for req, k, prop in zip(reqs, ks, props, strict=True):
            assert prop is not None and prop.draft_probs is None and len(prop.token_ids) == k
            assert prop.token_ids == _greedy(p.model, req.all_token_ids, prop.token_ids)
            seq = p.kv.seqs[req.request_id]
            assert seq.tokens == req.all_token_ids + prop.token_ids[:-1]
            assert len(seq.blocks) == cdiv(len(seq.tokens), BS)
            _simulate_verification(rng, req, prop.token_ids)
        _check_pool(p)
    for req in reqs:
        p.release(req.request_id)
    assert p.kv.num_free_blocks() == p.kv.pool.num_blocks and not p.kv.seqs


def test_common_prefix_matches_a_linear_scan():
    rng = random.Random(3)
    for _ in range(3000):
        n = rng.randint(0, 40)
        a = [rng.randint(0, 3) for _ in range(n)]
        b = a[: rng.randint(0, n)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 12))]
        limit = rng.randint(-1, 50)
        assert common_prefix(a, b, limit) == max(0, min(_lcp(a, b), limit))


def test_costs_are_calibrated_at_start_and_catch_ups_counted(tiny):
    """Before any request the proposer knows a round's cost (a line over 1 and 8 rows) and a
    catch-up token's, and has returned its throwaway blocks. `catchup_tokens` is what the
    draft has not run of a request beyond a round's few tokens: the prompt at first, 0 after
    a proposal and a short verification, the missed output after steps without drafts."""
    p = build_proposer(_ctx(tiny, model=str(tiny[2])))
    cost = p.round_cost()
    assert cost is not None and cost.round_s > 0 and cost.row_s >= 0
    assert p._rounds.line() is not None  # the calibration's line, not the per-row-free EMA
    for _ in range(500):  # a long run of one-row rounds (batch 1) keeps the slope known
        p._rounds.add(1, cost.round_s + cost.row_s)
    assert p._rounds.line() is not None
    assert cost.catchup_token_s > 0
    assert p.kv.num_free_blocks() == p.kv.pool.num_blocks and not p.kv.seqs
    rng = random.Random(1)
    short, long_ = make_request(_prompt(rng, 6)), make_request(_prompt(rng, 30), max_tokens=64)
    assert p.catchup_tokens(short) == 0 and p.catchup_tokens(long_) == 30
    prop = p.propose([long_], [3])[0]
    assert p.catchup_tokens(long_) == 0
    _simulate_verification(rng, long_, prop.token_ids)
    assert p.catchup_tokens(long_) == 0  # at most k + 1 new tokens: a round's work
    for t in range(12):  # twelve steps without drafts
        long_.append_output_token(200 + t)
    assert p.catchup_tokens(long_) == long_.num_tokens - p.kv.known(long_.request_id,
                                                                   long_.all_token_ids)
    assert p.catchup_tokens(long_) > 12
    p.release(long_.request_id)


def test_self_draft_truncated_shares_the_targets_weights(tiny):
    """"self" + draft_num_layers: a view of the target's first layers (every tensor the
    target's own), proposing what a separately loaded 2-layer copy gives greedily."""
    target_path, target, _ = tiny
    p = DraftProposer(_ctx(tiny, model="self", draft_num_layers=2))
    assert p.shared and len(p.model.layers) == 2 and len(target.layers) == 4
    ptrs = {t.data_ptr() for t in target.parameters()}
    assert all(t.data_ptr() in ptrs for t in p.model.parameters())
    assert p.model.lm_head is target.lm_head and p.model.layers[1] is target.layers[1]
    ref, _ = load_model(target_path, _engine_config(target_path), CPU, torch.float32, MAX_LEN,
                        BS, num_layers=2)
    rng = random.Random(1)
    reqs = [make_request(_prompt(rng, n), max_tokens=64) for n in (5, 9)]
    for _ in range(3):
        props = p.propose(reqs, [3, 3])
        for req, prop in zip(reqs, props, strict=True):
            assert len(prop.token_ids) == 3
            assert prop.token_ids == _greedy(ref, req.all_token_ids, prop.token_ids)
            _simulate_verification(rng, req, prop.token_ids)


def test_self_draft_quantized_loads_its_own_copy(tiny):
    p = DraftProposer(_ctx(tiny, model="self", draft_quantization="int8", draft_num_layers=3))
    assert not p.shared and len(p.model.layers) == 3
    assert type(p.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
    req = make_request(_prompt(random.Random(2), 7))
    prop = p.propose([req], [4])[0]
    assert len(prop.token_ids) == 4
    assert prop.token_ids == _greedy(p.model, req.all_token_ids, prop.token_ids)


def test_config_errors(tiny):
    with pytest.raises(ConfigError, match="vocabulary"):
        DraftProposer(_ctx(tiny, model="self", draft_num_layers=1, vocab=VOCAB + 1))
    with pytest.raises(ConfigError, match="draft_num_layers"):
        DraftProposer(_ctx(tiny, model="self", draft_num_layers=5))


def test_the_draft_is_allocated_before_the_kv_pool_is_sized(tiny, monkeypatch):
    """On CUDA the KV pool gets what gpu_memory_utilization leaves after everything already
    allocated: the draft's weights and its KV cache must exist by then (as vLLM loads the
    draft before profiling), or they come on top of the budget. The engine's order, seen
    through the two calls."""
    from tandem.engine import llm_engine

    target_path, _, draft_path = tiny
    calls: list[str] = []
    real_init, real_kv = DraftProposer.__init__, llm_engine.kv_blocks

    def init(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        real_init(self, *a, **kw)
        calls.append(f"draft {self.kv_bytes}")

    def kv(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append("kv pool")
        return real_kv(*a, **kw)

    monkeypatch.setattr(DraftProposer, "__init__", init)
    monkeypatch.setattr(llm_engine, "kv_blocks", kv)
    eng = llm_engine.LLMEngine(_engine_config(
        target_path, kv_cache_memory=1 << 20, max_model_len=MAX_LEN,
        speculative_config={"method": "draft", "model": str(draft_path)}))
    try:
        assert [c.split()[0] for c in calls] == ["draft", "kv"]
        assert int(calls[0].split()[1]) > 0 and eng.speculator is not None
        eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, temperature=0))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("seed", [3, 4])
def test_randomized_trace_keeps_the_pool_exact(tiny, seed):
    """A small pool (room for ~2.5 long requests), requests arriving, speculating, being
    rejected and released at random: proposals stay exact where given, a request the pool
    cannot serve gets None (others' live state in the call is never taken), no block leaks."""
    ctx = _ctx(tiny, model=str(tiny[2]), max_num_seqs=4)
    per_block = DraftProposer(ctx, kv_bytes=1).kv_bytes // cdiv(MAX_LEN, BS)
    p = DraftProposer(ctx, kv_bytes=per_block * 20)
    assert p.kv.pool.num_blocks == 24  # at least one max_model_len sequence
    rng = random.Random(seed)
    live: list = []
    nones = 0
    for _ in range(80):
        if len(live) < 4 and rng.random() < 0.4:
            live.append(make_request(_prompt(rng, rng.randint(2, 30)), max_tokens=64))
        if not live:
            continue
        batch = rng.sample(live, rng.randint(1, len(live)))
        ks = [rng.randint(1, 4) for _ in batch]
        before = {r.request_id: p.kv.seqs.get(r.request_id) for r in batch}
        for req, k, prop in zip(batch, ks, p.propose(batch, ks), strict=True):
            if before[req.request_id] is not None:  # the call's own state is never evicted
                assert p.kv.seqs[req.request_id] is before[req.request_id]
            k = min(k, MAX_LEN - req.num_tokens)
            if prop is None:
                nones += 1
                continue
            assert len(prop.token_ids) == k
            assert prop.token_ids == _greedy(p.model, req.all_token_ids, prop.token_ids)
            _simulate_verification(rng, req, prop.token_ids)
        _check_pool(p)
        for req in list(live):
            if req.num_tokens > MAX_LEN - 6 or rng.random() < 0.1:
                p.release(req.request_id)
                live.remove(req)
    for req in live:
        p.release(req.request_id)
    assert p.kv.num_free_blocks() == p.kv.pool.num_blocks and not p.kv.seqs
    assert nones + p.kv.num_evictions > 0  # the pool was short at times


def test_random_requests_get_the_distribution_their_drafts_came_from(tiny):
    """temperature / top-k / top-p / min-p: each draft_probs row is the request's processed
    distribution of the draft's logits at that position (renormalised: sums to 1), and the
    token drawn has positive probability there."""
    p = DraftProposer(_ctx(tiny, model=str(tiny[2])))
    rng = random.Random(4)
    kws = [dict(temperature=0.9, top_k=40, seed=7), dict(temperature=1.3, top_p=0.8),
           dict(temperature=0.7, min_p=0.05, seed=8), dict(temperature=0.0)]
    reqs = [Request(f"rand{i}", _prompt(rng, 6 + i), SamplingParams(max_tokens=64, **kw), 64)
            for i, kw in enumerate(kws)]
    for _ in range(2):
        props = p.propose(reqs, [3] * len(reqs))
        for req, prop in zip(reqs, props, strict=True):
            sp = req.sampling_params
            if sp.temperature == 0:
                assert prop.draft_probs is None and len(prop.token_ids) == 3
                assert prop.token_ids == _greedy(p.model, req.all_token_ids, prop.token_ids)
                continue
            probs = prop.draft_probs
            assert probs.shape == (3, VOCAB) and probs.dtype == torch.float32
            torch.testing.assert_close(probs.sum(-1), torch.ones(3), rtol=0, atol=1e-5)
            row = SamplingRow(sp.temperature, sp.top_k, sp.top_p, sp.min_p, 1.0, 0.0, 0.0,
                              None, (), (), (), None)
            for j, tok in enumerate(prop.token_ids):
                assert probs[j, tok] > 0
            logits = _logits(p.model, req.all_token_ids + prop.token_ids[:-1], req.num_tokens - 1)
            want = processed_probs(logits, sampling_params([row] * 3, VOCAB, CPU), [row] * 3)
            torch.testing.assert_close(probs, want / want.sum(-1, keepdim=True), rtol=1e-4,
                                       atol=1e-6)
            _simulate_verification(rng, req, prop.token_ids)


def test_drafts_are_drawn_from_their_draft_probs(tiny):
    """16 requests with one context, proposed for 100 times (k = 1, temperature 0.25,
    top-k 6: a skewed distribution, so a draw from a sharper or flatter one fails): the 1600
    tokens' frequencies fit the draft_probs row (Pearson chi-square, p > 0.001; seeded, so
    deterministic)."""
    p = DraftProposer(_ctx(tiny, model=str(tiny[2]), max_num_seqs=16))
    prompt = _prompt(random.Random(6), 9)
    reqs = [Request(f"chi{i}", prompt, SamplingParams(max_tokens=8, temperature=0.25, top_k=6),
                    8) for i in range(16)]
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    probs = None
    for _ in range(100):
        for prop in p.propose(reqs, [1] * 16):
            counts[prop.token_ids[0]] += 1
            if probs is None:
                probs = prop.draft_probs[0].double()
            torch.testing.assert_close(prop.draft_probs[0].double(), probs, rtol=1e-5,
                                       atol=1e-6)
    support = probs > 0
    assert int(support.sum()) == 6 and counts[~support].sum() == 0
    expected = probs[support] * counts.sum()
    assert expected.min() > 5  # Pearson's approximation holds
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    assert pvalue > 1e-3


@pytest.mark.slow
def test_bundled_self_draft_int4_first_layers(bundled_gguf):
    """The bundled GGUF as its own draft, int4 and cut to 8 layers: proposals equal that
    draft's cache-free greedy continuation, batched, across a rejection."""
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=16)
    spec = SpeculativeConfig(method="draft", model="self", draft_quantization="int4",
                             draft_num_layers=8)
    p = DraftProposer(ProposerContext(spec, cfg, None, str(bundled_gguf), CPU, torch.float32,
                                      49152, 16, 512, 4))
    assert len(p.model.layers) == 8 and not p.shared
    rng = random.Random(5)
    reqs = [make_request(_prompt(rng, n)) for n in (9, 20)]
    for _ in range(2):
        for req, prop in zip(reqs, p.propose(reqs, [4, 4]), strict=True):
            assert len(prop.token_ids) == 4
            assert prop.token_ids == _greedy(p.model, req.all_token_ids, prop.token_ids)
            _simulate_verification(rng, req, prop.token_ids)
