"""The Triton paged-attention kernels against a float64 torch reference.

On a CPU-only machine they run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before this module imports them). Every case uses shuffled, non-contiguous
block ids, a cache poisoned with NaN everywhere but the written context (including the tail
of each sequence's last block and a poison block the tables' unused entries point at), and
NaN-filled outputs, so a read outside the context or an unwritten element shows up.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

from tandem.engine.kernels import triton_unavailable_reason

if triton_unavailable_reason(torch.device("cpu")) and not torch.cuda.is_available():
    pytest.skip(triton_unavailable_reason(torch.device("cpu")), allow_module_level=True)

from tandem.engine.kernels.triton_attention import (  # noqa: E402
    DecodeWorkspace,
    choose_num_splits,
    paged_attention,
    paged_decode_attention,
    varlen_block_m,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2}


@dataclass
class Batch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence: K, V [L, KVH, D]


def make_batch(seq_lens: list[int], kvh: int, head_dim: int, block_size: int,
               dtype: torch.dtype, gen: torch.Generator, rng: random.Random) -> Batch:
    """A paged cache holding each sequence's random K/V at shuffled block ids."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3  # spare blocks stay NaN; the last one is the poison block
    ids = list(range(num_blocks - 1))
    rng.shuffle(ids)
    width = max(needed + [1]) + 1
    shape = (num_blocks, kvh, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(seq_lens), width), num_blocks - 1, dtype=torch.int32)
    contexts = []
    for b, (n, nb) in enumerate(zip(seq_lens, needed, strict=True)):
        blocks = [ids.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, kvh, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kvh, head_dim, generator=gen).to(dtype)
        for p in range(n):
            k_cache[blocks[p // block_size], :, p % block_size] = k[p]
            v_cache[blocks[p // block_size], :, p % block_size] = v[p]
        contexts.append((k, v))
    return Batch(k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                 torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), contexts)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              scale: float, window: int) -> torch.Tensor:
    """float64 attention of q [Tq, H, D] at `positions` over one context k/v [L, KVH, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    keys = torch.arange(k.shape[0])[None, :]
    allowed = keys <= positions[:, None]
    if window:
        allowed &= keys > positions[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.double().cpu()
    assert not out.isnan().any(), "unwritten (NaN) output elements"
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


# --- the varlen kernel: mixed prefill chunks, fresh prompts, decodes, padding --------------

def _mixed_seqs(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    """(cached context, new tokens) per sequence; covers every kind of row at least once."""
    seqs = [
        (rng.randint(block_size, 60), rng.randint(2, 40)),  # chunk after a cached prefix
        (0, rng.randint(2, 50)),  # fresh prompt
        (rng.randint(1, 90), 1),  # decode
        (block_size * rng.randint(1, 3), 1),  # decode that starts a block (len % bs == 1)
        (block_size * 2 - 7, 7),  # a chunk that ends exactly on a block boundary (full block)
        (rng.randint(0, 40), 0),  # padding row: no new tokens
    ]
    rng.shuffle(seqs)
    return seqs[:rng.randint(4, 6)] + [(0, 0)]


def _varlen_cases(n: int = 12):
    rng = random.Random(2112)
    for i in range(n):
        yield pytest.param(
            i, [16, 32][i % 2], [64, 128][i // 2 % 2], [1, 3, 8][i % 3],
            [torch.float32, torch.bfloat16][i // 3 % 2], [0, 0, rng.randint(4, 40)][i // 4 % 3],
            id=f"case{i}")


@pytest.mark.parametrize("seed,block_size,head_dim,group,dtype,window", list(_varlen_cases()))
def test_varlen_matches_reference(seed, block_size, head_dim, group, dtype, window):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kvh = 1 + seed % 2
    seqs = _mixed_seqs(rng, block_size)
    qlens = [q for _, q in seqs]
    batch = make_batch([c + q for c, q in seqs], kvh, head_dim, block_size, dtype, gen, rng)
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    padded_tokens = starts[-1] + 3  # trailing rows (a padded batch) belong to no sequence
    h = kvh * group
    q = torch.randn(padded_tokens, h, head_dim, generator=gen).to(dtype)
    # q/out with a row stride wider than H * D (a slice of a fused QKV projection)
    q_wide = torch.full((padded_tokens, h + 1, head_dim), float("nan"), dtype=dtype)
    q_wide[:, :h] = q
    out = torch.full((padded_tokens, h + 2, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    paged_attention(q_wide.to(DEVICE)[:, :h], batch.k_cache, batch.v_cache, out[:, :h],
                    batch.block_tables, batch.seq_lens,
                    torch.tensor(starts, dtype=torch.int32, device=DEVICE), scale=scale,
                    max_query_len=max(qlens), sliding_window=window)
    for b, (ctx, qlen) in enumerate(seqs):
        if qlen == 0:
            continue
        k, v = batch.contexts[b]
        ref = reference(q[starts[b]:starts[b + 1]], k, v, torch.arange(ctx, ctx + qlen), scale,
                        window)
        assert_close(out[starts[b]:starts[b + 1], :h], ref, dtype)
    assert out[starts[-1]:].isnan().all(), "rows past the last sequence were written"
    assert out[:, h:].isnan().all(), "wrote outside the heads of out's row"


def test_varlen_tile_size_does_not_change_results():
    """max_query_len only picks the tile shape: an over-estimate gives the same output."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    seqs = [(20, 9), (0, 33), (47, 1), (5, 2)]
    batch = make_batch([c + q for c, q in seqs], 2, 64, 16, torch.float32, gen, rng)
    starts = torch.tensor([0, 9, 42, 43, 45], dtype=torch.int32, device=DEVICE)
    q = torch.randn(45, 6, 64, generator=gen).to(DEVICE)
    outs = []
    for max_query_len in (33, 200):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, batch.k_cache, batch.v_cache, out, batch.block_tables,
                        batch.seq_lens, starts, scale=0.125, max_query_len=max_query_len)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


# --- the decode kernel, with and without split-KV ------------------------------------------

def _decode_cases():
    rng = random.Random(4242)
    splits = [1, 2, 4, 7, 2, 7, 4, 1]
    for i, num_splits in enumerate(splits):
        yield pytest.param(
            i, [16, 32][i % 2], [64, 128][i // 2 % 2], [1, 3, 8][i % 3],
            [torch.float32, torch.bfloat16][i // 4 % 2], [0, rng.randint(5, 50)][i % 2],
            num_splits, id=f"case{i}-splits{num_splits}")


@pytest.mark.parametrize("seed,block_size,head_dim,group,dtype,window,num_splits",
                         list(_decode_cases()))
def test_decode_matches_reference(seed, block_size, head_dim, group, dtype, window,
                                  num_splits):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kvh = 1 + seed % 2
    # short contexts (fewer tiles than splits), block starts/ends, longer ones, padding (0)
    lens = [1, block_size, block_size + 1, rng.randint(2, 100), rng.randint(70, 100), 0]
    rng.shuffle(lens)
    batch = make_batch(lens, kvh, head_dim, block_size, dtype, gen, rng)
    h = kvh * group
    q = torch.randn(len(lens), h, head_dim, generator=gen).to(dtype)
    out = torch.full((len(lens), h, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    # a static workspace larger than needed, poisoned, as a CUDA graph would hold it
    ws = DecodeWorkspace.allocate(len(lens) + 2, h, head_dim, num_splits + 1, DEVICE)
    for t in (ws.m, ws.l, ws.acc):
        t.fill_(float("nan"))
    scale = head_dim ** -0.5
    paged_decode_attention(q.to(DEVICE), batch.k_cache, batch.v_cache, out, batch.block_tables,
                           batch.seq_lens, scale=scale, sliding_window=window,
                           num_splits=num_splits, workspace=ws)
    for b, n in enumerate(lens):
        if n == 0:
            assert out[b].isnan().all(), "a padding row (seq_len 0) was written"
            continue
        k, v = batch.contexts[b]
        ref = reference(q[b:b + 1], k, v, torch.tensor([n - 1]), scale, window)
        assert_close(out[b:b + 1], ref, dtype)


def test_decode_workspace_is_reusable_across_lengths():
    """One workspace and a fixed split count serve steps with different lengths (the CUDA
    graph case); the split ranges follow seq_lens on the device, and the result equals the
    unsplit kernel's."""
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    ws = DecodeWorkspace.allocate(3, 4, 64, 4, DEVICE)
    for lens in ([3, 90, 40], [97, 1, 0]):
        batch = make_batch(lens, 1, 64, 16, torch.float32, gen, rng)
        q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
        split, whole = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
        paged_decode_attention(q, batch.k_cache, batch.v_cache, split, batch.block_tables,
                               batch.seq_lens, scale=0.125, num_splits=4, workspace=ws)
        paged_decode_attention(q, batch.k_cache, batch.v_cache, whole, batch.block_tables,
                               batch.seq_lens, scale=0.125)
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_decode_equals_varlen_on_single_tokens():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    lens = [17, 64, 33]
    batch = make_batch(lens, 2, 128, 32, torch.float32, gen, rng)
    q = torch.randn(3, 6, 128, generator=gen).to(DEVICE)
    a, b = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    paged_decode_attention(q, batch.k_cache, batch.v_cache, a, batch.block_tables,
                           batch.seq_lens, scale=0.1, sliding_window=20, num_splits=2)
    paged_attention(q, batch.k_cache, batch.v_cache, b, batch.block_tables, batch.seq_lens,
                    torch.arange(4, dtype=torch.int32, device=DEVICE), scale=0.1,
                    max_query_len=1, sliding_window=20)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- host-side contracts -------------------------------------------------------------------

def test_choose_num_splits():
    assert choose_num_splits(batch=256, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 16
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=1000, num_sms=132) == 2
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1
    assert choose_num_splits(batch=8, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 8
    for batch in range(1, 300, 7):
        s = choose_num_splits(batch, 8, 4096, 132)
        assert s & (s - 1) == 0 and 1 <= s <= 16


def test_bad_inputs_are_rejected():
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([5], 1, 64, 16, torch.float32, gen, random.Random(0))
    q = torch.randn(1, 2, 64, device=DEVICE)
    out = torch.empty_like(q)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, batch.k_cache, batch.v_cache, out, batch.block_tables.long(),
                        batch.seq_lens, starts, scale=1.0, max_query_len=1)
    with pytest.raises(ValueError, match="query_start"):
        paged_attention(q, batch.k_cache, batch.v_cache, out, batch.block_tables,
                        batch.seq_lens, starts[:1], scale=1.0, max_query_len=1)
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(q[:, :, :32].contiguous(), batch.k_cache, batch.v_cache,
                        out[:, :, :32].contiguous(), batch.block_tables, batch.seq_lens,
                        starts, scale=1.0, max_query_len=1)
    with pytest.raises(ValueError, match="cache dtype"):
        paged_decode_attention(q.bfloat16(), batch.k_cache, batch.v_cache, out.bfloat16(),
                               batch.block_tables, batch.seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, batch.k_cache, batch.v_cache, out, batch.block_tables,
                               batch.seq_lens, scale=1.0, sliding_window=-1)
    small = DecodeWorkspace.allocate(1, 2, 64, 2, DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(q, batch.k_cache, batch.v_cache, out, batch.block_tables,
                               batch.seq_lens, scale=1.0, num_splits=4, workspace=small)


# --- quantized pages: written and read on the kernels' device ------------------------------

@pytest.mark.parametrize(("name", "dtype"), [("int8", torch.float32), ("fp8", torch.bfloat16)])
def test_quantized_pages_written_and_attended_on_the_device(name, dtype):
    """On the kernels' device (a GPU, or the CPU under the interpreter), over pages
    `[num_blocks, KVH, bs * (D + 2)]` poisoned with 0xFF (a NaN scale) wherever nothing was
    written: `reshape_and_cache` writes exactly the torch reference's codes and scales at
    shuffled slots, and the split-KV decode and varlen kernels over those pages match the
    float64 reference over the dequantized rows (float32, and bfloat16 queries as served)."""
    from tandem.engine.kernels.triton_ops import reshape_and_cache
    from tandem.engine.kv_cache.quant import dequantize_rows, page_parts, quantize_rows

    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    bs, d, kvh, h = 16, 64, 2, 4
    lens, qlens = [1, 19, 40, 33], [1, 5, 12, 33]
    needed = [-(-n // bs) for n in lens]
    num_blocks = sum(needed) + 2  # a spare block, and the poison block the padding points at
    ids = list(range(num_blocks - 1))
    rng.shuffle(ids)
    tables = torch.full((len(lens), max(needed) + 1), num_blocks - 1, dtype=torch.int32)
    slots = []
    for b, (n, w) in enumerate(zip(lens, needed, strict=True)):
        blocks = [ids.pop() for _ in range(w)]
        tables[b, :w] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // bs] * bs + p % bs for p in range(n)]
    t = sum(lens)
    k, v = (torch.randn(t, kvh, d, generator=gen) * torch.exp(torch.randn(t, kvh, 1,
                                                                          generator=gen))
            for _ in range(2))
    caches = [torch.full((num_blocks, kvh, bs * (d + 2)), 0xFF, dtype=torch.uint8,
                         device=DEVICE) for _ in range(2)]
    reshape_and_cache(k.to(DEVICE), v.to(DEVICE), *caches, torch.tensor(slots, device=DEVICE),
                      kv_cache_dtype=name, block_size=bs)
    slot = torch.tensor(slots)
    deq = []
    for cache, x in zip(caches, (k, v), strict=True):
        codes, scales = page_parts(cache.cpu(), bs)
        want_codes, want_scales = quantize_rows(x, name)
        assert torch.equal(codes[slot // bs, :, slot % bs], want_codes)
        assert torch.equal(scales[slot // bs, :, slot % bs], want_scales)
        deq.append(dequantize_rows(want_codes, want_scales, name, torch.float64).split(lens))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    tables, scale = tables.to(DEVICE), d ** -0.5
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_decode_attention(q.to(DEVICE), *caches, out, tables, seq_lens, scale=scale,
                           num_splits=2, kv_cache_dtype=name, block_size=bs)
    for b, n in enumerate(lens):
        ref = reference(q[b:b + 1], deq[0][b], deq[1][b], torch.tensor([n - 1]), scale, 0)
        assert_close(out[b:b + 1], ref, dtype)
    starts = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), h, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_attention(q.to(DEVICE), *caches, out, tables, seq_lens, starts.to(DEVICE),
                    scale=scale, max_query_len=max(qlens), kv_cache_dtype=name, block_size=bs)
    for b, (n, ql) in enumerate(zip(lens, qlens, strict=True)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        ref = reference(q[rows], deq[0][b], deq[1][b], torch.arange(n - ql, n), scale, 0)
        assert_close(out[rows], ref, dtype)
    with pytest.raises(ValueError, match="needs its block_size"):
        paged_decode_attention(q[:4].to(DEVICE), *caches, out[:4], tables, seq_lens,
                               scale=scale, kv_cache_dtype=name)


_COMPILE_SCRIPT = textwrap.dedent("""
    import collections, inspect, json, re
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tandem.engine.kernels import triton_attention as A

    OPS = re.compile(r"(?:ld\\.global|cp\\.async\\.cg|mma\\.sync|wgmma\\.mma_async)[.a-z0-9]*")
    report = {}

    def build(name, kernel, ptrs, const, **opts):
        names = list(inspect.signature(kernel.fn).parameters)
        sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "scale_log2"
               else "i32") for n in names}
        # what the launcher specialises: 16-byte aligned pointers, strides divisible by 16
        div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n.endswith("_ptr") or n.startswith("stride")}
        src = ASTSource(kernel, signature=sig, attrs=div,
                        constexprs={(names.index(k),): v for k, v in const.items()})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        ops = collections.Counter(m.split(".f32")[0] for m in OPS.findall(c.asm["ptx"]))
        report[name] = {"shared": c.metadata.shared, "ops": dict(ops)}

    io = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "o_ptr")}
    tables = {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qs_ptr": "*i32"}
    ws = {"ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32"}
    common = dict(BLOCK_SIZE=16, HEAD_DIM=128, D_PAD=128, BLOCK_N=64, DOT=tl.bfloat16,
                  PRECISION="tf32", KV_FMT=0)
    build("prefill", A._varlen_kernel, {**io, **tables},
          dict(common, GROUP=8, BLOCK_M=128, BLOCK_Q=16), num_warps=8, num_stages=2)
    build("mixed", A._varlen_kernel, {**io, **tables},
          dict(common, GROUP=1, BLOCK_M=16, BLOCK_Q=16), num_warps=4, num_stages=2)
    build("decode", A._decode_kernel, {**io, **tables, **ws},
          dict(common, GROUP=8, BLOCK_M=16, NUM_SPLITS=4), num_warps=4, num_stages=3)
    build("reduce", A._reduce_kernel, {"o_ptr": "*bf16", "seq_lens_ptr": "*i32", **ws},
          dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=4, BLOCK_S=4), num_warps=4)
    print(json.dumps(report))
""")


def test_kernels_compile_for_h200(tmp_path):
    """The interpreter runs Python; this compiles the real kernels (TTIR -> PTX -> cubin by
    the ptxas Triton ships) for sm_90 in bfloat16 and checks the code an H200 would run:
    K/V tiles arrive by 16-byte asynchronous copies (vectorised and pipelined, no scalar
    16-bit loads), QK^T and PV run on tensor cores (wgmma for 128-row prefill tiles), and
    shared memory fits."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, kernel in report.items():
        ops = kernel["ops"]
        assert kernel["shared"] < 200 * 1024, (name, kernel)
        assert not any(op.startswith("ld.global") and op.endswith(("b16", "u16")) for op in ops)
        if name != "reduce":
            assert ops.get("cp.async.cg.shared.global", 0) >= 16, (name, ops)
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in report["prefill"]["ops"]
    for name in ("mixed", "decode"):
        assert "mma.sync.aligned.m16n8k16.row.col" in report[name]["ops"], report[name]


@pytest.mark.parametrize(("qlen", "group", "d_pad", "elt", "limit", "want"), [
    (512, 4, 128, 2, 227 * 1024, 128),  # H100/H200: the full 128-row bf16 tile (~112 KiB)
    (512, 4, 128, 2, 99 * 1024, 128),   # sm_86 / sm_89: fits too (compiled: 64 KiB)
    (512, 4, 128, 2, 48 * 1024, 64),    # 64 rows x 32 keys
    (512, 4, 128, 4, 227 * 1024, 64),   # fp32: at most 64 rows
    (1, 8, 128, 2, 99 * 1024, 16),      # a decode's group fills a 16-row tile
    (1, 32, 128, 2, 16 * 1024, 32),     # never under the group, whatever the limit
])
def test_varlen_tile_fits_the_devices_shared_memory(qlen, group, d_pad, elt, limit, want):
    assert varlen_block_m(qlen, group, d_pad, elt, limit) == want

