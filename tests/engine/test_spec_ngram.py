"""`ngram` prompt lookup: exact proposals vs a brute-force reference (torch-free).

Per-call cost: see `ngram.py`'s docstring; `test_long_context_is_fast` keeps a loose bound.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode import PROPOSERS, ProposerContext, SpeculativeConfig
from tandem.engine.spec_decode.ngram import NgramProposer, find_ngram_match


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first, then the latest start s < L - n with an equal n-gram."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[length - n:] if n < length else None
        if suffix is None:
            continue
        for s in range(length - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


class Req:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.all_token_ids = tokens


def make(min_n: int = 2, max_n: int = 5, k: int = 4, max_model_len: int = 1 << 20):
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                            prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    ctx = ProposerContext(config=cfg, engine_config=None, target=None, model_path="",
                          device=None, dtype=None, vocab_size=32000, block_size=16,
                          max_model_len=max_model_len, max_num_seqs=8)
    return NgramProposer(ctx)


def proposed(p, req, n) -> list[int]:
    out = p.propose([req], [n])[0]
    assert out is None or (out.token_ids and out.draft_probs is None)
    return [] if out is None else out.token_ids


def test_registered():
    assert PROPOSERS["ngram"] is NgramProposer


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 1, 1), (1, 3, 4), (2, 5, 4),
                                                  (3, 3, 7), (2, 8, 16)])
def test_matches_reference_random(min_n, max_n, k):
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    p = make(min_n, max_n, k)
    for i in range(800):
        vocab = rng.choice([2, 3, 5, 12])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        want = reference(tokens, min_n, max_n, k)
        n = rng.randint(1, k)
        assert find_ngram_match(np.array(tokens, np.int64), min_n, max_n, k).tolist() == want
        assert proposed(p, Req(f"r{i}", tokens), n) == want[:n]


def test_latest_occurrence_and_longest_n_win():
    # "1 2" occurs at 0 and 3: the latest (3) wins, proposing what followed it
    assert reference([1, 2, 7, 1, 2, 8, 9, 1, 2], 2, 2, 3) == [8, 9, 1]
    assert find_ngram_match(np.array([1, 2, 7, 1, 2, 8, 9, 1, 2]), 2, 2, 3).tolist() == [8, 9, 1]
    # "5 1 2" (n = 3) occurs only early; the n = 2 match "1 2" is later but shorter
    toks = np.array([5, 1, 2, 3, 4, 1, 2, 6, 5, 1, 2])
    assert find_ngram_match(toks, 2, 3, 2).tolist() == [3, 4]
    assert find_ngram_match(toks, 2, 2, 2).tolist() == [6, 5]
    # near the end: fewer than k tokens follow; the suffix itself never matches
    assert find_ngram_match(np.array([3, 3, 3]), 1, 2, 4).tolist() == [3]
    assert find_ngram_match(np.array([4, 5, 6]), 1, 3, 4).size == 0
    assert find_ngram_match(np.array([4]), 1, 3, 4).size == 0


def test_incremental_growth_and_release():
    rng = random.Random(7)
    p = make(1, 4, 5)
    reqs = {f"r{i}": Req(f"r{i}", []) for i in range(6)}
    for step in range(1500):
        rid = rng.choice(list(reqs))
        req = reqs[rid]
        if rng.random() < 0.03:  # released, and a new request reuses the id
            p.release(rid)
            req = reqs[rid] = Req(rid, [rng.randrange(4) for _ in range(rng.randrange(5))])
        elif rng.random() < 0.02:  # a new request object under the same id, not released
            req = reqs[rid] = Req(rid, [rng.randrange(4) for _ in range(rng.randrange(5))])
        req.all_token_ids.extend(rng.randrange(4) for _ in range(rng.choice([0, 1, 1, 3])))
        n = rng.randint(1, 5)
        assert proposed(p, req, n) == reference(req.all_token_ids, 1, 4, 5)[:n], step


def test_batch_and_caps_with_real_requests():
    sp = SamplingParams(max_tokens=8)
    a = Request("a", [1, 2, 3, 4, 1, 2], sp, max_tokens=8)
    b = Request("b", [9, 8, 7], sp, max_tokens=8)
    p = make(1, 3, 4, max_model_len=8)
    out = p.propose([a, b], [4, 2])
    assert out[0].token_ids == [3, 4]  # max_model_len 8 - 6 tokens
    assert out[1] is None
    a.append_output_token(3)  # [1 2 3 4 1 2 3]: "1 2 3" matched, one slot left
    assert p.propose([a], [4])[0].token_ids == [4]


def test_long_context_is_fast():
    import time

    rng = np.random.default_rng(0)
    p = make(2, 5, 4)
    req = Req("long", rng.integers(0, 32000, 32768).tolist())
    proposed(p, req, 4)  # builds the buffer once
    t0 = time.perf_counter()
    for _ in range(50):
        req.all_token_ids.append(int(rng.integers(0, 32000)))
        proposed(p, req, 4)
    per_call = (time.perf_counter() - t0) / 50
    assert per_call < 2e-3, per_call  # ~14 us measured; generous for loaded CI machines
