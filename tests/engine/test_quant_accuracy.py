"""Model-level accuracy of quantization and bfloat16, measured on the bundled SmolLM2-135M.

Every mode is the engine as served (`LLM(quantization=..., kv_cache_dtype=...)`), loaded
once, measured, and freed before the next: perplexity on `tests/data/corpus_pd.txt`
(2,589 tokens of *Pride and Prejudice*, non-overlapping 512-token windows, from the engine's
own prompt logprobs) with the argmax token at every scored position (teacher-forced greedy
agreement), greedy continuations of 4 corpus prompts (32 tokens) against float32, resident
weight bytes, and KV blocks for the same `kv_cache_memory`.

The float32 baseline is the GGUF's Q4_1/Q8_0 weights dequantized to float32, so "gguf"
(the same codes kept compressed) differs from it only in rounding and summation order.

Measured on a 2-core AVX2 EPYC VM (2026-12-02; the bounds below are set from these, with
margin for other kernels' summation orders on AVX-512 / VNNI machines):

| mode | perplexity | vs float32 | argmax agreement | greedy prefixes (of 32) | weights MiB |
|---|---|---|---|---|---|
| float32 | 21.5605 | | | | 513.1 |
| int8 (per channel) | 21.6255 | +0.30 % | 95.7 % | 14, 3, 32, 1 | 128.8 |
| w8a8 (int8 GEMM on every step shape) | 21.6376 | +0.36 % | 93.2 % | 14, 3, 12, 1 | 128.8 |
| int4 (group 32) | 21.6198 | +0.28 % | 97.8 % | 14, 0, 32, 1 | 90.5 |
| gguf (Q4_1 / Q8_0 kept) | 21.5605 | +0.000 % | 100 % | 32, 32, 32, 32 | 92.1 |
| float32, KV fp8 | 21.6148 | +0.25 % | 95.8 % | 4, 3, 32, 10 | 513.1 |
| float32, KV int8 | 21.5399 | -0.10 % | 98.5 % | 14, 0, 32, 10 | 513.1 |

bfloat16 (weights, activations and KV cache; linears on the native pair panels, attention
and element-wise ops in the native kernels, float32 arithmetic rounded once per stored
value), on a 2-core AVX-512 EPYC with AVX512-BF16 (2026-12-06): perplexity 21.5294 against
float32's 21.5607 there (-0.145 %; -0.12 % with torch's bfloat16 SDPA and element-wise
chains), argmax agreement 97.8 %, greedy prefixes 23, 0, 32, 10, each parting where
float32's runner-up is 0.000-0.056 nats below its best (near-ties: `NEAR_TIE`), weights
256.5 MiB (exactly half). bfloat16 with w8a8 (the int8-GEMM layers quantize bfloat16
activations; the weight-only int8 layers dequantize their panels to bfloat16 for VDPBF16PS):
21.6844 (+0.57 %), 93.3 %, prefixes 19, 0, 32, 1, 128.7 MiB.

w8a8 feeds int8 activations to o_proj and gate_up_proj only (`quant.apply.
W8A8_ACTIVATION_LAYERS`); with every linear and the LM head it measured +4.50 % (87.8 %
argmax agreement), with the LM head weight-only +3.3 %, with down_proj also weight-only
+1.4 %. int8 re-quantizes the file's Q4_1 values per channel, int4 g32 loads
the Q4_1 rows bit-exactly (only the Q8_0 tensors are re-quantized), hence int4 <= int8 here.
A single near-tie flips a greedy choice and the continuations part for good, so the greedy
bound is coarse; the teacher-forced argmax share over all 2,583 positions is the finer one.

w8a8's numbers are one draw of a wide spread: per-token activation rounding turns
last-ulp differences upstream into different codes, and those compound over 30 layers.
On a 2-core AVX-512 EPYC (2026-12-02) its int8 GEMM gives bit-identical int32 sums on
the VNNI and AVX2 paths, yet the native library's `omp simd` RMSNorm reductions (16 lanes
instead of 8) change a few ulps and w8a8 scores 21.7323 (+0.80 %), greedy prefixes 17, 1,
2, 1 (one prompt with a 3-token prefix); the same build without AVX-512 reproduces the
AVX2 row exactly. Four random +-1-ulp perturbations of the RMSNorm weights there: +0.49 %
.. +1.01 %, argmax agreement 93.0-93.5 %, prompts with a 3-token prefix 2, 4, 2, 2
(float32's top-2 logprob gaps at the second token of prompts 2 and 4 are 0.16 and 0.04
nats). Hence w8a8's greedy bound is one prompt of four.

"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.engine.perplexity import PerplexityResult, perplexity, score, windows
from tandem.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus_pd.txt"
WINDOW = 512
KV_BUDGET = 160 << 20  # bytes: all 6 corpus windows at once even in float32
PROMPT_OFFSETS = (0, 800, 1600, 2400)  # corpus token offsets of the 48-token prompts
PROMPT_LEN = 48
CONTINUATION = 32
# transformers' float32 forward of the same GGUF over the same windows, log-softmax in
# float64 (measured once, 2026-12-02): NLL 7932.0821 nats over 2,583 scored tokens
HF_PPL = 21.56086

# mode -> engine arguments beyond the common ones (float32 activations everywhere)
MODES: dict[str, dict] = {
    "float32": {},
    "int8": {"quantization": "int8"},
    "w8a8": {"quantization": "w8a8"},
    "int4": {"quantization": "int4"},
    "gguf": {"quantization": "gguf"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "bfloat16": {"dtype": "bfloat16"},  # weights, activations and KV cache
    "bfloat16-w8a8": {"dtype": "bfloat16", "quantization": "w8a8"},
}
# Bounds, set from the measurements in the module docstring. Greedy continuations: at least
# `prompts` of the 4 share their first `tokens` tokens with float32's (a near-tie flips a
# greedy choice and the continuations part for good, so this is coarse); teacher-forced
# argmax agreement (every scored corpus position): at least this share equals float32's.
GREEDY_BOUNDS = {"int8": (3, 2), "w8a8": (3, 1), "int4": (3, 2), "gguf": (32, 4),
                 "kv-fp8": (3, 2), "kv-int8": (3, 2), "bfloat16": (32, 4),
                 "bfloat16-w8a8": (3, 1)}
# modes whose continuations may also part from float32's at a near-tie: where the mode's
# token is float32's runner-up, at most this many nats below its best (bfloat16 rounds
# every activation: measured partings at gaps of 0.005-0.25 nats)
NEAR_TIE = {"bfloat16": 0.5}
TOP1_BOUNDS = {"int8": 0.94, "w8a8": 0.92, "int4": 0.94, "gguf": 0.999, "kv-fp8": 0.94,
               "kv-int8": 0.94, "bfloat16": 0.95, "bfloat16-w8a8": 0.92}
PPL_BOUNDS = {"int8": 0.01, "w8a8": 0.01, "int4": 0.05, "gguf": 0.01, "kv-fp8": 0.01,
              "kv-int8": 0.01, "bfloat16": 0.01, "bfloat16-w8a8": 0.01}  # |ppl / f32 - 1|
# float32 bytes / this mode's bytes: issue 22's >= 3x (int8) and >= 5x (int4); the upper
# bounds catch a count that misses weights (int8 codes + fp16 scales cannot pass 4x)
MEMORY_RATIOS = {"int8": (3.0, 4.0), "w8a8": (3.0, 4.0), "int4": (5.0, 6.4),
                 "gguf": (5.0, 6.4), "kv-fp8": (1.0, 1.0), "kv-int8": (1.0, 1.0),
                 "bfloat16": (2.0, 2.0), "bfloat16-w8a8": (3.0, 4.0)}


@dataclass(frozen=True)
class Measured:
    """What one mode's engine gave; the engine itself is gone by the time tests read it."""

    mode: str
    ppl: float
    top1: tuple[int, ...]  # argmax token at every scored corpus position
    continuations: list[list[int]]
    top2: list[list[tuple[int, int, float]]]  # per prompt and token: best, runner-up, gap
    memory_bytes: int
    kv_blocks: int
    kv_bytes_per_block: int
    seconds: float


