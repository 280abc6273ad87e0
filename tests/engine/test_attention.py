"""The paged-attention backends (pure torch, native CPU kernels) against a float64 dense
reference: float32 and bfloat16 models, and the native kernels at every CPU level this
machine can run (`isa_levels`)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, get_backend, resolve_backend
from tandem.engine.attention.torch_backend import group_by_length
from tandem.engine.errors import ConfigError
from tests.engine.isa_levels import LEVELS_HERE, forced_level

# (backend, CPU level): the torch backend once, the native one at each level
BACKENDS = [("torch", None)] + [("cpu", level) for level in LEVELS_HERE]
DTYPES = [torch.float32, torch.bfloat16]


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


def test_auto_picks_the_native_kernels_on_cpu_for_float32_and_bfloat16():
    spec = AttentionSpec(6, 2, 16, 0.25)
    cpu = torch.device("cpu")
    # CI machines have a C compiler, so the native kernel must build there
    assert resolve_backend("auto", spec, torch.float32, cpu).name == "cpu"
    assert resolve_backend("auto", spec, torch.bfloat16, cpu).name == "cpu"
    assert resolve_backend("auto", spec, torch.float16, cpu).name == "torch"
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        get_backend("cpu")(spec, 16, torch.float16, cpu)


def _backend(name: str, level: str | None, spec: AttentionSpec, bs: int, dtype: torch.dtype):
    """Backend `name` for `spec`; the native one with the kernels of CPU level `level`."""
    if level is None:
        return get_backend(name)(spec, bs, dtype, torch.device("cpu"))
    with forced_level(level):
        return get_backend(name)(spec, bs, dtype, torch.device("cpu"))


def _check(out: torch.Tensor, ref: torch.Tensor, native: bool) -> None:
    """float32 output: float32 sums against float64 (1e-5). bfloat16 output of a native
    kernel (float32 arithmetic): the exact result rounded once to bfloat16 (half an ulp,
    2^-9 relative) plus the float32 sums. bfloat16 output of torch's SDPA, which rounds
    scores and probabilities to bfloat16 on the way: a few bfloat16 ulps of |v| ~ 1."""
    if out.dtype != torch.bfloat16:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    elif native:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=2 ** -8)
    else:
        torch.testing.assert_close(out.double(), ref, atol=2 ** -5, rtol=2 ** -6)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("backend_name", "level"), BACKENDS)
@pytest.mark.parametrize("window", [None, 9])
def test_mixed_batch_matches_dense_reference(window, backend_name, level, dtype):
    torch.manual_seed(0)
    rng = random.Random(0)
    bs, kvh, h, d, nblocks = 4, 2, 6, 16, 64
    spec = AttentionSpec(h, kvh, d, d ** -0.5, window)
    backend = _backend(backend_name, level, spec, bs, dtype)
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
        k_all = torch.randn(total, kvh, d).to(dtype)
        v_all = torch.randn(total, kvh, d).to(dtype)
        for p in range(cached):  # pre-fill the cache as earlier steps would have
            b, o = table[p // bs], p % bs
            cache[0][b, :, o] = k_all[p]
            cache[1][b, :, o] = v_all[p]
        seqs.append((cached, new, table, k_all, v_all))
    slots, q, k, v = [], [], [], []
    for cached, new, table, k_all, v_all in seqs:
        for p in range(cached, cached + new):
            slots.append(table[p // bs] * bs + p % bs)
        q.append(torch.randn(new, h, d).to(dtype))
        k.append(k_all[cached:])
        v.append(v_all[cached:])
    layout = BatchLayout([n for _, n, *_ in seqs], [c + n for c, n, *_ in seqs],
                         [t for _, _, t, *_ in seqs], torch.tensor(slots), 3, bs)
    meta = backend.build_metadata(layout)
    # q as the model hands it over: a strided view into a wider [T, H + KVH, D] tensor
    q_all = torch.cat(q)
    qk = torch.cat([q_all, torch.randn(q_all.shape[0], kvh, d).to(dtype)], dim=1)
    out = backend.forward(qk[:, :h], torch.cat(k), torch.cat(v), cache, meta)
    start = 0
    for (cached, new, _, k_all, v_all), qi in zip(seqs, q, strict=True):
        ref = _reference(qi, k_all, v_all, torch.arange(cached, cached + new), window)
        assert out.dtype == dtype
        native = backend_name == "cpu" and (new == 1 or meta.native_prefills is not None)
        _check(out[start : start + new], ref, native)
        start += new


def _paged_batch(backend, rng, shapes, bs, kvh, h, d, nblocks, dtype=torch.float32):
    """Write `shapes` [(cached, new)] into a fresh cache; returns (cache, layout, per-seq
    (cached, new, k_all, v_all, q)) with decodes first as `BatchLayout` requires."""
    cache = backend.allocate_kv_cache(nblocks)
    free = list(range(nblocks))
    rng.shuffle(free)
    seqs, slots = [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // bs))]
        k_all = torch.randn(total, kvh, d).to(dtype)
        v_all = torch.randn(total, kvh, d).to(dtype)
        for p in range(cached):
            cache[0][table[p // bs], :, p % bs] = k_all[p]
            cache[1][table[p // bs], :, p % bs] = v_all[p]
        slots += [table[p // bs] * bs + p % bs for p in range(cached, total)]
        seqs.append((cached, new, table, k_all, v_all, torch.randn(new, h, d).to(dtype)))
    num_decodes = sum(1 for _, n in shapes if n == 1)
    layout = BatchLayout([n for _, n in shapes], [c + n for c, n in shapes],
                         [s[2] for s in seqs], torch.tensor(slots), num_decodes, bs)
    return cache, layout, seqs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(("h", "kvh", "d"), [(9, 3, 64), (4, 4, 32), (8, 1, 16), (6, 2, 128)])
def test_native_prefill_kernel_matches_dense_reference(h, kvh, d, window, level, dtype):
    """The flash-style prefill kernel (block size 16): query tiles of every remainder,
    chunks after a cached prefix of any length, several chunks in one call, decodes
    alongside. Below AVX2 the prefill chunks take the torch path (and must agree too)."""
    torch.manual_seed(1)
    rng = random.Random(1)
    bs = 16
    spec = AttentionSpec(h, kvh, d, d ** -0.5, window)
    backend = _backend("cpu", level, spec, bs, dtype)
    native = level != "scalar"
    assert (backend._prefill_kernel is not None) == native
    shapes = [(0, 1), (5, 1), (70, 1), (0, 16), (0, 45), (33, 17), (100, 3), (16, 64),
              (7, 200)]
    cache, layout, seqs = _paged_batch(backend, rng, shapes, bs, kvh, h, d, 128, dtype)
    meta = backend.build_metadata(layout)
    assert (meta.native_prefills is not None) == native
    assert not native or len(meta.native_prefills.q_lens) == 6
    q = torch.cat([s[5] for s in seqs])
    k = torch.cat([s[3][s[0]:] for s in seqs])
    v = torch.cat([s[4][s[0]:] for s in seqs])
    out = backend.forward(q, k, v, cache, meta)
    start = 0
    for cached, new, _, k_all, v_all, qi in seqs:
        ref = _reference(qi, k_all, v_all, torch.arange(cached, cached + new), window)
        assert out.dtype == dtype
        _check(out[start : start + new], ref, native or new == 1)
        start += new


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize(("h", "kvh", "d", "bs"), [
    (8, 8, 64, 16), (8, 4, 128, 16), (16, 2, 64, 8), (12, 2, 128, 32),  # fast copies
    (10, 1, 64, 16), (9, 3, 48, 4)])  # G > 8, D 48: the generic loops
def test_native_decode_kernel_matches_dense_reference(h, kvh, d, bs, level, dtype):
    """Decode-only batches: contexts from 1 token to several blocks, windows that start
    inside a block and past the first block; every group size of the register-resident
    copies (G 1..8 at D 64 / 128) and the generic loops beyond them."""
    torch.manual_seed(2)
    rng = random.Random(2)
    lens = sorted([1, 2, bs - 1, bs, bs + 1, 3 * bs + 5, 90])
    for window in (None, bs + 3):
        spec = AttentionSpec(h, kvh, d, d ** -0.5, window)
        backend = _backend("cpu", level, spec, bs, dtype)
        cache, layout, seqs = _paged_batch(backend, rng, [(n - 1, 1) for n in lens], bs,
                                           kvh, h, d, sum(-(-n // bs) for n in lens) + 2,
                                           dtype)
        meta = backend.build_metadata(layout)
        q = torch.cat([s[5] for s in seqs])
        k = torch.cat([s[3][s[0]:] for s in seqs])
        v = torch.cat([s[4][s[0]:] for s in seqs])
        out = backend.forward(q, k, v, cache, meta)
        for i, (cached, _, _, k_all, v_all, qi) in enumerate(seqs):
            ref = _reference(qi, k_all, v_all, torch.tensor([cached]), window)
            _check(out[i : i + 1], ref, True)
