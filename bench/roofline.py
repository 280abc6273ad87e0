"""The machine's limits for LLM steps, and an engine run's achieved fraction of them.

Two limits, measured on the machine the benchmark runs on, in the same invocation:

* **weight bandwidth** (GB/s): how fast the cores can stream bytes from memory, measured
  as the best of a few `torch.sum` passes over a 512 MiB float32 tensor (far larger than
  any cache) with the engine's thread count. Every step of a dense model reads all its
  weights once, so `steps * weight_bytes / wall` can never beat it.
* **matrix peak** (FLOP/s, or integer OP/s for int8): the fastest of the large GEMMs
  (2048^3) this process can run: torch's (`torch.mm` in float32 and bfloat16, oneDNN's
  kernels with AMX tiles where the CPU has them, and oneDNN's packed-weight linear;
  `torch._int_mm` for int8 -> int32) and Tandem's native ones (the float32 panels, the
  bfloat16 pair panels, the W8A8 int8 GEMM). The matrix work of a run
  is 2 x (linear parameters - LM head) per computed token plus 2 x LM head per sampled one
  (prefill rows skip the head).

Some VMs change speed from one minute to the next (this project's 2-core dev VM does): call
`measure_limits` before and after the runs and keep the larger (`MachineLimits.best`).

A run's fractions say which wall it is near: decode at small batch sits near the bandwidth
one, prefill near the matrix one; a mode far from both is bound by something else
(attention, element-wise work, host work per step).

    .venv/bin/python bench/roofline.py            # prints this machine's limits as JSON
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GEMM_N = 2048
READ_BYTES = 512 << 20


@dataclass(frozen=True)
class MachineLimits:
    """Measured ceilings (see the module docstring), with the threads they used."""

    read_gbps: float
    gemm_tflops: dict[str, float]  # "float32" / "bfloat16" / "int8" -> TFLOP/s (TOP/s)
    threads: int

    def best(self, other: MachineLimits) -> MachineLimits:
        """The larger of each limit (two measurements on one machine)."""
        keys = self.gemm_tflops.keys() | other.gemm_tflops.keys()
        return MachineLimits(max(self.read_gbps, other.read_gbps),
                             {k: max(self.gemm_tflops.get(k, 0.0),
                                     other.gemm_tflops.get(k, 0.0)) for k in keys},
                             self.threads)


@dataclass(frozen=True)
class ModelFacts:
    """What one step costs a dense decoder: parameters of its matrix multiplies (every
    linear layer and the LM head; not the embedding lookup), of the LM head alone, and all
    parameters."""

    linear_params: int
    head_params: int
    total_params: int


def _best(fn, reps: int) -> float:  # noqa: ANN001 - a no-argument callable
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_limits(threads: int, reps: int = 5) -> MachineLimits:
    """This machine's read bandwidth and GEMM peaks with `threads` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(READ_BYTES // 4, dtype=torch.float32)
        read = READ_BYTES / _best(x.sum, reps) / 1e9
        del x
        peaks: dict[str, float] = {}
        flops = 2 * GEMM_N ** 3
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            a = torch.randn(GEMM_N, GEMM_N).to(dtype)
            b = torch.randn(GEMM_N, GEMM_N).to(dtype)
            peaks[name] = flops / _best(lambda a=a, b=b: torch.mm(a, b), reps) / 1e12
        a8 = torch.randint(-127, 128, (GEMM_N, GEMM_N), dtype=torch.int8)
        b8 = torch.randint(-127, 128, (GEMM_N, GEMM_N), dtype=torch.int8)
        with contextlib.suppress(RuntimeError):  # a torch without a CPU int8 GEMM
            peaks["int8"] = flops / _best(lambda: torch._int_mm(a8, b8), reps) / 1e12
        for name, seconds in _native_gemms(threads, reps).items():
            peaks[name] = max(peaks.get(name, 0.0), flops / seconds / 1e12)
    finally:
        torch.set_num_threads(before)
    return MachineLimits(round(read, 2), {k: round(v, 3) for k, v in peaks.items()}, threads)