@pytest.fixture(scope="module")
def corpus_ids() -> list[int]:
    from tandem.engine.model.loader import bundled_model_path
    from tandem.protocol.tokenizer import Tokenizer

    ids = Tokenizer.load(bundled_model_path()).encode(CORPUS.read_text(),
                                                      add_special_tokens=False)
    assert len(ids) == 2589  # tests/data/README.md
    return ids


def _measure(mode: str, ids: list[int]) -> Measured:
    """Load `mode` (w8a8 with its int8 GEMM on every step shape), measure it, free it."""
    from tandem import LLM

    t0 = time.perf_counter()
    env = os.environ.get("TANDEM_W8A8_MIN_ROWS")
    if mode.endswith("w8a8"):
        os.environ["TANDEM_W8A8_MIN_ROWS"] = "1"
    try:
        llm = LLM(kv_cache_memory=KV_BUDGET, max_num_batched_tokens=1024,
                  **{"dtype": "float32", **MODES[mode]})
    finally:
        if mode.endswith("w8a8"):
            if env is None:
                os.environ.pop("TANDEM_W8A8_MIN_ROWS", None)
            else:
                os.environ["TANDEM_W8A8_MIN_ROWS"] = env
    try:
        res = score(llm, ids, WINDOW, top1=True)
        prompts = [ids[o : o + PROMPT_LEN] for o in PROMPT_OFFSETS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=CONTINUATION, temperature=0.0,
                                                     ignore_eos=True, logprobs=2))
        state = llm.engine.state
        got = Measured(mode, res.perplexity, res.top1,
                       [list(o.outputs[0].token_ids) for o in outs],
                       [[_top2(lp) for lp in o.outputs[0].logprobs] for o in outs],
                       llm.model_memory_bytes(),
                       state.num_kv_blocks, state.kv_bytes_per_block, time.perf_counter() - t0)
    finally:
        del llm
        gc.collect()
    return got


