"""Quantized KV cache (fp8 e4m3 / int8 codes with a float16 scale per row, in pages of codes
then scales): the row and page formats, code rows 16-byte aligned in every backend's cache,
every attention backend against a float64 reference over the dequantized cache, and the
engine."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem.engine.attention.base import AttentionSpec, BatchLayout, get_backend
from tandem.engine.cpu_isa import cpu_isa
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.quant import (
    FP16_MAX,
    FP16_MIN_NORMAL,
    code_values,
    dequantize_pages,
    dequantize_rows,
    kv_format,
    page_parts,
    quantize_pages,
    quantize_rows,
)
from tests.engine.isa_levels import LEVELS_HERE, forced_level
from tests.engine.test_attention import _reference

FORMATS = ("int8", "fp8")
BACKENDS = ("torch", "cpu", "triton")
CPU = torch.device("cpu")


def _random_rows(gen: torch.Generator, n: int, d: int) -> torch.Tensor:
    """[n, 1, d] rows whose magnitudes span 1e-20 .. 1e6, with zero, sparse and outlier rows."""
    mag = torch.logspace(-20, 6, n, dtype=torch.float64)[torch.randperm(n, generator=gen)]
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * mag[:, None]
    x[0] = 0.0
    x[1, 1:] = 0.0  # one non-zero entry
    x[2, 0] = x[2].abs().max() * 50  # one outlier
    return x.float()[:, None, :]


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_bounds(name):
    gen = torch.Generator().manual_seed(22)
    d = 48
    x = _random_rows(gen, 3000, d)
    raw, s16 = quantize_rows(x, name)
    assert (raw.shape, raw.dtype, s16.shape, s16.dtype) == (
        (3000, 1, d), torch.uint8, (3000, 1), torch.float16)
    codes, s = code_values(raw, name), s16.float()
    # the scale: amax / qmax rounded to float16, clamped to float16's normal range
    qmax = 127.0 if name == "int8" else 448.0
    want = (x.abs().amax(-1).double() / qmax).clamp(FP16_MIN_NORMAL, FP16_MAX)
    assert torch.equal(s, want.float().to(torch.float16).float())
    back = dequantize_rows(raw, s16, name, torch.float64)
    assert torch.equal(back, codes.double() * s.double()[..., None])
    err = (back - x.double()).abs()
    sd = s.double()[..., None]
    if name == "int8":
        assert codes.abs().max() <= 127 and torch.equal(codes, codes.round())
        assert (err <= sd / 2 * (1 + 1e-6)).all()
    else:
        # 3 mantissa bits: half an ulp is 2^-4 relative; subnormal codes step by 2^-9 * s
        assert codes.abs().max() <= 448
        assert (err <= torch.maximum(x.double().abs() * 2.0 ** -4, sd * 2.0 ** -10)).all()
    # the largest entry of every row whose scale is not clamped lands on the top code
    unclamped = x.abs().amax(-1) / qmax >= FP16_MIN_NORMAL
    assert 500 < int(unclamped.sum()) < 2500
    assert (codes.abs().amax(-1)[unclamped] == qmax).all()
    # quantizing the dequantized rows gives the same bytes (what a re-write does)
    again = quantize_rows(back.float(), name)
    assert torch.equal(again[0], raw) and torch.equal(again[1], s16)


@pytest.mark.parametrize("name", FORMATS)
def test_a_page_is_its_codes_then_its_scales(name):
    """[..., bs, D] rows -> pages [..., bs * (D + 2)]: row o's codes at byte o * D, its
    float16 scale (little-endian) at bs * D + 2 * o; page_parts views both in place."""
    bs, d = 8, 16
    x = torch.randn(3, 2, bs, d, generator=torch.Generator().manual_seed(1)) * 5
    pages = quantize_pages(x, name)
    assert pages.shape == (3, 2, bs * (d + 2)) and pages.dtype == torch.uint8
    codes, s16 = quantize_rows(x, name)
    raw = pages.numpy()
    for o in range(bs):
        assert (raw[..., o * d:(o + 1) * d] == codes[..., o, :].numpy()).all()
        lo, hi = raw[..., bs * d + 2 * o], raw[..., bs * d + 2 * o + 1]
        bits = s16[..., o].view(torch.int16).numpy().astype(np.uint16)
        assert ((lo.astype(np.uint16) | hi.astype(np.uint16) << 8) == bits).all()
    got_codes, got_scales = page_parts(pages, bs)
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, s16)
    got_scales[1, 0, 3] = 2.0  # a view: writes go to the page
    assert pages[1, 0, bs * d + 6:bs * d + 8].tolist() == [0, 0x40]
    assert torch.equal(dequantize_pages(quantize_pages(x, name), name, bs, torch.float32),
                       dequantize_rows(codes, s16, name, torch.float32))
    with pytest.raises(ValueError, match="quantized pages must be"):
        page_parts(pages, 7)


@pytest.mark.parametrize("name", FORMATS)
def test_out_of_range_rows_saturate(name):
    x = torch.tensor([[[3e9, -1e12, 1.0, 0.0]]])
    raw, s = quantize_rows(x, name)
    codes = code_values(raw, name)
    assert float(s) == FP16_MAX
    qmax = 127.0 if name == "int8" else 448.0
    assert codes.tolist() == [[[qmax, -qmax, 0.0, 0.0]]]


def test_format_names_and_sizes():
    assert kv_format("fp8_e4m3") == kv_format("fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        kv_format("fp4")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        get_backend("torch")(AttentionSpec(2, 1, 8, 1.0), 16, torch.float32, CPU, "e5m2")
    f = kv_format("int8")
    assert (f.row_bytes(64, torch.float32), f.cache_dtype(torch.float32)) == (66, torch.uint8)
    assert f.cache_shape(5, 3, 16, 64) == (5, 3, 16 * 66)
    assert kv_format("auto").cache_shape(5, 3, 16, 64) == (5, 3, 16, 64)
    auto = kv_format("auto")
    assert (auto.row_bytes(64, torch.bfloat16), auto.cache_dtype(torch.bfloat16)) == (
        128, torch.bfloat16)
    spec = AttentionSpec(9, 3, 64, 0.125)
    for name in BACKENDS:
        plain = get_backend(name)(spec, 16, torch.float32, CPU)
        quant = get_backend(name)(spec, 16, torch.float32, CPU, "fp8")
        assert plain.bytes_per_block() == 2 * 16 * 3 * 64 * 4
        assert quant.bytes_per_block() == 2 * 16 * 3 * 66
        k, v = quant.allocate_kv_cache(5)
        assert k.shape == v.shape == (5, 3, 16 * 66) and k.dtype == torch.uint8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FORMATS)
def test_every_code_row_of_a_quantized_cache_starts_16_byte_aligned(backend, name):
    """On the tensors each backend allocates, for block sizes 8 / 16 / 32 and head dims
    64 / 128: every (block, KV head, row)'s codes start at a multiple of 16 bytes, and so
    does every page's run of scales (with the rows' D + 2 bytes inline, row 1 sat at
    byte D + 2)."""
    for bs in (8, 16, 32):
        for d in (64, 128):
            be = get_backend(backend)(AttentionSpec(4, 2, d, 1.0), bs, torch.float32, CPU,
                                      name)
            for cache in be.allocate_kv_cache(3):
                codes, scales = page_parts(cache, bs)
                base = codes.data_ptr()
                assert base % 16 == 0
                starts = (base + np.arange(codes.shape[0])[:, None, None] * codes.stride(0)
                          + np.arange(codes.shape[1])[None, :, None] * codes.stride(1)
                          + np.arange(bs)[None, None, :] * codes.stride(2))
                assert codes.shape[1:] == (2, bs, d) and codes.stride(3) == 1
                assert (starts % 16 == 0).all(), (bs, d)
                assert scales.data_ptr() % 16 == 0 and scales.stride(0) * 2 % 16 == 0
                assert scales.stride(1) * 2 % 16 == 0 and scales.stride(2) == 1


def _run(backend_name, name, shapes, h, kvh, d, window, seed, splits=None,
         dtype=torch.float32, level=None):
    """One forward of `shapes` [(cached, new)] (decodes first) on a fresh quantized cache
    (a `dtype` model; the native kernels of CPU level `level`, default the CPU's); returns
    (out, cache, per-sequence (cached, new, table, q), (k_new, v_new, slots), meta)."""
    bs, nblocks = 16, 48
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    spec = AttentionSpec(h, kvh, d, d ** -0.5, window)
    with forced_level(level or cpu_isa().level):
        backend = get_backend(backend_name)(spec, bs, dtype, CPU, name)
    cache = backend.allocate_kv_cache(nblocks)
    free = list(range(nblocks))
    rng.shuffle(free)
    seqs, slots, ks, vs = [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // bs))]
        k_all = (torch.randn(total, kvh, d, generator=gen) * 3).to(dtype)
        v_all = torch.randn(total, kvh, d, generator=gen).to(dtype)
        pos = torch.arange(cached)  # written by earlier steps
        blk = torch.tensor(table, dtype=torch.int64)[pos // bs]
        for c, x in zip(cache, (k_all, v_all), strict=True):
            codes, scales = page_parts(c, bs)
            codes[blk, :, pos % bs], scales[blk, :, pos % bs] = quantize_rows(x[:cached], name)
        slots += [table[p // bs] * bs + p % bs for p in range(cached, total)]
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        seqs.append((cached, new, table, torch.randn(new, h, d, generator=gen).to(dtype)))
    layout = BatchLayout([n for _, n in shapes], [c + n for c, n in shapes],
                         [s[2] for s in seqs], torch.tensor(slots),
                         sum(1 for _, n in shapes if n == 1), bs)
    meta = backend.build_metadata(layout)
    if splits:
        meta.num_splits = splits
    k_new, v_new = torch.cat(ks), torch.cat(vs)
    out = backend.forward(torch.cat([s[3] for s in seqs]), k_new, v_new, cache, meta)
    return out, cache, seqs, (k_new, v_new, torch.tensor(slots)), meta


def _check_against_reference(name, result, window, bs=16, rtol=1e-5, prefill_tol=None):
    """The written bytes, and the output against float64 over the dequantized cache
    (`prefill_tol` (atol, rtol): another bound for prefill chunks)."""
    out, cache, seqs, (k_new, v_new, slots), _ = result
    parts = [page_parts(c, bs) for c in cache]
    # the write path: the new rows hold exactly quantize_rows' bytes
    for (codes, scales), x in zip(parts, (k_new, v_new), strict=True):
        want_codes, want_scales = quantize_rows(x, name)
        assert torch.equal(codes[slots // bs, :, slots % bs], want_codes)
        assert torch.equal(scales[slots // bs, :, slots % bs], want_scales)
    start = 0
    for cached, new, table, q in seqs:
        pos = torch.arange(cached + new)
        tb = torch.tensor(table)[pos // bs]
        k_deq, v_deq = (dequantize_rows(codes[tb, :, pos % bs], scales[tb, :, pos % bs], name,
                                        torch.float64) for codes, scales in parts)
        ref = _reference(q, k_deq, v_deq, torch.arange(cached, cached + new), window)
        atol, rt = prefill_tol if prefill_tol and new > 1 else (2e-5, rtol)
        torch.testing.assert_close(out[start : start + new].double(), ref, atol=atol, rtol=rt)
        start += new


# Triton's interpreter is slow: it runs two of the four format x window combinations
@pytest.mark.parametrize(("name", "window", "backends"), [
    ("int8", None, BACKENDS), ("int8", 21, BACKENDS[:2]), ("fp8", None, BACKENDS[:2]),
    ("fp8", 21, BACKENDS)])
def test_mixed_batch_all_backends_match_dequantized_reference(name, window, backends):
    """Decodes, a fresh prompt, and chunks after a cached prefix (GQA 6/2 heads); the
    backends write the same bytes and agree with the float64 reference."""
    shapes = [(3, 1), (17, 1), (40, 1), (0, 13), (21, 6), (16, 40)]
    results = {b: _run(b, name, shapes, 6, 2, 32, window, seed=5) for b in backends}
    for b, result in results.items():
        _check_against_reference(name, result, window)
        if b != "torch":
            for c, ref in zip(result[1], results["torch"][1], strict=True):
                assert torch.equal(c, ref)
            torch.testing.assert_close(result[0], results["torch"][0], atol=2e-5, rtol=1e-5)
    # with AVX2 + FMA the native prefill kernel ran, over a float copy of the used blocks
    lib = __import__("tandem.engine.native", fromlist=["x"]).load_native()
    if lib.tandem_linear_simd():
        assert results["cpu"][4].prefill_blocks is not None


@pytest.mark.parametrize(("h", "kvh", "d"), [(9, 3, 64), (4, 4, 128), (8, 1, 36)])
@pytest.mark.parametrize("name", FORMATS)
def test_decode_only_batches_read_the_quantized_cache(name, h, kvh, d):
    """Decode batches (the native q8 kernel's D 64 / 128 / generic copies; Triton's split-KV
    decode kernel at D 64 only, for time): every backend writes the torch reference's page
    bytes exactly, and its decodes agree with the torch backend's and the reference."""
    shapes = [(0, 1), (5, 1), (33, 1), (70, 1)]
    results = {}
    for b in BACKENDS if d == 64 else BACKENDS[:2]:
        results[b] = _run(b, name, shapes, h, kvh, d, None, seed=9,
                          splits=2 if b == "triton" else None)
        _check_against_reference(name, results[b], None)
    for b, result in results.items():
        for c, ref in zip(result[1], results["torch"][1], strict=True):
            assert torch.equal(c, ref), b
        torch.testing.assert_close(result[0], results["torch"][0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("name", FORMATS)
def test_bfloat16_models_read_the_quantized_cache_natively(name, level):
    """A bfloat16 model over a quantized cache, native kernels at each CPU level: bfloat16
    q in, float32 arithmetic over the codes, bfloat16 out (rounded once: half an ulp, 2^-9
    relative), for decodes and (from AVX2) prefill chunks alike. Below AVX2 prefill chunks
    run torch's bfloat16 SDPA, which rounds scores and probabilities on the way."""
    shapes = [(3, 1), (17, 1), (40, 1), (0, 13), (21, 6), (16, 40)]
    result = _run("cpu", name, shapes, 6, 2, 32, None, seed=7, dtype=torch.bfloat16,
                  level=level)
    assert result[0].dtype == torch.bfloat16
    assert (result[4].native_prefills is not None) == (level != "scalar")
    _check_against_reference(name, result, None, rtol=2 ** -8,
                             prefill_tol=(2 ** -5, 2 ** -6) if level == "scalar" else None)


def test_cpu_prefill_remaps_only_the_used_blocks():
    from tandem.engine.attention.cpu_backend import _remap_blocks

    table = np.array([[7, 3, 9], [3, 0, 0], [12, 7, 0]], dtype=np.int32)
    remapped, blocks = _remap_blocks(table, [40, 5, 20], 16)
    assert blocks.tolist() == [3, 7, 9, 12]
    assert remapped.tolist() == [[1, 0, 2], [0, 0, 0], [3, 1, 0]]


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to German: 'Good morning, how are you?'",
    "The three primary colors are",
    "import numpy as np\n\ndef softmax(x):\n",
    "Water boils at a temperature of",
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def quantized_llms():
    from tandem import LLM

    # the same engine arguments as the session's float `real_llm`, but the KV cache dtype
    return {name: LLM(dtype="float32", kv_cache_memory=1 << 30, max_num_batched_tokens=512,
                      kv_cache_dtype=name) for name in FORMATS}


@pytest.mark.slow
def test_engine_greedy_tokens_with_quantized_kv(real_llm, quantized_llms, capsys):
    """The bundled model with an fp8 / int8 KV cache: ~3.9x the blocks for the same memory
    (D 64: 256 float32 bytes vs 66 per row), greedy tokens mostly those of float KV, and a
    warm prefix cache (chunks reading cached quantized blocks) reproduces them."""
    from tandem import SamplingParams

    tok = real_llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in real_llm.generate(prompts, params)]
    float_blocks = real_llm.engine.state.num_kv_blocks
    for name, llm in quantized_llms.items():
        ratio = llm.engine.state.num_kv_blocks / float_blocks
        assert abs(ratio - 256 / 66) < 0.01, ratio
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pairs = list(zip(ref, got, strict=True))
        same = sum(a == b for r, g in pairs for a, b in zip(r, g, strict=True))
        first4, first8 = (sum(r[:n] == g[:n] for r, g in pairs) for n in (4, 8))
        with capsys.disabled():
            print(f"\nkv {name}: {same}/{len(prompts) * MAX_NEW} greedy tokens equal float "
                  f"KV's; first 4 / 8 equal on {first4} / {first8} of {len(prompts)} prompts")
        # measured on the dev VM: int8 112/128 tokens equal (7/8 prompts' first 8); fp8
        # 92/128 (5/8): 3 mantissa bits are up to 6% error on every entry, where int8's
        # per-row grid is finer on a row's large entries, which dominate q.k
        assert first4 >= 6 and first8 >= (6 if name == "int8" else 4)
        if name == "fp8":  # both formats share this path; once is enough for the time
            again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert again == got


_COMPILE_SCRIPT = r"""
import inspect, json, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.engine.kernels import triton_attention as A, triton_ops as O

report = {}

def build(name, kernel, ptrs, const, **opts):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("scale_log2",)
           else "i32") for n in names}
    # what Triton specializes on at run time for D 128, block size 16: 16-byte aligned
    # pointers, and strides / sizes that are multiples of 16 (pages of 16 * 130 bytes)
    div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
           if n.endswith("_ptr") or "stride" in n or n in ("head_dim", "block_size")}
    src = ASTSource(kernel, signature=sig, attrs=div,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = c.asm["ptx"]
    ops = {}
    for m in re.finditer(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)\.global[.\w]*|cp\.async\.c[ag]"
                         r"\.shared\.global)\s([^;]*);", ptx, re.M):
        key = m.group(1)
        if key.startswith("cp.async"):  # its third operand: the bytes each thread copies
            key += " " + m.group(2).split(",")[2].strip()
        ops[key] = ops.get(key, 0) + 1
    report[name] = {"shared": c.metadata.shared, "div_rn": "div.rn.f32" in ptx, "ops": ops}

io = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_ptr": "*u8", "v_ptr": "*u8", "ks_ptr": "*fp16",
      "vs_ptr": "*fp16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qs_ptr": "*i32",
      "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32"}
common = dict(BLOCK_SIZE=16, HEAD_DIM=128, D_PAD=128, BLOCK_N=64, DOT=tl.bfloat16,
              PRECISION="tf32")
build("varlen_fp8", A._varlen_kernel, io, dict(common, GROUP=1, BLOCK_M=16, BLOCK_Q=16,
      KV_FMT=2), num_warps=4, num_stages=2)
build("decode_int8", A._decode_kernel, io, dict(common, GROUP=4, BLOCK_M=16, NUM_SPLITS=1,
      KV_FMT=1), num_warps=4, num_stages=3)
build("write_fp8", O._reshape_and_quantize_kernel,
      {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8",
       "ks_ptr": "*fp16", "vs_ptr": "*fp16", "slot_ptr": "*i32"},
      dict(FMT=2, ROWS=4, BLOCK_HEADS=8, BLOCK_D=128), num_warps=4)
print(json.dumps(report))
"""


def test_quantized_triton_kernels_compile_for_h200_with_wide_code_accesses(tmp_path):
    """The interpreter runs Python: this compiles the quantized-KV kernels for sm_90 (no
    GPU needed): the varlen (bf16 queries over fp8 pages) and decode (int8) attention
    kernels, and the fp8 write kernel, which divides with IEEE rounding (div.rn), so a GPU
    writes the same bytes as `quantize_rows`. Codes are aligned rows apart from the scales,
    so no kernel touches the cache a byte at a time: the attention kernels copy code tiles
    16 bytes per thread (with the rows' scales inline they issued 144 one-byte loads), and
    the write kernel stores codes as 16-byte vectors."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"varlen_fp8", "decode_int8", "write_fp8"}
    assert all(k["shared"] < 200 * 1024 for k in report.values()), report
    assert report["write_fp8"]["div_rn"]
    for name, k in report.items():
        assert not any(op.startswith(("ld.global.b8", "ld.global.u8", "st.global.b8",
                                      "st.global.u8")) for op in k["ops"]), (name, k["ops"])
    for name in ("varlen_fp8", "decode_int8"):
        # K and V tiles [64, 128] bytes, 128 threads: 4 copies of 16 bytes each per tile
        assert report[name]["ops"].get("cp.async.cg.shared.global 0x10", 0) >= 8, report[name]
    assert report["write_fp8"]["ops"].get("st.global.v4.b32", 0) >= 4, report["write_fp8"]