def _native_gemms(threads: int, reps: int) -> dict[str, float]:
    """Seconds of one 2048^3 GEMM in the linear kernels the engine packs weights for:
    oneDNN's packed float32 / bfloat16 matmul and Tandem's native float32 panels, bfloat16
    pair panels and W8A8 int8 kernel (each where this machine has it)."""
    import torch

    from tandem.engine.model.cpu_linear import ONEDNN_BATCH_HINT, pack_bf16_panels, pack_panels
    from tandem.engine.native import load_native

    n = GEMM_N
    out: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        out[name] = min(out.get(name, float("inf")), seconds)

    x, w, y = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        with contextlib.suppress(RuntimeError, AttributeError):  # no oneDNN (for dtype)
            xd, wd = x.to(dtype), torch.ops.mkldnn._reorder_linear_weight(
                w.to(dtype), ONEDNN_BATCH_HINT)
            keep(name, _best(lambda xd=xd, wd=wd: torch.ops.mkldnn._linear_pointwise(
                xd, wd, None, "none", [], ""), reps))
    lib = load_native()
    if lib is None:
        return out
    if lib.tandem_linear_simd():
        wp = pack_panels(w)
        keep("float32", _best(lambda: lib.tandem_linear_packed_f32(
            x.data_ptr(), wp.data_ptr(), None, y.data_ptr(), n, n, n, threads), reps))
        x8 = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        w8 = pack_panels(torch.randint(-127, 128, (n, n), dtype=torch.int8))
        y32 = torch.empty(n, n, dtype=torch.int32)
        keep("int8", _best(lambda: lib.tandem_w8a8_gemm_i32(
            x8.data_ptr(), w8.data_ptr(), y32.data_ptr(), n, n, n, threads), reps))
    if lib.tandem_linear_bf16_simd() >= 2:
        xb, wb = x.to(torch.bfloat16), pack_bf16_panels(w.to(torch.bfloat16))
        yb = torch.empty(n, n, dtype=torch.bfloat16)
        keep("bfloat16", _best(lambda: lib.tandem_linear_bf16(
            xb.data_ptr(), wb.data_ptr(), None, yb.data_ptr(), n, n, n, n, threads), reps))
    return out


def safetensors_facts(model_dir: Path) -> ModelFacts:
    """Parameter counts of a Hugging Face directory's safetensors files (headers only):
    linear = every 2-D weight but the token embedding (the LM head counts, tied or not)."""
    linear = head = total = 0
    tied = False
    config = model_dir / "config.json"
    if config.exists():
        tied = bool(json.loads(config.read_text()).get("tie_word_embeddings"))
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in meta["shape"]:
                numel *= d
            total += numel
            if len(meta["shape"]) == 2 and "embed_tokens" not in name:
                linear += numel
                head += numel if "lm_head" in name else 0
            elif "embed_tokens" in name and tied:
                linear += numel  # the LM head multiplies by the embedding
                head += numel
    return ModelFacts(linear, head, total)


def fractions(result: dict, limits: MachineLimits, facts: ModelFacts, weight_bytes: int | None,
              compute: str) -> dict:
    """A runner result's achieved share of the limits: `weight_bw` from its steps (None
    when the runner could not count them) and `weight_bytes`; `matrix` from the tokens it
    computed (prompt tokens less prefix-cache hits, plus output tokens; the LM head only
    for output tokens) in `compute`'s peak (None when that peak was not measured)."""
    wall = result["wall_s"]
    steps = result.get("steps")
    bw = None
    if steps and weight_bytes:
        bw = steps * weight_bytes / wall / 1e9 / limits.read_gbps
    tokens = (result["prompt_tokens"] - (result.get("prefix_cache_hits") or 0)
              + result["output_tokens"])
    peak = limits.gemm_tflops.get(compute)
    work = 2 * ((facts.linear_params - facts.head_params) * tokens
                + facts.head_params * result["output_tokens"])
    matrix = work / wall / 1e12 / peak if peak else None
    return {"weight_bw": None if bw is None else round(bw, 4),
            "matrix": None if matrix is None else round(matrix, 4),
            "compute": compute, "weight_bytes": weight_bytes, "steps": steps,
            "computed_tokens": tokens}


if __name__ == "__main__":
    import os

    print(json.dumps(asdict(measure_limits(os.cpu_count() or 1)), indent=2))