@pytest.fixture(scope="module")
def baseline(corpus_ids) -> Measured:
    return _measure("float32", corpus_ids)


@pytest.fixture(scope="module", params=[m for m in MODES if m != "float32"])
def quantized(request, baseline, corpus_ids) -> Measured:
    """One mode at a time; only its numbers outlive `_measure`, never its engine."""
    return _measure(request.param, corpus_ids)


def _top2(logprobs: dict[int, float]) -> tuple[int, int, float]:
    (best, a), (second, b) = sorted(logprobs.items(), key=lambda kv: -kv[1])[:2]
    return best, second, a - b


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- the perplexity function itself ------------------------------------------------------


class _StubLLM:
    """`generate` answers each prompt as the engine's RequestOutput does: the first entry
    None, then {token: log(1 / (2 + token))}, plus token 0 at log(1/2) with top-1 asked."""

    class engine:  # noqa: N801 - the attribute shape of LLM.engine.state.max_model_len
        class state:  # noqa: N801
            max_model_len = 64

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):  # noqa: ANN001, ANN201
        assert params.max_tokens == 1 and params.prompt_logprobs in (0, 1)
        self.prompts += prompts
        k = params.prompt_logprobs

        class Out:
            def __init__(self, p: list[int]) -> None:
                self.prompt_logprobs = [None] + [
                    {t: -math.log(2 + t), **({0: -math.log(2)} if k else {})} for t in p[1:]]
        return [Out(p) for p in prompts]


