"""Kernel checks for `bench/gpu_check.py`: each Triton kernel against a torch reference, timed.

Import this only after `gpu_check` has settled `TRITON_INTERPRET` (the kernel modules read it
when they are imported). Every check builds `n` input sets whose total size exceeds twice the
L2 cache and rotates through them while timing, so no run finds its inputs in L2. Errors are
max |kernel - reference| / max |reference| against a float32/float64 reference computed from
the same (rounded) inputs; attention outputs are poisoned with NaN first, so an element a
kernel never wrote shows as an infinite error.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class KernelSizes:
    """Shapes of one run: attention geometry, the batches, the element-wise sizes."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    ctx: tuple[int, int]  # decode context lengths drawn from [lo, hi]
    decode_batch: int
    small_batch: int  # a decode batch too small to fill the GPU: the split-KV case
    chunks: tuple[tuple[int, int], ...]  # (cached, new) prefill chunks of the mixed batch
    mixed_decodes: int  # decodes in the mixed batch
    tokens: int  # rows of the element-wise kernels
    hidden: int
    intermediate: int
    iters: int  # timed runs per kernel (fewer if its time cap is hit)
    cap_s: float  # time cap per kernel's timing


# Llama-3-8B-like attention and MLP, a prefill-sized token count.
REAL = KernelSizes(32, 8, 128, 16, (1024, 8192), 64, 8,
                   ((1024, 512), (0, 1024), (3072, 256), (0, 300)), 60, 8192, 4096, 14336,
                   100, 3.0)
# The same code paths at interpreter-friendly sizes (lengths off block multiples, GQA 2).
DRY = KernelSizes(4, 2, 32, 16, (17, 40), 3, 2, ((20, 5), (0, 7)), 1, 8, 64, 48, 1, 5.0)


class Timer:
    """Median milliseconds of a callable over rotating input sets.

    On CUDA each run sits between two events, and every group of runs is queued behind a
    GPU sleep so the CPU's launch overhead is hidden and the events time the GPU alone;
    elsewhere `time.perf_counter` times each (synchronous) call.
    """

    GROUP = 20

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fns: list[Callable[[], object]], iters: int, cap_s: float
                 ) -> dict[str, float | int]:
        if self.cuda:  # compile + warm up every set once (the interpreter has nothing to warm)
            for fn in fns:
                fn()
            torch.cuda.synchronize()
        times: list[float] = []
        deadline = time.perf_counter() + cap_s
        i = 0
        while len(times) < iters and (not times or time.perf_counter() < deadline):
            group = min(self.GROUP, iters - len(times))
            if self.cuda:
                events = [(torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True)) for _ in range(group)]
                torch.cuda._sleep(20_000_000)  # ~10 ms: the queue fills before the GPU runs
                for start, end in events:
                    start.record()
                    fns[i % len(fns)]()
                    end.record()
                    i += 1
                torch.cuda.synchronize()
                times += [start.elapsed_time(end) for start, end in events]
            else:
                for _ in range(group):
                    t0 = time.perf_counter()
                    fns[i % len(fns)]()
                    times.append((time.perf_counter() - t0) * 1e3)
                    i += 1
        return {"median_ms": statistics.median(times), "min_ms": min(times),
                "iters": len(times), "sets": len(fns)}


