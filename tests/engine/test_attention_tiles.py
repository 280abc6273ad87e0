"""The Triton attention kernels' tiles against the device's shared memory: the selection
as a pure function over (head dim, dtype, budget) for every head size the families use,
its shared-memory model against what Triton really compiles for sm_89 / sm_90 (no GPU
needed: `triton.compile` to a target), and the tiles a 99 KiB GPU gets at head dim 256
computing correct attention under TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from tandem.engine.kernels import triton_unavailable_reason

if triton_unavailable_reason(torch.device("cpu")) and not torch.cuda.is_available():
    pytest.skip(triton_unavailable_reason(torch.device("cpu")), allow_module_level=True)

from tandem.engine.kernels import triton_attention as ta  # noqa: E402
from tests.engine.test_triton_attention import (  # noqa: E402
    DEVICE,
    assert_close,
    make_batch,
    reference,
)

KIB = 1024
SM89, A100, H100 = 99 * KIB, 163 * KIB, 227 * KIB  # opt-in shared memory per block
HEAD_DIMS = (64, 80, 96, 128, 256)  # Llama / Qwen (64, 128), Phi-3 (96), Gemma 3 (256)
ELT = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def _d_pad(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", list(ELT))
@pytest.mark.parametrize(("limit", "wgmma"), [(SM89, False), (A100, False), (H100, True)])
def test_every_head_size_gets_tiles_that_fit(head_dim, dtype, limit, wgmma):
    """Prefill, mixed and decode launches of every family's head size fit the budget by
    the model; the default decode config is kept wherever it fits."""
    d, elt = _d_pad(head_dim), ELT[dtype]
    for qlen, group in ((512, 4), (7, 2), (1, 8), (1, 1)):
        plan = ta.varlen_tiles(qlen, group, d, elt, limit, wgmma)
        assert ta.attention_shared_bytes(*plan, d, elt, wgmma) <= limit, (qlen, group, plan)
        assert plan.block_m >= max(16, group) and plan.block_n >= 16
        dec = ta.decode_tiles(ta.DECODE_CONFIG, group, d, elt, limit, wgmma)
        assert ta.attention_shared_bytes(max(16, group), dec.block_n, dec.num_stages, d, elt,
                                         wgmma) <= limit
        assert dec.num_warps == ta.DECODE_CONFIG.num_warps
        if elt == 2:  # 16-bit decode keeps the shipped launch at every head size
            assert dec == ta.DECODE_CONFIG


@pytest.mark.parametrize(("head_dim", "elt", "limit", "wgmma", "prefill", "decode_n"), [
    (128, 2, SM89, False, (128, 64, 2), 64),  # unchanged: the 128-row tile fits
    (256, 2, SM89, False, (64, 32, 2), 64),   # Gemma 3 bf16 on L4 / A10 / RTX 4090
    (256, 2, H100, True, (128, 64, 2), 64),   # ... and on an H100 / H200
    (256, 4, SM89, False, (16, 32, 2), 32),   # float32: narrower keys in both kernels
    (256, 4, H100, True, (64, 32, 2), 64),
    (128, 4, SM89, False, (64, 32, 2), 64),
    (256, 2, 48 * KIB, False, (16, 32, 2), 32),
])
def test_the_tiles_chosen_for_large_head_dims(head_dim, elt, limit, wgmma, prefill, decode_n):
    assert tuple(ta.varlen_tiles(512, 2, head_dim, elt, limit, wgmma)) == prefill
    assert ta.decode_tiles(ta.DECODE_CONFIG, 2, head_dim, elt, limit, wgmma).block_n == decode_n


def test_decode_configs_are_cut_in_order_and_the_limit_has_a_default():
    """Stages above 3 go first (their second K / V buffer), then keys; a config that fits
    is returned as given. The conservative default is the smallest GPU's 99 KiB."""
    big = ta.DecodeConfig(block_n=128, num_warps=8, num_stages=5)
    assert ta.decode_tiles(big, 1, 128, 2, H100) == big
    assert ta.decode_tiles(big, 1, 256, 2, SM89) == ta.DecodeConfig(64, 8, 3)
    assert ta.decode_tiles(big, 1, 256, 4, SM89) == ta.DecodeConfig(32, 8, 3)
    assert ta.decode_tiles(big, 1, 256, 4, 20 * KIB) == ta.DecodeConfig(16, 8, 1)
    assert ta.DEFAULT_SHARED_LIMIT == SM89
    assert ta._shared_memory_limit(torch.device("cpu")) > H100  # the interpreter: unbounded