def test_perplexity_scores_all_but_each_windows_first_token():
    ids = list(range(11))
    assert windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert windows(ids[:9], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone last token: dropped
    llm = _StubLLM()
    got = score(llm, ids, 4)
    scored = [1, 2, 3, 5, 6, 7, 9, 10]  # windows start at 0, 4, 8: those are not predicted
    assert got == PerplexityResult(sum(math.log(2 + t) for t in scored), len(scored))
    assert llm.prompts == windows(ids, 4)
    assert perplexity(_StubLLM(), ids, 4) == math.exp(got.nll_sum / 8)
    assert score(_StubLLM(), ids, 4, top1=True).top1 == (0,) * 8
    assert score(_StubLLM(), ids, 4, top1=True).nll_sum == got.nll_sum


def test_perplexity_rejects_bad_input():
    with pytest.raises(ValueError, match="window must be at least 2"):
        score(_StubLLM(), [1, 2, 3], 1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        score(_StubLLM(), [1], 8)
    with pytest.raises(ValueError, match="max_model_len 64"):
        score(_StubLLM(), list(range(100)), 64)


def test_float32_perplexity_matches_transformers(baseline):
    """The engine's prompt logprobs score the corpus as transformers' forward does."""
    print(f"float32: perplexity {baseline.ppl:.5f} (transformers {HF_PPL}), "
          f"{baseline.memory_bytes / 2**20:.1f} MiB weights, {baseline.seconds:.1f} s")
    assert baseline.ppl == pytest.approx(HF_PPL, rel=1e-4)  # measured 1.7e-5 apart
    assert len(baseline.top1) == 2583


# -- each mode against float32 -----------------------------------------------------------


def test_perplexity_within_target(quantized, baseline):
    ratio = quantized.ppl / baseline.ppl
    print(f"{quantized.mode}: perplexity {quantized.ppl:.4f} vs float32 {baseline.ppl:.4f} "
          f"({ratio - 1:+.3%}), {quantized.seconds:.1f} s")
    assert abs(ratio - 1) <= PPL_BOUNDS[quantized.mode]


def test_greedy_agreement(quantized, baseline):
    same = sum(a == b for a, b in zip(quantized.top1, baseline.top1, strict=True))
    share = same / len(baseline.top1)
    prefixes = [_prefix(a, b) for a, b in zip(baseline.continuations, quantized.continuations,
                                              strict=True)]
    print(f"{quantized.mode}: teacher-forced argmax agreement {share:.2%}; greedy prefix "
          f"lengths vs float32 {prefixes} of {CONTINUATION}")
    assert all(len(c) == CONTINUATION for c in quantized.continuations)
    assert share >= TOP1_BOUNDS[quantized.mode]
    need, of = GREEDY_BOUNDS[quantized.mode]
    tie = NEAR_TIE.get(quantized.mode)
    ok = 0
    for p, cont, top2 in zip(prefixes, quantized.continuations, baseline.top2, strict=True):
        if p >= need:
            ok += 1
        elif tie is not None:
            best, second, gap = top2[p]
            print(f"  parted at token {p}: {cont[p]} for float32's {best} (runner-up "
                  f"{second}, {gap:.3f} nats below)")
            ok += cont[p] == second and gap <= tie
    assert ok >= of, prefixes


def test_weight_memory(quantized, baseline):
    """Resident weight bytes: every weight counted once (the tied embedding/LM head too)."""
    ratio = baseline.memory_bytes / quantized.memory_bytes
    print(f"{quantized.mode}: {quantized.memory_bytes / 2**20:.1f} MiB weights, "
          f"float32 / this = {ratio:.2f}")
    lo, hi = MEMORY_RATIOS[quantized.mode]
    assert lo <= ratio <= hi


def test_kv_blocks_for_the_same_budget(quantized, baseline):
    """Quantized KV rows are head_dim code bytes + a float16 scale (float32: 4 bytes per
    element), for K and V of every layer and KV head; the same budget holds that many more."""
    layers, kv_heads, head_dim, block = 30, 3, 64, 16  # SmolLM2-135M, default block_size
    row = (head_dim + 2 if quantized.mode.startswith("kv-")
           else head_dim * 2 if quantized.mode.startswith("bfloat16") else head_dim * 4)
    per_block = 2 * layers * kv_heads * block * row
    assert baseline.kv_bytes_per_block == 2 * layers * kv_heads * block * head_dim * 4
    assert quantized.kv_bytes_per_block == per_block
    assert quantized.kv_blocks == KV_BUDGET // per_block
    if quantized.mode.startswith("kv-"):  # 3.9x float32's blocks, so >= 1.9x bfloat16's
        assert quantized.kv_blocks >= 1.9 * 2 * baseline.kv_blocks
