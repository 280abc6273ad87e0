"""The CPU attention backend composes the torch backend instead of inheriting from it: it owns
one for the shared metadata and for what its kernels do not run, and both run a layer through
`write_then_attend`. Where the CPU backend has no prefill kernel (block size 4), its prefill
rows are the torch backend's bit for bit, the K/V it writes are the same bytes (float and
int8 caches), and its native decode rows agree with torch's."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention import torch_backend
from tandem.engine.attention.base import AttentionBackend, AttentionSpec, BatchLayout
from tandem.engine.attention.cpu_backend import CpuAttentionBackend
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.kv_cache.quant import page_parts, quantize_rows

CPU = torch.device("cpu")


def test_composed_not_inherited():
    assert not issubclass(CpuAttentionBackend, TorchAttentionBackend)
    assert issubclass(CpuAttentionBackend, AttentionBackend)
    spec = AttentionSpec(6, 2, 16, 0.25)
    be = CpuAttentionBackend(spec, 4, torch.float32, CPU)
    assert be._prefill_kernel is None  # block size 4: prefill goes through the torch path


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_fallback_prefill_and_writes_equal_the_torch_backends(kv_cache_dtype, monkeypatch):
    calls = []
    real = torch_backend.write_then_attend

    def spy(steps, *args):
        calls.append(type(steps).__name__)
        return real(steps, *args)

    monkeypatch.setattr(torch_backend, "write_then_attend", spy)
    monkeypatch.setattr("tandem.engine.attention.cpu_backend.write_then_attend", spy)
    bs, kvh, h, d = 4, 2, 6, 16
    spec = AttentionSpec(h, kvh, d, d ** -0.5)
    shapes = [(3, 1), (17, 1), (0, 13), (21, 6)]
    outs, caches = [], []
    for cls in (CpuAttentionBackend, TorchAttentionBackend):
        be = cls(spec, bs, torch.float32, CPU, kv_cache_dtype)
        cache = be.allocate_kv_cache(32)
        free = list(range(32))
        random.Random(0).shuffle(free)
        gen = torch.Generator().manual_seed(0)
        tables, slots, q, k, v = [], [], [], [], []
        for cached, new in shapes:
            total = cached + new
            table = [free.pop() for _ in range(-(-total // bs))]
            kv = torch.randn(2, total, kvh, d, generator=gen)
            for c, x in zip(cache, kv, strict=True):
                if kv_cache_dtype == "auto":
                    for p in range(cached):  # as earlier steps wrote them
                        c[table[p // bs], :, p % bs] = x[p]
                    continue
                codes, scales = page_parts(c, bs)
                new_codes, new_scales = quantize_rows(x[:cached], kv_cache_dtype)
                for p in range(cached):
                    codes[table[p // bs], :, p % bs] = new_codes[p]
                    scales[table[p // bs], :, p % bs] = new_scales[p]
            slots += [table[p // bs] * bs + p % bs for p in range(cached, total)]
            tables.append(table)
            q.append(torch.randn(new, h, d, generator=gen))
            k.append(kv[0, cached:])
            v.append(kv[1, cached:])
        layout = BatchLayout([n for _, n in shapes], [c + n for c, n in shapes], tables,
                             torch.tensor(slots), 2, bs)
        meta = be.build_metadata(layout)
        outs.append(be.forward(torch.cat(q), torch.cat(k), torch.cat(v), cache, meta))
        caches.append(cache)
    assert calls == ["CpuAttentionBackend", "TorchAttentionBackend"]
    cpu, ref = outs
    assert torch.equal(cpu[2:], ref[2:])  # the prefill rows: the same torch code
    torch.testing.assert_close(cpu[:2], ref[:2], atol=1e-5, rtol=1e-5)  # native decodes
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b)
