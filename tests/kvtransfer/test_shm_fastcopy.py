"""The `shm` backend's copies: `copy_digest` writes exactly the pieces and returns the XXH3-64
of those bytes whatever the chunk size (tails included), and the host path of
`scatter_layer` writes exactly what torch's `index_copy_` writes, in every cache dtype;
`host_pages_into` + `gather_digest` write exactly `gather_layer`'s bytes and their XXH3-64;
the `consumed` futex wakes a waiter in another process."""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import xxhash

from tandem.engine.kv_cache.pages import gather_layer, host_pages_into, scatter_layer
from tandem.kvtransfer import futex
from tandem.kvtransfer.fastcopy import CHUNK, copy_digest, gather_digest


def test_copy_digest_equals_a_copy_then_its_xxh3():
    """Seeded random pieces (empty, tiny, larger than a chunk, sizes no multiple of
    anything) and chunk sizes: the destination holds the pieces back to back, the bytes
    after them are untouched, and the digest is XXH3-64 of what was copied."""
    rng = random.Random(0)
    for trial in range(60):
        sizes = [rng.choice([0, 1, 7, 4095, 4096, 12288, 70001, 300_000])
                 for _ in range(rng.randint(1, 12))]
        pieces = [memoryview(rng.randbytes(s)) for s in sizes]
        total = sum(sizes)
        chunk = rng.choice([1, 4096, 65536, 100_003, CHUNK, total or 1])
        dst = bytearray(b"\xa5" * (total + rng.randint(0, 5000)))
        got = copy_digest(memoryview(dst), pieces, chunk)
        want = b"".join(bytes(p) for p in pieces)
        assert bytes(dst[:total]) == want, trial
        assert set(dst[total:]) <= {0xA5}, trial
        assert got == xxhash.xxh3_64_intdigest(want), trial


def test_copy_digest_refuses_pieces_that_do_not_fit():
    dst = bytearray(10)
    with pytest.raises(ValueError, match="11 bytes do not fit a 10-byte buffer"):
        copy_digest(memoryview(dst), [memoryview(b"x" * 6), memoryview(b"y" * 5)])
    assert dst == bytearray(10)  # nothing written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_host_scatter_writes_what_index_copy_writes(dtype):
    """Random block ids (any order), with or without a prebuilt index, every cache dtype:
    the same cache bytes as torch's `index_copy_`; ids outside the cache still raise, as
    with torch."""
    g = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    shape = (12, 2, 4, 8) if dtype != torch.uint8 else (12, 2, 40)
    for trial in range(8):
        n = rng.randint(1, 12)
        ids = rng.sample(range(12), n)
        pages = torch.randint(0, 255, (2, n, *shape[1:]), generator=g,
                              dtype=torch.uint8).to(dtype)
        caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))]
        want = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))]
        idx = torch.tensor(ids)
        scatter_layer(caches, 0, ids, pages, idx if trial % 2 else None)
        want[0][0].index_copy_(0, idx, pages[0])
        want[0][1].index_copy_(0, idx, pages[1])
        for got, exp in zip(caches[0], want[0], strict=True):
            assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))]
    for bad in ([12], [-1]):
        with pytest.raises((IndexError, RuntimeError)):
            scatter_layer(caches, 0, bad, torch.zeros((2, 1, *shape[1:]), dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_gather_into_writes_gather_layers_bytes(dtype):
    """Seeded random block ids (out of order, repeated), chunk sizes from one block to more
    than a layer: `gather_digest` over `host_pages_into` writes `gather_layer`'s bytes
    exactly, nothing past them, and returns their XXH3-64."""
    g = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    shape = (20, 2, 4, 8)
    caches = [tuple(torch.randn(*shape, generator=g).mul(50).to(dtype) for _ in range(2))
              for _ in range(3)]
    block = 2 * 4 * 8 * caches[0][0].element_size()
    for trial in range(12):
        ids = [rng.randrange(20) for _ in range(rng.randint(1, 12))]
        into = host_pages_into(caches, ids)
        assert into is not None
        for layer in range(3):
            want = gather_layer(caches, layer, ids)
            buf = torch.full((2 * len(ids) * block + 64,), 0xA5, dtype=torch.uint8)
            out = buf[:2 * len(ids) * block].view(dtype).view(want.shape)
            chunk = rng.choice([1, block, 3 * block + 5, 1 << 20])
            got = gather_digest(out, lambda kv, first, o, n=layer, f=into: f(n, kv, first, o),
                                chunk)
            raw = want.view(torch.uint8).reshape(-1).numpy().tobytes()
            assert buf[:len(raw)].numpy().tobytes() == raw, (trial, layer)
            assert set(buf[len(raw):].tolist()) == {0xA5}
            assert got == xxhash.xxh3_64_intdigest(raw)


def test_gather_into_refuses_what_does_not_fit():
    """No writer for ids outside the cache or a cache that is not contiguous host memory;
    a buffer of another shape, dtype or range is refused with nothing written."""
    caches = [(torch.randn(6, 2, 4), torch.randn(6, 2, 4))]
    assert host_pages_into(caches, [0, 6]) is None
    assert host_pages_into(caches, [-1]) is None
    assert host_pages_into(caches, []) is None
    assert host_pages_into([(caches[0][0].transpose(1, 2), caches[0][1])], [0]) is None
    into = host_pages_into(caches, [5, 1, 3])
    assert into is not None
    for bad in (torch.zeros(4, 2, 4), torch.zeros(2, 4, 2), torch.zeros(2, 2, 4).double()):
        with pytest.raises(ValueError, match="do not fit"):
            into(0, 0, 0, bad)
        assert not bad.any()
    with pytest.raises(ValueError, match="pages 2..4 of 3"):
        into(0, 1, 2, torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="kv 2"):
        into(0, 2, 0, torch.zeros(1, 2, 4))
    out = torch.zeros(2, 2, 4)
    into(0, 1, 1, out)
    assert torch.equal(out, caches[0][1][[1, 3]])


@pytest.mark.skipif(futex.address(mmap.mmap(-1, 4096), 8) is None, reason="no futex here")
def test_futex_wakes_a_waiter_in_another_process():
    """A shared mapping's word: `wait` returns at once when the word already differs, sleeps
    out its timeout when nobody wakes it, and returns as soon as another process changes
    the word and wakes it (well before the timeout); bad offsets give no address."""
    m = mmap.mmap(-1, 4096)  # anonymous shared: inherited by the child
    assert futex.address(m, 6) is None and futex.address(m, 4094) is None
    addr = futex.address(m, 8)
    m.close()  # no export kept: the map closes
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, 4096)
        m = mmap.mmap(fd, 4096)
        addr = futex.address(m, 8)
        t0 = time.monotonic()
        futex.wait(addr, 1, 2.0)  # the word is 0: no sleep
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        futex.wait(addr, 0, 0.05)
        assert time.monotonic() - t0 >= 0.04
        child = subprocess.Popen([sys.executable, "-c", WAKER, path])
        try:
            t0 = time.monotonic()
            while m[8] == 0 and time.monotonic() - t0 < 20:
                futex.wait(addr, 0, 30.0)  # the child's wake ends it early
            assert m[8] == 7 and time.monotonic() - t0 < 20
        finally:
            child.wait(10)
        assert child.returncode == 0
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)


WAKER = """
import mmap, sys, time
from tandem.kvtransfer import futex
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 4096)
time.sleep(0.3)
m[8] = 7
futex.wake(futex.address(m, 8))
"""
