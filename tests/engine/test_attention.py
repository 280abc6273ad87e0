"""The paged-attention backends (pure torch, native CPU kernel) against a dense reference."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, get_backend, resolve_backend
from tandem.engine.attention.torch_backend import group_by_length
from tandem.engine.errors import ConfigError


def test_group_by_length_bounds_padding():
    lens = [3, 10, 60, 70, 100, 200, 260, 900]
    groups = group_by_length(lens, slack=1.25, min_len=64)
    assert groups == [(0, 3), (3, 5), (5, 7), (7, 8)]
    covered = [i for lo, hi in groups for i in range(lo, hi)]
    assert covered == list(range(len(lens)))
    for lo, hi in groups:
        assert lens[hi - 1] <= max(lens[lo] * 1.25, lens[lo] + 64)


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="available: auto, cpu, torch, triton"):
        get_backend("nope")


def test_auto_picks_the_native_kernel_on_cpu_float32_only():
    spec = AttentionSpec(6, 2, 16, 0.25)
    cpu = torch.device("cpu")
    # CI machines have a C compiler, so the native kernel must build there
    assert resolve_backend("auto", spec, torch.float32, cpu).name == "cpu"
    assert resolve_backend("auto", spec, torch.bfloat16, cpu).name == "torch"
    with pytest.raises(ConfigError, match="float32"):
        get_backend("cpu")(spec, 16, torch.bfloat16, cpu)


def _reference(q, k_all, v_all, q_pos, window):
    """q [Tq, H, D], k/v [L, KVH, D] -> [Tq, H, D] with causal (+ sliding window) masking."""
    h, kvh = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(h // kvh, dim=1).double()
    v = v_all.repeat_interleave(h // kvh, dim=1).double()
    scores = torch.einsum("thd,lhd->htl", q.double(), k) / q.shape[-1] ** 0.5
    kp = torch.arange(k.shape[0])[None, :]
    allowed = kp <= q_pos[:, None]
    if window:
        allowed &= kp > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 9])
def test_mixed_batch_matches_dense_reference(window, backend_name):
    torch.manual_seed(0)
    rng = random.Random(0)
    bs, kvh, h, d, nblocks = 4, 2, 6, 16, 64
    spec = AttentionSpec(h, kvh, d, d ** -0.5, window)
    backend = get_backend(backend_name)(spec, bs, torch.float32, torch.device("cpu"))
    cache = backend.allocate_kv_cache(nblocks)
    free = list(range(nblocks))
    rng.shuffle(free)
    # (cached context, new tokens): decodes first, sorted by length; then prefills with and
    # without a cached prefix
    shapes = [(3, 1), (17, 1), (40, 1), (0, 13), (21, 6)]
    seqs = []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // bs))]
        k_all = torch.randn(total, kvh, d)
        v_all = torch.randn(total, kvh, d)
        for p in range(cached):  # pre-fill the cache as earlier steps would have
            b, o = table[p // bs], p % bs
            cache[0][b, :, o] = k_all[p]
            cache[1][b, :, o] = v_all[p]
        seqs.append((cached, new, table, k_all, v_all))
    slots, q, k, v = [], [], [], []
    for cached, new, table, k_all, v_all in seqs:
        for p in range(cached, cached + new):
            slots.append(table[p // bs] * bs + p % bs)
        q.append(torch.randn(new, h, d))
        k.append(k_all[cached:])
        v.append(v_all[cached:])
    layout = BatchLayout([n for _, n, *_ in seqs], [c + n for c, n, *_ in seqs],
                         [t for _, _, t, *_ in seqs], torch.tensor(slots), 3, bs)
    meta = backend.build_metadata(layout)
    # q as the model hands it over: a strided view into a wider [T, H + KVH, D] tensor
    q_all = torch.cat(q)
    qk = torch.cat([q_all, torch.randn(q_all.shape[0], kvh, d)], dim=1)
    out = backend.forward(qk[:, :h], torch.cat(k), torch.cat(v), cache, meta)
    start = 0
    for (cached, new, _, k_all, v_all), qi in zip(seqs, q, strict=True):
        ref = _reference(qi, k_all, v_all, torch.arange(cached, cached + new), window)
        torch.testing.assert_close(out[start : start + new].double(), ref, atol=1e-5, rtol=1e-5)
        start += new


def _paged_batch(backend, rng, shapes, bs, kvh, h, d, nblocks):
    """Write `shapes` [(cached, new)] into a fresh cache; returns (cache, layout, per-seq
    (cached, new, k_all, v_all, q)) with decodes first as `BatchLayout` requires."""
    cache = backend.allocate_kv_cache(nblocks)
    free = list(range(nblocks))
    rng.shuffle(free)
    seqs, slots = [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // bs))]
        k_all, v_all = torch.randn(total, kvh, d), torch.randn(total, kvh, d)
        for p in range(cached):
            cache[0][table[p // bs], :, p % bs] = k_all[p]
            cache[1][table[p // bs], :, p % bs] = v_all[p]
        slots += [table[p // bs] * bs + p % bs for p in range(cached, total)]
        seqs.append((cached, new, table, k_all, v_all, torch.randn(new, h, d)))
    num_decodes = sum(1 for _, n in shapes if n == 1)
    layout = BatchLayout([n for _, n in shapes], [c + n for c, n in shapes],
                         [s[2] for s in seqs], torch.tensor(slots), num_decodes, bs)
    return cache, layout, seqs


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(("h", "kvh", "d"), [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
def test_native_prefill_kernel_matches_dense_reference(h, kvh, d, window):
    """The flash-style prefill kernel (block size 16): query tiles of every remainder,
    chunks after a cached prefix of any length, several chunks in one call, decodes
    alongside."""
    torch.manual_seed(1)
    rng = random.Random(1)
    bs = 16
    spec = AttentionSpec(h, kvh, d, d ** -0.5, window)
    backend = get_backend("cpu")(spec, bs, torch.float32, torch.device("cpu"))
    if backend._prefill_kernel is None:
        pytest.skip("this CPU has no AVX2 + FMA: prefill runs on the torch path")
    shapes = [(0, 1), (5, 1), (70, 1), (0, 16), (0, 45), (33, 17), (100, 3), (16, 64),
              (7, 200)]
    cache, layout, seqs = _paged_batch(backend, rng, shapes, bs, kvh, h, d, 128)
    meta = backend.build_metadata(layout)
    assert meta.native_prefills is not None and len(meta.native_prefills.q_lens) == 6
    q = torch.cat([s[5] for s in seqs])
    k = torch.cat([s[3][s[0]:] for s in seqs])
    v = torch.cat([s[4][s[0]:] for s in seqs])
    out = backend.forward(q, k, v, cache, meta)
    start = 0
    for cached, new, _, k_all, v_all, qi in seqs:
        ref = _reference(qi, k_all, v_all, torch.arange(cached, cached + new), window)
        torch.testing.assert_close(out[start : start + new].double(), ref, atol=1e-5, rtol=1e-5)
        start += new