_COMPILE = textwrap.dedent("""
    import inspect, json, sys
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tandem.engine.kernels import triton_attention as A

    def shared(kernel, arch, dt, d, bm, bn, stages, decode):
        p = "*" + dt
        ptrs = {n: p for n in ("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "o_ptr")}
        ptrs.update({n: "*i32" for n in ("bt_ptr", "seq_lens_ptr", "qs_ptr")})
        ptrs.update({n: "*fp32" for n in ("ws_m_ptr", "ws_l_ptr", "ws_acc_ptr")})
        const = dict(GROUP=2, BLOCK_SIZE=16, HEAD_DIM=d, D_PAD=d, BLOCK_M=bm, BLOCK_N=bn,
                     DOT=tl.float32 if dt == "fp32" else tl.bfloat16, KV_FMT=0,
                     PRECISION="ieee" if dt == "fp32" else "tf32")
        const.update(NUM_SPLITS=1) if decode else const.update(BLOCK_Q=bm // 2)
        names = list(inspect.signature(kernel.fn).parameters)
        sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "scale_log2"
               else "i32") for n in names}
        div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n.endswith("_ptr") or n.startswith("stride")}
        src = ASTSource(kernel, signature=sig, attrs=div,
                        constexprs={(names.index(k),): v for k, v in const.items()})
        opts = dict(num_warps=8 if bm >= 128 else 4, num_stages=stages)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts
                              ).metadata.shared

    out = []
    for arch, dt, d, bm, bn, stages, decode in json.loads(sys.argv[1]):
        kernel = A._decode_kernel if decode else A._varlen_kernel
        out.append(shared(kernel, arch, dt, d, bm, bn, stages, decode))
    print(json.dumps(out))
""")


def test_the_model_bounds_what_triton_compiles(tmp_path):
    """The tiles chosen at head dim 256 compiled for sm_89 (99 KiB) and sm_90 use at most
    what `attention_shared_bytes` says, which fits (the fixed 64-key tile of a float32
    prefill or decode needs ~148 KiB there)."""
    cases = []  # (arch, dtype, head_dim, block_m, block_n, stages, decode)
    for arch, dt, limit in ((89, "bf16", SM89), (89, "fp32", SM89), (90, "bf16", H100)):
        elt, wgmma = (4 if dt == "fp32" else 2), arch >= 90
        bm, bn, st = ta.varlen_tiles(512, 2, 256, elt, limit, wgmma)
        cases.append((arch, dt, 256, bm, bn, st, False))
        if arch == 89 and dt == "fp32":
            dec = ta.decode_tiles(ta.DECODE_CONFIG, 2, 256, elt, limit, wgmma)
            cases.append((arch, dt, 256, 16, dec.block_n, dec.num_stages, True))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], env=env,
                          text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (arch, dt, d, bm, bn, st, decode), used in zip(cases, got, strict=True):
        model = ta.attention_shared_bytes(bm, bn, st, d, 4 if dt == "fp32" else 2, arch >= 90)
        assert used <= model <= (H100 if arch >= 90 else SM89), (arch, dt, bm, bn, st, decode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_dim_256_tiles_of_a_99_kib_gpu_compute_attention(monkeypatch, dtype):
    """With the budget of an sm_89 the varlen kernel (a prefill chunk after a cached
    prefix, a fresh prompt, a decode, a sliding window) and the decode kernel run their
    narrower tiles and match the float64 reference at head dim 256."""
    monkeypatch.setattr(ta, "_shared_memory_limit", lambda device: SM89)
    monkeypatch.setattr(ta, "_wgmma", lambda device: False)
    launched = []

    def spy(kernel):
        class Spy:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    launched.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"]))
                    return kernel[grid](*args, **kw)
                return run
        return Spy()

    monkeypatch.setattr(ta, "_varlen_kernel", spy(ta._varlen_kernel))
    monkeypatch.setattr(ta, "_decode_kernel", spy(ta._decode_kernel))
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    d, kvh, heads, bs = 256, 1, 2, 16
    seqs = [(20, 12), (0, 9), (33, 1)]  # (cached, new)
    batch = make_batch([c + n for c, n in seqs], kvh, d, bs, dtype, gen, rng)
    q = torch.randn(sum(n for _, n in seqs), heads, d, generator=gen).to(dtype)
    starts = torch.tensor([0, 12, 21, 22], dtype=torch.int32)
    scale = d ** -0.5
    for window in (0, 10):
        out = torch.full_like(q, float("nan")).to(DEVICE)
        ta.paged_attention(q.to(DEVICE), batch.k_cache, batch.v_cache, out, batch.block_tables,
                           batch.seq_lens, starts.to(DEVICE), scale=scale, max_query_len=64,
                           sliding_window=window)
        for b, (cached, new) in enumerate(seqs):
            k, v = batch.contexts[b]
            rows = slice(int(starts[b]), int(starts[b + 1]))
            want = reference(q[rows], k, v, torch.arange(cached, cached + new), scale, window)
            assert_close(out[rows], want, dtype)
    dq = torch.randn(len(seqs), heads, d, generator=gen).to(dtype)
    out = torch.full_like(dq, float("nan")).to(DEVICE)
    ta.paged_decode_attention(dq.to(DEVICE), batch.k_cache, batch.v_cache, out,
                              batch.block_tables, batch.seq_lens, scale=scale)
    for b, (cached, new) in enumerate(seqs):
        k, v = batch.contexts[b]
        n = cached + new
        assert_close(out[b:b + 1], reference(dq[b:b + 1], k, v, torch.tensor([n - 1]), scale,
                                             0), dtype)
    prefill = ta.varlen_tiles(64, 2, d, ELT[dtype], SM89)
    assert launched[0] == tuple(prefill) and prefill.block_n == 32
    decode_n = 64 if dtype == torch.bfloat16 else 32
    assert launched[-1][1:] == (decode_n, 3)
