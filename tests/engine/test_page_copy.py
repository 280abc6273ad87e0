"""The native block copy fused with XXH3-64 (`kv_cache/page_copy.py`, `csrc/kv_copy_cpu.c`)
and the page paths built on it: exact bytes and exact digests against numpy and xxhash over
seeded random traces (block sizes around the kernel's 64 KiB piece, skipped blocks, id
orders), and the numpy fallback where the kernel is unavailable."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xxhash

from tandem.engine.kv_cache import page_copy
from tandem.engine.kv_cache.pages import (
    gather_layer,
    host_pages_into,
    scatter_layer,
    scatter_layer_digest,
    scatter_targets,
)


def test_copy_blocks_equals_numpy_and_xxhash_over_random_traces():
    """2,000 seeded traces: block i of src_idx lands on block i of dst_idx (a negative id:
    hashed, not written), every other destination block keeps its bytes, and the digest is
    xxhash's XXH3-64 of the source blocks in order, whatever the block size (tiny, odd,
    over one 64 KiB piece), with ordinary or non-temporal stores at any alignment."""
    assert page_copy.available()  # the kernel builds here (a C compiler, xxhash's symbols)
    rng = random.Random(0)
    digest = page_copy.Digest()
    for trace in range(2000):
        block = rng.choice([1, 3, 64, 1000, 4096, 12288]) if trace % 50 else rng.choice(
            [65536, 65537, 150001])
        nsrc, ndst = rng.randint(1, 12), rng.randint(1, 12)
        src = np.frombuffer(rng.randbytes(nsrc * block), dtype=np.uint8).copy()
        dst = np.frombuffer(rng.randbytes(ndst * block), dtype=np.uint8).copy()
        n = rng.randint(0, min(nsrc, ndst))
        s_ids = [rng.randrange(nsrc) for _ in range(n)]  # repeats allowed on the source
        d_ids = rng.sample(range(ndst), n)
        d_ids = [d if rng.random() > 0.2 else -1 for d in d_ids]
        want = dst.copy().reshape(ndst, block)
        for s, d in zip(s_ids, d_ids, strict=True):
            if d >= 0:
                want[d] = src.reshape(nsrc, block)[s]
        hashed = trace % 3 != 0
        digest.reset()
        page_copy.copy_blocks(src.ctypes.data, page_copy.block_indices(s_ids), dst.ctypes.data,
                              page_copy.block_indices(d_ids), block, digest if hashed else None,
                              stream=trace % 4 >= 2)  # streaming stores, aligned or not
        assert np.array_equal(dst.reshape(ndst, block), want), trace
        ref = xxhash.xxh3_64(b"".join(src.reshape(nsrc, block)[s].tobytes() for s in s_ids))
        if hashed:
            assert digest.intdigest() == ref.intdigest(), trace
        if trace % 7 == 0:  # hash only: no destination at all
            digest.reset()
            page_copy.copy_blocks(src.ctypes.data, page_copy.block_indices(s_ids), None, None,
                                  block, digest)
            assert digest.intdigest() == ref.intdigest(), trace


def test_copy_blocks_refuses_bad_indices():
    digest = page_copy.Digest()
    assert digest.intdigest() == xxhash.xxh3_64(b"").intdigest()
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="differ in length"):
        page_copy.copy_blocks(buf.ctypes.data, page_copy.block_indices([0, 1]), buf.ctypes.data,
                              page_copy.block_indices([0]), 8)
    with pytest.raises(ValueError, match="int64"):
        page_copy.copy_blocks(buf.ctypes.data, np.array([0], dtype=np.int32), None, None, 8)


def scatter_digest(dst, layer: int, ids: list[int], pages: torch.Tensor,
                   select: list[int] | None = None) -> int | None:
    """`scatter_layer_digest` with the targets an import builds once (`scatter_targets`)."""
    n = pages.shape[1] if pages.dim() > 1 else 0
    return scatter_layer_digest(dst, layer, scatter_targets(n, ids, select, dst[0][0].shape[0]),
                                pages)


def caches(seed: int, dtype: torch.dtype, blocks: int = 20, layers: int = 3):
    g = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        if dtype == torch.uint8:
            return torch.randint(0, 256, (blocks, 2, 8, 10), generator=g, dtype=torch.uint8)
        return torch.randn(blocks, 2, 4, 8, generator=g).to(dtype)

    return [(one(), one()) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_host_pages_digest_into_is_gather_layer_and_its_xxh3(dtype):
    for seed in range(30):
        rng = random.Random(seed)
        src = caches(seed, dtype)
        ids = rng.sample(range(20), rng.randint(1, 20))
        pages = host_pages_into(src, ids)
        assert pages is not None
        for layer in range(3):
            want = gather_layer(src, layer, ids)
            out = torch.empty_like(want)
            got = pages.digest_into(layer, out)
            assert torch.equal(out, want)
            assert got == xxhash.xxh3_64(want.view(torch.uint8).numpy().tobytes()).intdigest()
            first = rng.randrange(len(ids))
            part = torch.empty_like(want[1, first:])
            pages(layer, 1, first, part)
            assert torch.equal(part, want[1, first:])
        with pytest.raises(ValueError, match="do not fit"):
            pages.digest_into(0, torch.empty_like(gather_layer(src, 0, ids))[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_scatter_layer_digest_writes_the_selected_blocks_and_hashes_all(dtype):
    """Seeded random selections: the selected pages land on their blocks (as
    `scatter_layer` writes them), no other block changes, and the digest covers every page
    sent, skipped ones included."""
    for seed in range(40):
        rng = random.Random(seed)
        src = caches(seed, dtype)
        dst = caches(seed + 1000, dtype)
        n = rng.randint(1, 10)
        pages = gather_layer(src, 1, rng.sample(range(20), n))
        select = sorted(rng.sample(range(n), rng.randint(0, n))) if seed % 2 else None
        chosen = list(range(n)) if select is None else select
        ids = rng.sample(range(20), len(chosen))
        want = [(k.clone(), v.clone()) for k, v in dst]
        if chosen:
            scatter_layer(want, 1, ids, pages[:, chosen].contiguous())
        got = scatter_digest(dst, 1, ids, pages, select)
        assert got == xxhash.xxh3_64(pages.view(torch.uint8).numpy().tobytes()).intdigest()
        for (k, v), (wk, wv) in zip(dst, want, strict=True):
            assert torch.equal(k, wk) and torch.equal(v, wv), seed


def test_scatter_layer_digest_declines_what_it_cannot_write():
    """None, and nothing written, for pages of another dtype or shape, ids outside the
    cache, a selection that repeats or does not match the ids (no targets)."""
    src, dst = caches(1, torch.float32), caches(2, torch.float32)
    before = [(k.clone(), v.clone()) for k, v in dst]
    pages = gather_layer(src, 0, [1, 2, 3])
    for args in ((pages.double(), None, [0, 1, 2]), (pages[:, :2], None, [0, 1, 2]),
                 (pages, None, [0, 1, 20]), (pages, [0, 0], [4, 5]), (pages, [0, 1], [4]),
                 (pages, [0, 3], [4, 5])):
        assert scatter_digest(dst, 0, args[2], args[0], args[1]) is None
    # the targets themselves: -1 where a page is only hashed; None for what cannot be
    assert scatter_targets(3, [4, 5], [0, 2], 20).tolist() == [4, -1, 5]
    assert scatter_targets(2, [], [], 20).tolist() == [-1, -1]
    for n, ids, select in ((2, [0, 1, 2], None), (3, [0, 1, 20], None), (3, [4, 5], [0, 0]),
                           (3, [4], [0, 1]), (3, [4, 5], [0, 3]), (3, [-1, 2, 3], None)):
        assert scatter_targets(n, ids, select, 20) is None
    assert all(torch.equal(k, bk) and torch.equal(v, bv)
               for (k, v), (bk, bv) in zip(dst, before, strict=True))


def test_without_the_kernel_the_numpy_path_writes_the_same(monkeypatch):
    """`TANDEM_DISABLE_NATIVE_KERNELS` or no compiler: `digest_into` and
    `scatter_layer_digest` decline (the callers hash apart), the gather and the scatter
    run on numpy with the same bytes."""
    monkeypatch.setattr(page_copy, "available", lambda: False)
    src, dst = caches(3, torch.float32), caches(4, torch.float32)
    ids = [7, 0, 13, 2]
    pages = host_pages_into(src, ids)
    want = gather_layer(src, 2, ids)
    assert pages.digest_into(2, torch.empty_like(want)) is None
    out = torch.empty_like(want[0])
    pages(2, 0, 0, out)
    assert torch.equal(out, want[0])
    assert scatter_digest(dst, 2, [1, 2, 3, 4], want) is None
    scatter_layer(dst, 2, [1, 2, 3, 4], want)
    assert torch.equal(dst[2][1][[1, 2, 3, 4]], want[1])
