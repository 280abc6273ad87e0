"""Triton element-wise kernels (engine/kernels/triton_ops.py) against float64 references and
the torch path of `Ops`; on the CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from tandem.engine.errors import ConfigError  # noqa: E402
from tandem.engine.kernels import triton_unavailable_reason  # noqa: E402
from tandem.engine.model.ops import Ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |got - ref| / max |ref| against float64
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def K():
    assert triton_unavailable_reason(DEVICE) is None
    from tandem.engine.kernels import triton_ops

    return triton_ops


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not got.isnan().any(), "unwritten (NaN-poisoned) elements left"
    return ((got.double().cpu() - ref.cpu()).abs().max() / ref.abs().max()).item()


def rope_tables(d: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().float().to(DEVICE), emb.sin().float().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_x", [True, False])
@pytest.mark.parametrize(("seed", "t", "h"), [(0, 1, 576), (1, 7, 576), (2, 33, 1000),
                                             (3, 5, 64)])
def test_add_rms_norm_matches_float64(K, dtype, with_x, seed, t, h):
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(t, h + 40, generator=g) * 2).to(dtype).to(DEVICE)
    x = wide[:, 7:7 + h] if with_x else None  # strided rows
    res = (torch.randn(t, h, generator=g) * 3).to(dtype).to(DEVICE)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype).to(DEVICE)
    res64 = res.double().cpu() + (x.double().cpu() if with_x else 0)
    rms = torch.rsqrt(res64.pow(2).mean(-1, keepdim=True) + 1e-5)
    want = res64 * rms * w.double().cpu()
    out = torch.full((t, h), float("nan"), dtype=dtype, device=DEVICE)
    got, got_res = K.add_rms_norm(x, res, w, 1e-5, out=out)
    assert got.data_ptr() == out.data_ptr() and got_res.data_ptr() == res.data_ptr()
    assert rel_err(got_res, res64) < TOL[dtype]
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("seed", "t", "i"), [(0, 1, 1536), (1, 6, 1536), (2, 19, 333),
                                             (3, 64, 80)])
def test_silu_mul_matches_float64(K, dtype, seed, t, i):
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(t, 2 * i + 8, generator=g) * 4).to(dtype).to(DEVICE)
    gate_up = wide[:, 3:3 + 2 * i]  # strided rows
    gate, up = gate_up.double().cpu().split(i, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    out = torch.full((t, i), float("nan"), dtype=dtype, device=DEVICE)
    assert K.silu_mul(gate_up, out=out).data_ptr() == out.data_ptr()
    assert rel_err(out, want) < TOL[dtype]
    assert torch.equal(K.silu_mul(gate_up), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("seed", "t", "heads", "kv_heads", "d"),
                         [(0, 1, 9, 3, 64), (1, 5, 9, 3, 64), (2, 23, 4, 4, 128),
                          (3, 8, 6, 1, 96)])
def test_rope_in_place_on_the_fused_qkv_view(K, dtype, seed, t, heads, kv_heads, d):
    g = torch.Generator().manual_seed(seed)
    pos_dtype = (torch.int32, torch.int64)[seed % 2]
    max_pos = 5000
    cos, sin = rope_tables(d, max_pos)
    # as the model: q and k heads rotated in place inside the [T, H + 2 KVH, D] qkv rows
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(DEVICE)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    pos = torch.randperm(max_pos, generator=g)[:t]  # unsorted
    if t > 3:
        pos[3] = pos[0]  # and repeated
    x64 = before[:, : (heads + kv_heads) * d].view(t, -1, d).double().cpu()
    c, s = cos.double().cpu()[pos][:, None, :], sin.double().cpu()[pos][:, None, :]
    half = d // 2
    want = x64 * c + torch.cat((-x64[..., half:], x64[..., :half]), dim=-1) * s
    assert K.rope_(qk, pos.to(pos_dtype).to(DEVICE), cos, sin) is qk
    assert rel_err(qk, want) < TOL[dtype]
    v = (heads + kv_heads) * d
    assert torch.equal(qkv[:, v:], before[:, v:])  # the V heads are not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seed", "t", "kv_heads", "block_size", "d"),
                         [(0, 1, 3, 16, 64), (1, 20, 3, 16, 64), (2, 45, 2, 32, 128),
                          (3, 9, 1, 32, 64), (4, 31, 4, 16, 128), (5, 12, 2, 32, 128)])
def test_reshape_and_cache_writes_exactly_the_mapped_slots(K, dtype, seed, t, kv_heads,
                                                          block_size, d):
    g = torch.Generator().manual_seed(seed)
    slot_dtype = (torch.int32, torch.int64)[seed % 2]
    num_blocks, heads = 6, 2 * kv_heads
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(DEVICE)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)  # strided rows
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]  # shuffled
    slots[torch.randperm(t, generator=g)[: t // 3]] = -1  # CUDA-graph padding
    shape = (num_blocks, kv_heads, block_size, d)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    K.reshape_and_cache(k, v, k_cache, v_cache, slots.to(slot_dtype).to(DEVICE))
    written = 0
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            blk, off = divmod(slot, block_size)
            assert torch.equal(k_cache[blk, :, off], k[i])
            assert torch.equal(v_cache[blk, :, off], v[i])
            written += 1
    # every other slot still holds its poison
    for cache in (k_cache, v_cache):
        assert int((~cache.isnan()).sum()) == written * kv_heads * d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_triton_matches_the_torch_path(dtype):
    """Through `Ops`: bfloat16 rounds as torch rounds (the interpreter alone would truncate),
    so RoPE and the residual stream are bit-exact and the rest is within one ulp."""
    g = torch.Generator().manual_seed(7)
    tri, ref = Ops(device=DEVICE, dtype=dtype, triton=True), Ops(native=False)
    assert tri.triton is not None and tri.lib is None
    t, h, inter, heads, kv_heads, d = 11, 576, 1536, 9, 3, 64

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    x, res, w = rnd(t, h), rnd(t, h, scale=3), rnd(h)
    got, got_res = tri.add_rms_norm(x, res.clone(), w, 1e-5)
    want, want_res = ref.add_rms_norm(x, res.clone(), w, 1e-5)
    assert torch.equal(got_res, want_res)
    gate_up = rnd(t, 2 * inter, scale=4)
    got_act, want_act = tri.silu_mul(gate_up), ref.silu_mul(gate_up)
    for a, b in ((got, want), (got_act, want_act)):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-2)
            assert (a == b).float().mean() > 0.99  # rounding, not truncation
    cos, sin = rope_tables(d, 4096)
    qkv = rnd(t, (heads + 2 * kv_heads) * d)
    pos = torch.randperm(4096, generator=g)[:t].to(DEVICE)
    views = [q[:, : (heads + kv_heads) * d].view(t, -1, d) for q in (qkv.clone(), qkv.clone())]
    tri.rope_(views[0], pos, cos, sin)
    ref.rope_(views[1], pos, cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(views[0], views[1], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(views[0], views[1])


def test_empty_batches_launch_nothing(K):
    res = torch.zeros(0, 576, device=DEVICE)
    out, same = K.add_rms_norm(None, res, torch.ones(576, device=DEVICE), 1e-5)
    assert out.shape == (0, 576) and same is res
    assert K.silu_mul(torch.zeros(0, 10, device=DEVICE)).shape == (0, 5)
    cache = torch.zeros(2, 1, 16, 64, device=DEVICE)
    empty = torch.zeros(0, 1, 64, device=DEVICE)
    K.reshape_and_cache(empty, empty, cache, cache.clone(),
                        torch.zeros(0, dtype=torch.int64, device=DEVICE))


def test_bad_layouts_are_refused_by_name(K):
    x = torch.randn(4, 3, 64, device=DEVICE)
    cos = sin = torch.randn(10, 64, device=DEVICE)
    with pytest.raises(ValueError, match="x: only its rows may be strided"):
        K.rope_(x.transpose(0, 1), torch.arange(3, device=DEVICE), cos, sin)
    with pytest.raises(ValueError, match="positions must be"):
        K.rope_(x, torch.arange(4, device=DEVICE).float(), cos, sin)
    with pytest.raises(ValueError, match="k_cache must be"):
        K.reshape_and_cache(x, x, torch.zeros(2, 2, 16, 64, device=DEVICE),
                            torch.zeros(2, 2, 16, 64, device=DEVICE),
                            torch.arange(4, device=DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        K.add_rms_norm(None, x[:, 0], torch.ones(3, device=DEVICE), 1e-5)
    # Ops sends layouts the kernels refuse to torch instead
    ops, ref = Ops(device=DEVICE, triton=True), Ops(native=False)
    gu = torch.randn(10, 6, device=DEVICE).t()
    torch.testing.assert_close(ops.silu_mul(gu), ref.silu_mul(gu))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_unavailable_reasons(monkeypatch):
    assert triton_unavailable_reason(torch.device("cpu")) is None  # interpreter on
    assert "CUDA is not available" in triton_unavailable_reason(torch.device("cuda"))
    assert "do not run on meta" in triton_unavailable_reason(torch.device("meta"))
    with pytest.raises(ConfigError, match="Triton ops on cuda:0: CUDA is not available"):
        Ops(device=torch.device("cuda:0"), triton=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in triton_unavailable_reason(torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "triton", None)  # a torch-only install
    assert triton_unavailable_reason("cpu") == "triton is not installed (pip install triton)"


def test_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter runs Python; this builds the real thing (TTIR -> PTX -> cubin by
    ptxas) for sm_90 in bfloat16, so GPU-only codegen errors surface on a CPU machine."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from tandem.engine.kernels import triton_ops as K

        def build(fn, sig, const):
            src = ASTSource(fn, signature={**sig, **{c: "constexpr" for c in const}},
                            constexprs=const)
            assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]

        i = "i32"
        build(K._add_rms_norm_kernel, dict(out_ptr="*bf16", res_ptr="*bf16", x_ptr="*bf16",
              w_ptr="*bf16", n_rows=i, n_cols=i, out_stride=i, res_stride=i, x_stride=i,
              eps="fp32"), {"HAS_X": True, "ROWS": 4, "BLOCK": 1024})
        build(K._silu_mul_kernel, dict(out_ptr="*bf16", in_ptr="*bf16", n_rows=i, n_cols=i,
              out_stride=i, in_stride=i), {"ROWS": 4, "BLOCK": 1024})
        build(K._rope_kernel, dict(x_ptr="*bf16", pos_ptr="*i32", cos_ptr="*fp32",
              sin_ptr="*fp32", n_tokens=i, n_heads=i, half=i, x_stride=i, cos_stride=i,
              sin_stride=i), {"ROWS": 2, "BLOCK_HEADS": 16, "BLOCK_HALF": 32})
        build(K._reshape_and_cache_kernel, dict(k_ptr="*bf16", v_ptr="*bf16",
              k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_ptr="*i64", n_tokens=i,
              n_heads=i, head_dim=i, block_size=i, k_stride=i, v_stride=i,
              cache_block_stride="i64", cache_head_stride=i),
              {"ROWS": 4, "BLOCK_HEADS": 4, "BLOCK_D": 64})
        print("compiled")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