def num_sets(set_bytes: int, l2_bytes: int, most: int = 32) -> int:
    """Input sets to rotate through: together at least twice the L2 cache, at least 2."""
    return max(2, min(most, math.ceil(2 * l2_bytes / max(1, set_bytes))))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; inf when out holds a NaN/inf (an unwritten element)."""
    diff = (out.double() - ref.double()).abs()
    if not torch.isfinite(diff).all():
        return math.inf
    return float(diff.max() / ref.double().abs().max().clamp_min(1e-30))


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer, iters: int) -> dict:
    """Device-to-device copy rate: 2 x bytes (read + write) / median time of `dst.copy_(src)`."""
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    t = timer([lambda: dst.copy_(src)], iters, 10.0)
    assert torch.equal(dst, src)
    return {"bytes": n * 2, **t, "gb_per_s": 2 * n * 2 / (t["median_ms"] * 1e-3) / 1e9}


# ----------------------------------------------------------------------------- attention


@dataclass
class PagedSet:
    """One paged batch over a shared KV pool: device metadata + host lengths."""

    q: torch.Tensor
    out: torch.Tensor
    k_cache: torch.Tensor  # the shared pool [num_blocks, KVH, block_size, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start: torch.Tensor  # [B + 1] int32
    lens: list[int]
    qlens: list[int]


def _paged_sets(shapes: list[list[tuple[int, int]]], sz: KernelSizes, dtype: torch.dtype,
                device: torch.device, rng: random.Random) -> list[PagedSet]:
    """A KV pool holding every set's blocks (disjoint, shuffled) and one PagedSet per shape
    list of (cached, new) pairs; all K/V (new tokens' included) is already in the pool."""
    bs = sz.block_size
    need = [sum(-(-(c + n) // bs) for c, n in s) for s in shapes]
    free = list(range(sum(need)))
    rng.shuffle(free)
    gen = torch.Generator(device=device).manual_seed(rng.randrange(1 << 30))
    pool_shape = (sum(need), sz.kv_heads, bs, sz.head_dim)
    k_cache = torch.randn(pool_shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(pool_shape, generator=gen, device=device, dtype=dtype)
    sets = []
    for s in shapes:
        tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in s]
        width = max(map(len, tables))
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qlens = [n for _, n in s]
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        q = torch.randn(starts[-1], sz.heads, sz.head_dim, generator=gen, device=device,
                        dtype=dtype)
        sets.append(PagedSet(q, torch.full_like(q, math.nan), k_cache, v_cache, bt.to(device),
                             torch.tensor([c + n for c, n in s], dtype=torch.int32,
                                          device=device),
                             torch.tensor(starts, dtype=torch.int32, device=device),
                             [c + n for c, n in s], qlens))
    return sets


def ref_attention(s: PagedSet, scale: float, window: int = 0) -> torch.Tensor:
    """float32 causal attention of every sequence over its paged context (GQA: query head
    h reads KV head h // group), from the same rounded q/K/V the kernel sees."""
    k_cache, v_cache = s.k_cache, s.v_cache
    _, kvh, bs, d = k_cache.shape
    heads = s.q.shape[1]
    group = heads // kvh
    out = torch.zeros(s.q.shape, dtype=torch.float32, device=s.q.device)
    start = 0
    for b, (length, n) in enumerate(zip(s.lens, s.qlens, strict=True)):
        if n:
            nb = -(-length // bs)
            blocks = s.block_tables[b, :nb].long()
            k = k_cache[blocks].transpose(1, 2).reshape(nb * bs, kvh, d)[:length].float()
            v = v_cache[blocks].transpose(1, 2).reshape(nb * bs, kvh, d)[:length].float()
            q = s.q[start:start + n].float().view(n, kvh, group, d)
            scores = torch.einsum("nkgd,lkd->kgnl", q, k) * scale
            qpos = torch.arange(length - n, length, device=q.device)[:, None]
            kpos = torch.arange(length, device=q.device)[None, :]
            mask = kpos <= qpos
            if window:
                mask &= kpos > qpos - window
            probs = scores.masked_fill(~mask, -math.inf).softmax(-1)
            out[start:start + n] = torch.einsum("kgnl,lkd->nkgd", probs, v).reshape(n, heads, d)
        start += n
    return out


def _kv_bytes(s: PagedSet, sz: KernelSizes, dtype: torch.dtype) -> int:
    return sum(s.lens) * sz.kv_heads * sz.head_dim * dtype.itemsize * 2


def _lengths(rng: random.Random, n: int, sz: KernelSizes) -> list[int]:
    return [rng.randint(*sz.ctx) for _ in range(n)]


def attention_checks(sz: KernelSizes, dtype: torch.dtype, device: torch.device, timer: Timer,
                     copy_gbps: float, num_sms: int, l2_bytes: int) -> dict:
    """Mixed-batch varlen attention (plus a sliding-window variant, checked only) and decode
    attention at the full batch and at a small one, without and with split-KV."""
    from tandem.engine.kernels import triton_attention as ta

    rng = random.Random(0)
    scale = sz.head_dim ** -0.5
    tol = TOLERANCE[dtype]
    results: dict[str, dict] = {}

    def record(name: str, s0: PagedSet, sets: list[PagedSet], run, window=0, **extra) -> None:
        run(s0)
        err = rel_err(s0.out, ref_attention(s0, scale, window))
        entry = {"rel_err": err, "tol": tol, "ok": err <= tol, **extra,
                 "batch": len(s0.lens), "tokens": len(s0.q), "max_context": max(s0.lens)}
        if sets:
            entry.update(timer([lambda s=s: run(s) for s in sets], sz.iters, sz.cap_s))
            kv = statistics.mean(_kv_bytes(s, sz, dtype) for s in sets)
            entry["kv_bytes"] = int(kv)
            entry["kv_gb_per_s"] = kv / (entry["median_ms"] * 1e-3) / 1e9
            entry["copy_fraction"] = entry["kv_gb_per_s"] / copy_gbps
        results[name] = entry

    def mixed_shapes() -> list[tuple[int, int]]:
        shapes = list(sz.chunks) + [(n - 1, 1) for n in _lengths(rng, sz.mixed_decodes, sz)]
        rng.shuffle(shapes)
        return shapes

    def set_bytes(shapes: list[tuple[int, int]]) -> int:
        return sum(c + n for c, n in shapes) * sz.kv_heads * sz.head_dim * dtype.itemsize * 2

    first = mixed_shapes()
    n = num_sets(set_bytes(first), l2_bytes)
    sets = _paged_sets([first] + [mixed_shapes() for _ in range(n - 1)], sz, dtype, device,
                       rng)
    max_q = max(n for _, n in sz.chunks)

    def mixed(s: PagedSet, window: int = 0) -> None:
        ta.paged_attention(s.q, s.k_cache, s.v_cache, s.out, s.block_tables, s.seq_lens,
                           s.query_start, scale=scale, max_query_len=max_q, sliding_window=window)

    record("paged_attention_mixed", sets[0], sets, mixed)
    window = max(sz.block_size + 3, min(sz.ctx[0], 4096) // 2 + 1)
    s0 = sets[0]
    s0.out.fill_(math.nan)
    record("paged_attention_mixed_window", s0, [], lambda s: mixed(s, window), window,
           sliding_window=window)
    del sets, s0

    for label, batch in (("decode_batch", sz.decode_batch), ("decode_small", sz.small_batch)):
        shapes = [[(n - 1, 1) for n in _lengths(rng, batch, sz)]]
        n = num_sets(set_bytes(shapes[0]), l2_bytes)
        shapes += [[(m - 1, 1) for m in _lengths(rng, batch, sz)] for _ in range(n - 1)]
        sets = _paged_sets(shapes, sz, dtype, device, rng)
        chosen = ta.choose_num_splits(batch, sz.kv_heads, sz.ctx[1], num_sms)
        # the small batch always runs a split variant, even where the heuristic says 1
        splits = sorted({1, chosen} if label == "decode_batch" else {1, max(2, chosen)})
        for num_splits in splits:
            ws = ta.DecodeWorkspace.allocate(batch, sz.heads, sz.head_dim, num_splits, device) \
                if num_splits > 1 else None

            def decode(s: PagedSet, num_splits=num_splits, ws=ws) -> None:
                ta.paged_decode_attention(s.q, s.k_cache, s.v_cache, s.out, s.block_tables,
                                          s.seq_lens, scale=scale, num_splits=num_splits,
                                          workspace=ws)

            for s in sets:
                s.out.fill_(math.nan)
            record(f"{label}_splits{num_splits}", sets[0], sets, decode,
                   num_splits=num_splits, chosen_by_heuristic=num_splits == chosen)
        del sets
    return results


# ----------------------------------------------------------------------------- element-wise


def elementwise_checks(sz: KernelSizes, dtype: torch.dtype, device: torch.device,
                       timer: Timer, copy_gbps: float, l2_bytes: int) -> dict:
    """add_rms_norm (with and without x), silu_mul, rope_ and reshape_and_cache against
    float64 references; timed against the torch path the engine runs without Triton."""
    from tandem.engine.kernels import triton_ops as to
    from tandem.engine.model.ops import Ops

    torch_ops = Ops(native=False, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    t, h, inter = sz.tokens, sz.hidden, sz.intermediate
    heads, kvh, d = sz.heads, sz.kv_heads, sz.head_dim
    tol = TOLERANCE[dtype]
    e = dtype.itemsize

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    def entry(err: float, sets, triton_fn, torch_fn, nbytes: int, tol: float = tol) -> dict:
        res = {"rel_err": err, "tol": tol, "ok": err <= tol, "bytes": nbytes}
        res.update(timer([lambda s=s: triton_fn(s) for s in sets], sz.iters, sz.cap_s))
        res["gb_per_s"] = nbytes / (res["median_ms"] * 1e-3) / 1e9
        res["copy_fraction"] = res["gb_per_s"] / copy_gbps
        if torch_fn is not None:
            res["torch_median_ms"] = timer([lambda s=s: torch_fn(s) for s in sets], sz.iters,
                                           sz.cap_s)["median_ms"]
            res["speedup_vs_torch"] = res["torch_median_ms"] / res["median_ms"]
        return res

    out: dict[str, dict] = {}
    eps = 1e-5
    weight = (1 + 0.1 * torch.randn(h, generator=gen, device=device)).to(dtype)

    def rms_ref(r: torch.Tensor) -> torch.Tensor:
        r = r.double()
        return weight.double() * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps))

    nbytes = 4 * t * h * e
    sets = [(randn(t, h), randn(t, h)) for _ in range(num_sets(2 * t * h * e, l2_bytes))]
    x, res = sets[0]
    res_ref = res + x  # torch adds in dtype: the residual stream HF keeps
    got, res_out = to.add_rms_norm(x, res.clone(), weight, eps)
    err = max(rel_err(got, rms_ref(res_ref)), rel_err(res_out, res_ref))
    out["add_rms_norm"] = entry(err, sets, lambda s: to.add_rms_norm(s[0], s[1], weight, eps),
                                lambda s: torch_ops.add_rms_norm(s[0], s[1], weight, eps),
                                nbytes)
    got, _ = to.add_rms_norm(None, res.clone(), weight, eps)
    err = rel_err(got, rms_ref(res))
    out["rms_norm_no_residual_add"] = {"rel_err": err, "tol": tol, "ok": err <= tol}

    sets = [randn(t, 2 * inter) for _ in range(num_sets(3 * t * inter * e, l2_bytes))]
    g, u = sets[0].double().split(inter, -1)
    err = rel_err(to.silu_mul(sets[0]), F.silu(g) * u)
    out["silu_mul"] = entry(err, sets, to.silu_mul, torch_ops.silu_mul, 3 * t * inter * e)

    max_pos = 4 * sz.ctx[1]
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().float().to(device), emb.sin().float().to(device)
    width = heads + 2 * kvh
    sets = []
    for _ in range(num_sets(2 * t * width * d * e, l2_bytes)):
        pos = torch.randint(0, max_pos, (t,), generator=gen, device=device)
        sets.append((randn(t, width, d), pos))
    qkv, pos = sets[0]
    x = qkv[:, :heads].double()
    c, s_ = cos[pos].double()[:, None], sin[pos].double()[:, None]
    ref = x * c + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * s_
    work = qkv.clone()
    to.rope_(work[:, :heads], pos, cos, sin)
    err = rel_err(work[:, :heads], ref)
    if not torch.equal(work[:, heads:], qkv[:, heads:]):  # the K/V heads are not its rows
        err = math.inf
    out["rope"] = entry(err, sets, lambda s: to.rope_(s[0][:, :heads], s[1], cos, sin),
                        lambda s: torch_ops.rope_(s[0][:, :heads], s[1], cos, sin),
                        2 * t * heads * d * e)

    bs = sz.block_size
    num_blocks = 2 * -(-t // bs)
    k_cache, v_cache = randn(num_blocks, kvh, bs, d), randn(num_blocks, kvh, bs, d)
    sets = []
    for _ in range(num_sets(4 * t * kvh * d * e, l2_bytes)):
        slots = torch.randperm(num_blocks * bs, generator=gen, device=device)[:t]
        slots[torch.rand(t, generator=gen, device=device) < 0.05] = -1  # graph padding rows
        sets.append((randn(t, width, d), slots))
    qkv, slots = sets[0]
    k, v = qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]
    kc, vc = k_cache.clone(), v_cache.clone()
    to.reshape_and_cache(k, v, kc, vc, slots)
    keep = slots >= 0
    blk, off = slots[keep] // bs, slots[keep] % bs
    kr, vr = k_cache.clone(), v_cache.clone()
    kr[blk, :, off] = k[keep]
    vr[blk, :, off] = v[keep]
    err = 0.0 if torch.equal(kc, kr) and torch.equal(vc, vr) else math.inf  # must be exact

    def cache_write(s) -> None:
        to.reshape_and_cache(s[0][:, heads:heads + kvh], s[0][:, heads + kvh:], k_cache,
                             v_cache, s[1])

    out["reshape_and_cache"] = entry(err, sets, cache_write, None, 4 * t * kvh * d * e, 0.0)
    return out


# ----------------------------------------------------------------------------- quantized matmul


@dataclass(frozen=True)
class QuantSizes:
    """Weight shapes (name, N, K) and activation row counts of the quantized-matmul checks."""

    shapes: tuple[tuple[str, int, int], ...]
    rows: tuple[int, ...]
    iters: int
    cap_s: float


# SmolLM2-135M's fused gate/up, down and LM head, and a Llama-8B-sized square projection.
QUANT_REAL = QuantSizes((("smollm2_gate_up", 3072, 576), ("smollm2_down", 576, 1536),
                         ("smollm2_lm_head", 49152, 576), ("square_4096", 4096, 4096)),
                        (1, 16, 256), 100, 2.0)
QUANT_DRY = QuantSizes((("tiny", 48, 128),), (1, 33), 1, 5.0)


def _quant_methods(w: torch.Tensor, dtype: torch.dtype, device: torch.device) -> dict:
    """name -> (make one weight set, call(set, x), set bytes, float64 weight, x quantized)
    for one float weight [N, K]."""
    from tandem.engine.kernels import triton_quant as tq
    from tandem.engine.quant.base import QuantLinear, quantize_grouped
    from tandem.engine.quant.fp8 import Fp8Method
    from tandem.engine.quant.torch_ref import pack_nibbles

    k = w.shape[1]
    g8 = quantize_grouped(w, 8, k, True)
    g4 = quantize_grouped(w, 4, 32, False)
    c4 = pack_nibbles(g4.codes).contiguous()
    wb = w.to(dtype)

    def nbytes(*ts: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    def fp8_layer(mode: str) -> QuantLinear:
        with torch.device(device):
            layer = QuantLinear(Fp8Method(device=device, mode=mode), k, w.shape[0], False,
                                dtype)
        layer.method.load(layer, 0, w)
        return layer

    methods = {
        "bf16_matmul": (wb.clone, lambda s, x: torch.matmul(x, s.t()), nbytes(wb),
                        wb.double(), False),
        "int8_grouped": (lambda: (g8.codes.clone(), g8.scales.clone()),
                         lambda s, x: tq.grouped_linear(x, s[0], s[1], None, 8, k),
                         nbytes(g8.codes, g8.scales), g8.dequantize(torch.float64), False),
        "int4_g32_grouped": (lambda: (c4.clone(), g4.scales.clone(), g4.mins.clone()),
                             lambda s, x: tq.grouped_linear(x, s[0], s[1], s[2], 4, 32),
                             nbytes(c4, g4.scales, g4.mins), g4.dequantize(torch.float64),
                             False)}
    fp8_mm = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    for mode in (["scaled_mm"] if fp8_mm else []) + ["triton"]:
        layer = fp8_layer(mode)
        methods[f"fp8_{mode}"] = (lambda mode=mode: fp8_layer(mode), lambda s, x: s(x),
                                  nbytes(layer.weight, layer.weight_scale),
                                  layer.method.dequantize(layer).double(), mode == "scaled_mm")
    return methods


def quant_checks(qs: QuantSizes, dtype: torch.dtype, device: torch.device, timer: Timer,
                 copy_gbps: float, l2_bytes: int) -> dict:
    """Quantized linears vs `torch.matmul` on the bf16 weight, per shape and row count:
    `grouped_linear` INT8 (per channel) and INT4 (group 32, with mins), FP8 W8A8 through
    `Fp8Method` "scaled_mm" (its per-token activation quantization included; where the
    device has FP8 matmuls: CUDA >= 8.9, or the CPU's `_scaled_mm`) and FP8 weight-only
    through its "triton" mode. Errors against a float64 reference of each method's own
    dequantized weight (W8A8: and of its quantized activations); weight GB/s = resident
    weight bytes (codes + scales + mins) / median time; `plan` = the Triton launch plan."""
    from tandem.engine.kernels import triton_quant as tq
    from tandem.engine.quant.fp8 import quantize_rows

    gen = torch.Generator(device=device).manual_seed(2)
    tol = TOLERANCE[dtype]
    out: dict[str, dict] = {}
    for shape, n, k in qs.shapes:
        w = torch.randn(n, k, generator=gen, device=device) * 0.05
        for name, (make, call, set_bytes, w64, quant_x) in _quant_methods(w, dtype,
                                                                          device).items():
            sets = [make() for _ in range(num_sets(set_bytes, l2_bytes))]
            for m in qs.rows:
                x = torch.randn(m, k, generator=gen, device=device).to(dtype)
                if quant_x:
                    xq, sx = quantize_rows(x)
                    x64 = xq.double() * sx.double()[:, None]
                else:
                    x64 = x.double()
                err = rel_err(call(sets[0], x), x64 @ w64.t())
                entry = {"shape": shape, "n": n, "k": k, "m": m, "rel_err": err, "tol": tol,
                         "ok": err <= tol, "weight_bytes": set_bytes}
                entry.update(timer([lambda s=s, x=x, call=call: call(s, x) for s in sets],
                                   qs.iters, qs.cap_s))
                sec = entry["median_ms"] * 1e-3
                entry["weight_gb_per_s"] = set_bytes / sec / 1e9
                entry["copy_fraction"] = entry["weight_gb_per_s"] / copy_gbps
                entry["tflops"] = 2 * m * n * k / sec / 1e12
                if name.endswith("_grouped") or name == "fp8_triton":
                    bits = 4 if name.startswith("int4") else 8
                    entry["plan"] = tq.launch_plan(m, n, k, bits, 32 if bits == 4 else k,
                                                   x.element_size(), device)._asdict()
                base = out.get(f"{shape}_m{m}_bf16_matmul")
                if base is not None:
                    entry["speedup_vs_bf16"] = base["median_ms"] / entry["median_ms"]
                out[f"{shape}_m{m}_{name}"] = entry
            del sets
    return out
