"""Every KV slot the native CPU attention kernels read was written: seeded random traces
over a cache whose unwritten slots hold NaN (any read of one turns that output row into
NaN), in float32 and bfloat16, at every CPU level this machine runs.

Each trace draws a head layout (group sizes 1-10, head dims 64 / 128 / 32: the register-
resident copies and the generic loops), a block size, a sliding window or none, and a batch
of decodes and prefill chunks of random lengths over randomly placed blocks; the outputs
must be finite and equal the float64 reference over the written rows."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout
from tests.engine.isa_levels import LEVELS_HERE
from tests.engine.test_attention import _backend, _check, _reference

TRACES = 60  # per level and dtype: 480 traces on a 4-level machine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_kernels_read_only_written_slots(level, dtype):
    rng = random.Random(zlib.crc32(f"{level} {dtype}".encode()))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for trace in range(TRACES):
        kvh = rng.choice([1, 2, 3])
        g = rng.choice([1, 2, 3, 4, 7, 8, 10])
        d = rng.choice([64, 128, 32])
        bs = rng.choice([16, 32]) if rng.random() < 0.7 else rng.choice([4, 8])
        window = rng.choice([None, None, rng.randrange(1, 40)])
        spec = AttentionSpec(g * kvh, kvh, d, d ** -0.5, window)
        backend = _backend("cpu", level, spec, bs, dtype)
        n_dec, n_pre = rng.randrange(0, 5), rng.randrange(0, 3)
        shapes = sorted((rng.randrange(0, 70), 1) for _ in range(n_dec))
        shapes += [(rng.randrange(0, 50), rng.randrange(2, 40)) for _ in range(n_pre)]
        if not shapes:
            shapes, n_dec = [(rng.randrange(0, 30), 1)], 1
        need = sum(-(-(c + n) // bs) for c, n in shapes)
        nblocks = need + rng.randrange(1, 6)
        cache = backend.allocate_kv_cache(nblocks)
        for c in cache:
            c.fill_(float("nan"))  # unwritten: any read of it poisons the row
        free = list(range(nblocks))
        rng.shuffle(free)
        seqs, slots = [], []
        for cached, new in shapes:
            table = [free.pop() for _ in range(-(-(cached + new) // bs))]
            k_all = torch.randn(cached + new, kvh, d, generator=gen).to(dtype)
            v_all = torch.randn(cached + new, kvh, d, generator=gen).to(dtype)
            for p in range(cached):
                cache[0][table[p // bs], :, p % bs] = k_all[p]
                cache[1][table[p // bs], :, p % bs] = v_all[p]
            slots += [table[p // bs] * bs + p % bs for p in range(cached, cached + new)]
            seqs.append((cached, new, table, k_all, v_all,
                         torch.randn(new, g * kvh, d, generator=gen).to(dtype)))
        layout = BatchLayout([n for _, n in shapes], [c + n for c, n in shapes],
                             [s[2] for s in seqs], torch.tensor(slots), n_dec, bs)
        meta = backend.build_metadata(layout)
        out = backend.forward(torch.cat([s[5] for s in seqs]),
                              torch.cat([s[3][s[0]:] for s in seqs]),
                              torch.cat([s[4][s[0]:] for s in seqs]), cache, meta)
        assert torch.isfinite(out).all(), (level, trace, shapes, spec, bs)
        start = 0
        for cached, new, _, k_all, v_all, q in seqs:
            ref = _reference(q, k_all, v_all, torch.arange(cached, cached + new), window)
            # decodes run the native decode kernel; prefill chunks the native prefill
            # kernel where it was planned (AVX2, block and head sizes in 16s), else torch
            native = new == 1 or meta.native_prefills is not None
            _check(out[start : start + new], ref, native)
            start += new
