"""The end-to-end section of `bench/gpu_check.py`: a random-weight Llama through `LLM`.

`write_random_llama` writes an HF directory (config.json, safetensors, a word-level
tokenizer) that `LLM(model=dir)` loads like any checkpoint. `e2e` runs each engine
configuration of `ENGINES` on it in turn: a batch-wide decode point and a prefill-heavy
point (tokens/s), the ratios between configurations, and `sampling_modes` on one of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class E2ESizes:
    """The random model and the two workload points of `e2e`."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_len: int
    decode_batch: int
    decode_prompt: int
    decode_steps: int
    prefill_prompts: int
    prefill_len: int
    max_batched_tokens: int
    cap_s: float  # per engine configuration


E2E_REAL = E2ESizes(2048, 8192, 16, 32, 8, 32000, 4096, 64, 512, 128, 16, 2048, 8192, 60.0)
# interpreted Triton costs ~0.1 s per launch: two sequences, a step or two per point
E2E_DRY = E2ESizes(128, 256, 2, 4, 2, 2048, 512, 2, 4, 1, 1, 12, 64, 20.0)
ENGINES = {  # name -> engine args; the ratios below compare these
    "triton_graphs": {"attention_backend": "triton", "enforce_eager": False},
    "triton_eager": {"attention_backend": "triton", "enforce_eager": True},
    "torch_eager": {"attention_backend": "torch", "enforce_eager": True},
}


# ----------------------------------------------------------------------------- the model


def write_random_llama(out: Path, sz: E2ESizes, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> dict:
    """An HF directory (config.json, model.safetensors, a word-level tokenizer over the
    vocabulary) of a Llama with N(0, 0.02) weights and unit norms; returns its shape."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tandem.engine.model.config import ModelArchConfig
    from tandem.engine.model.hf_loader import expected_weight_shapes
    from tandem.engine.model.loader import LoadedModel, export_hf

    arch = ModelArchConfig("llama", sz.vocab, sz.hidden, sz.intermediate, sz.layers, sz.heads,
                           sz.kv_heads, sz.hidden // sz.heads, rope_theta=500000.0,
                           max_position_embeddings=sz.max_len, bos_token_id=1,
                           eos_token_ids=(2,))
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(arch).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
        else:
            weights[name] = torch.randn(shape, generator=gen, device=device,
                                        dtype=dtype).mul_(0.02).cpu()
    params = sum(w.numel() for w in weights.values())
    export_hf(LoadedModel(arch, weights, "random"), out)
    del weights
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, sz.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}))
    return {"params": params, "dtype": str(dtype).removeprefix("torch."),
            **dataclasses.asdict(arch) | {"rope_scaling": None, "rope_freq_factors": None}}


def engine_args(sz: E2ESizes, device: torch.device) -> dict:
    # at least the sampling check's 15 sequences at once
    args = {"device": str(device), "max_num_seqs": max(sz.decode_batch, 16),
            "max_model_len": sz.max_len,
            "max_num_batched_tokens": sz.max_batched_tokens}
    if device.type == "cuda":
        args["gpu_memory_utilization"] = 0.3  # ~40 GiB on an H200; three engines in turn
    else:
        args["kv_cache_memory"] = 64 << 20
    return args


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def decode_point(llm, sz: E2ESizes, rng: random.Random, deadline: float) -> dict:
    """Batch-`decode_batch` decode: every request prefilled first, then whole decode steps
    timed (each sequence +1 token per step; `ForwardClock` splits each into device and host
    time); the requests are aborted afterwards."""
    from tandem import SamplingParams

    eng = llm.engine
    sp = SamplingParams(max_tokens=sz.max_len - sz.decode_prompt, temperature=0.0,
                        ignore_eos=True)
    ids = [f"decode-{rng.random()}-{i}" for i in range(sz.decode_batch)]
    for rid, p in zip(ids, _prompts(rng, sz.decode_batch, sz.decode_prompt, sz.vocab),
                      strict=True):
        eng.add_request(rid, p, sp)
    counts: dict[str, int] = {}

    def step() -> None:
        for o in eng.step():
            counts[o.request_id] = len(o.outputs[0].token_ids)

    while len([c for c in counts.values() if c]) < len(ids):
        step()
    before, steps = sum(counts.values()), 0
    clock = ForwardClock(eng.runner, eng.device)
    try:
        t0 = time.perf_counter()
        while steps < sz.decode_steps and (not steps or time.perf_counter() < deadline):
            clock.step(step)
            steps += 1
        elapsed = time.perf_counter() - t0
    finally:
        clock.close()
    tokens = sum(counts.values()) - before
    # a few more steps, profiled (one on the CPU: the same code, nothing to measure)
    kernels = kernel_time(step, KERNEL_STEPS if eng.device.type == "cuda" else 1, eng.device)
    for rid in ids:
        eng.abort_request(rid)
    return {"batch": sz.decode_batch, "prompt_len": sz.decode_prompt, "steps": steps,
            "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "ms_per_step": elapsed / steps * 1e3,
            "step_time": clock.summary() | kernels}


def prefill_point(llm, sz: E2ESizes, rng: random.Random) -> dict:
    """Prefill-heavy: `prefill_prompts` fresh prompts of `prefill_len` tokens, 1 output token
    each, all submitted at once; prompt tokens per second of wall time."""
    from tandem import SamplingParams

    prompts = _prompts(rng, sz.prefill_prompts, sz.prefill_len, sz.vocab)
    eng = llm.engine
    clock = ForwardClock(eng.runner, eng.device)
    engine_step = eng.step
    eng.step = lambda: clock.step(engine_step)  # each step `generate` drives, timed
    try:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        elapsed = time.perf_counter() - t0
    finally:
        del eng.step
        clock.close()
    tokens = sz.prefill_prompts * sz.prefill_len
    return {"prompts": sz.prefill_prompts, "prompt_len": sz.prefill_len, "tokens": tokens,
            "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "step_time": clock.summary()}


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if old is not None:
            os.environ[name] = old


def free_memory() -> None:
    """Collect garbage and hand torch's cached CUDA blocks back to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class ForwardClock:
    """Per engine step: wall time, and the device time of the step's model forwards.

    On CUDA, events are recorded around each forward on the current stream: the model's
    eager forward (module hooks) and each CUDA-graph replay (the graph's `replay`, so the
    runner's input copies and metadata build stay host work). A forward's device time is
    the GPU timeline from its first kernel to its last: the kernels' time, plus any gap in
    which the GPU waited for the host to launch the next one (none for a graph replay).
    Elsewhere the same hooks read `time.perf_counter` (the CPU runs the forward
    synchronously, so that is its compute time) and the result says so (`timer`).
    `host_share` = 1 - device / wall over the steps: what the step spends outside forwards
    (scheduling, input building, sampling, output processing, launch gaps before the
    forward's first kernel). `kernel_time` gives the kernels' own time for comparison.
    """

    def __init__(self, runner, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._steps: list[tuple[float, list]] = []  # (wall seconds, the step's spans)
        self._spans: list = []
        self._depth = 0
        self._undo: list = []
        model = runner.model
        self._undo += [model.register_forward_pre_hook(lambda *_: self._start()),
                       model.register_forward_hook(lambda *_: self._stop())]
        graphs = getattr(runner, "graphs", None)
        for graph in (getattr(graphs, "graphs", None) or {}).values():
            self._wrap_replay(graph)

    def _wrap_replay(self, graph) -> None:
        replay = graph.replay

        def timed_replay() -> None:
            self._start()
            try:
                replay()
            finally:
                self._stop()

        graph.replay = timed_replay
        self._undo.append(lambda: vars(graph).pop("replay", None))

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._spans.append([self._mark(), None])

    def _stop(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._spans and self._spans[-1][1] is None:
            self._spans[-1][1] = self._mark()

    def step(self, fn):  # noqa: ANN001, ANN201 - any engine call
        """Run one engine step `fn()`, timing it; returns what it returns."""
        self._spans = []
        t0 = time.perf_counter()
        out = fn()
        self._steps.append((time.perf_counter() - t0, self._spans))
        return out

    def close(self) -> None:
        for undo in self._undo:
            undo() if callable(undo) else undo.remove()
        self._undo = []

    def summary(self) -> dict:
        """Medians per step and the host share over all the steps timed (reads the events:
        synchronizes once)."""
        if self.cuda:
            torch.cuda.synchronize()
        device, wall = [], []
        for seconds, spans in self._steps:
            done = [(a, b) for a, b in spans if b is not None]
            ms = sum(a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in done)
            device.append(ms)
            wall.append(seconds * 1e3)
        if not wall:
            return {"timer": None, "steps": 0}
        total_wall = sum(wall)
        return {"timer": "cuda_events" if self.cuda else "wall_clock (no CUDA: the forward's "
                "own time, synchronous on the CPU)",
                "steps": len(wall),
                "forwards": sum(len(spans) for _, spans in self._steps),
                "wall_ms_per_step": statistics.median(wall),
                "device_ms_per_step": statistics.median(device),
                "wall_ms_total": total_wall, "device_ms_total": sum(device),
                "host_share": max(0.0, 1 - sum(device) / total_wall) if total_wall else None}


KERNEL_STEPS = 8


def kernel_time(step, steps: int, device: torch.device) -> dict:  # noqa: ANN001 - a step
    """`steps` more engine steps under torch's profiler: the GPU's kernel time per step
    (every kernel's and copy's own device time, CUPTI's numbers, summed): the device's busy
    time alone, without the launch gaps that events around a forward include. None where
    the profiler saw no device activity (the CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        # the device's own events (kernels, copies), as the profiler table's "Self CUDA
        # time total": a CPU op's self device time would count its kernels twice
        us = sum(e.self_device_time_total for e in prof.key_averages()
                 if e.device_type != DeviceType.CPU)
    except Exception as exc:  # a profiler the image cannot start must not cost the point
        return {"kernel_ms_per_step": None, "kernel_error": f"{type(exc).__name__}: {exc}"}
    return {"kernel_ms_per_step": us / 1e3 / steps if us else None, "kernel_steps": steps}


def e2e(sz: E2ESizes, device: torch.device, workdir: Path, result: dict) -> dict:
    """Each engine configuration in turn on the same random model (see `engine_run`), then
    the ratios between them; `result` fills as it goes, so a failure keeps what ran."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = workdir / "random-llama"
    t0 = time.perf_counter()
    result["model"] = write_random_llama(model_dir, sz, dtype, device)
    result["model"]["write_seconds"] = time.perf_counter() - t0
    base = engine_args(sz, device)
    runs: dict[str, dict] = result.setdefault("runs", {})
    # interpreted Triton would take minutes over the sampling batch: on the CPU it runs on
    # the torch engine (the sampler is the same code either way)
    sampling_on = "triton_graphs" if device.type == "cuda" else "torch_eager"
    for name, extra in ENGINES.items():
        try:  # one engine failing (say, out of memory) leaves the others' numbers
            runs[name] = engine_run(name, extra, model_dir, base, sz, device,
                                    result if name == sampling_on else None)
        except Exception as exc:
            runs[name] = {"engine_args": base | extra, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-4000:]}
        free_memory()
    ok = {n: r for n, r in runs.items() if "error" not in r}
    ratios, device_ratios = {}, {}
    for point in ("decode", "prefill"):
        tps = {n: r[point]["tokens_per_s"] for n, r in ok.items()}
        dev = {n: r[point]["step_time"].get("device_ms_total") for n, r in ok.items()}
        for label, a, b in (("triton_over_torch", "triton_graphs", "torch_eager"),
                            ("graphs_over_eager", "triton_graphs", "triton_eager")):
            if a in tps and b in tps:
                ratios[f"{point}_{label}"] = tps[a] / tps[b]
            if dev.get(a) and dev.get(b):  # the same tokens: device time b / a = speed a / b
                device_ratios[f"{point}_{label}"] = (
                    dev[b] / ok[b][point]["tokens"]) / (dev[a] / ok[a][point]["tokens"])
    result["ratios"] = ratios
    # the same ratios from the forwards' device time alone (`ForwardClock`): kernels apart
    # from host work; on the CPU from the forwards' wall time
    result["device_ratios"] = device_ratios
    kernel = {n: r["decode"]["step_time"].get("kernel_ms_per_step") for n, r in ok.items()}
    # decode on the kernels' own GPU time (every engine decodes the same batch per step)
    result["kernel_ratios"] = {f"decode_{label}": kernel[b] / kernel[a] for label, a, b in (
        ("triton_over_torch", "triton_graphs", "torch_eager"),
        ("graphs_over_eager", "triton_graphs", "triton_eager")) if kernel.get(a) and kernel.get(b)}
    failed = sorted(set(runs) - set(ok))
    if failed:
        raise RuntimeError(f"engine configuration(s) {failed} failed (see e2e.runs)")
    return result


def engine_run(name: str, extra: dict, model_dir: Path, base: dict, sz: E2ESizes,
               device: torch.device, sampling_into: dict | None) -> dict:
    """Load one engine configuration, warm it up, run both points (and, when
    `sampling_into` is given, the sampling check into it); the engine is freed on return."""
    from tandem import LLM, SamplingParams
    from tandem.engine.cuda_graphs import STATIC_DECODE_ENV

    deadline = time.perf_counter() + sz.cap_s
    rng = random.Random(name)
    t0 = time.perf_counter()
    # on the CPU, "graphs" = the static-buffer decode path graphs replay (no capture)
    static = device.type != "cuda" and not extra["enforce_eager"]
    with _env(STATIC_DECODE_ENV, "1" if static else None):
        llm = LLM(str(model_dir), **base, **extra)
    runner = llm.engine.runner
    run = {"engine_args": base | extra, "load_seconds": time.perf_counter() - t0,
           "attention_backend": runner.backend.name}
    if device.type == "cuda":  # Triton compiles each kernel variant on first use
        llm.generate(_prompts(rng, sz.decode_batch, sz.decode_prompt, sz.vocab),
                     SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    run["decode"] = decode_point(llm, sz, rng, deadline)
    run["prefill"] = prefill_point(llm, sz, rng)
    graphs = getattr(runner, "graphs", None)
    run["graphs"] = None if graphs is None else {
        "captured_sizes": sorted(graphs.graphs), "static_sizes": list(graphs.sizes),
        "steps_by_size": {str(k): v for k, v in sorted(graphs.runs.items())}}
    if sampling_into is not None:
        sampling_into["sampling"] = {"engine": name, **sampling_modes(llm, sz, rng)}
    return run


# ----------------------------------------------------------------------------- sampling


def sampling_modes(llm, sz: E2ESizes, rng: random.Random) -> dict:
    """Every sampling mode in one mixed batch, the batch run twice: each mode's invariants,
    and seeded/greedy rows equal across the two runs."""
    from tandem import SamplingParams

    n_tok, prompt_len = (8, 24) if llm.engine.device.type == "cuda" else (3, 4)
    common = {"max_tokens": n_tok, "ignore_eos": True}
    modes = {
        "greedy": SamplingParams(temperature=0.0, **common),
        "random": SamplingParams(temperature=1.0, **common),
        "temperature_0.5": SamplingParams(temperature=0.5, **common),
        "top_k": SamplingParams(temperature=1.0, top_k=20, **common),
        "top_p": SamplingParams(temperature=1.0, top_p=0.8, **common),
        "min_p": SamplingParams(temperature=1.0, min_p=0.05, **common),
        "top_k_top_p_min_p": SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01,
                                            **common),
        "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.3,
                                    presence_penalty=0.5, frequency_penalty=0.5, **common),
        "greedy_penalties": SamplingParams(temperature=0.0, repetition_penalty=1.5, **common),
        "seeded": SamplingParams(temperature=1.0, seed=1234, **common),
        "seeded_top_p": SamplingParams(temperature=0.7, top_p=0.9, seed=99, **common),
        "logprobs": SamplingParams(temperature=0.8, logprobs=5, prompt_logprobs=3, **common),
        "greedy_logprobs": SamplingParams(temperature=0.0, logprobs=2, **common),
        "n2": SamplingParams(n=2, temperature=1.0, **common),
    }
    prompts = _prompts(rng, len(modes), prompt_len, sz.vocab)
    params = list(modes.values())
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    out: dict[str, dict] = {}
    for (name, sp), a, b in zip(modes.items(), first, second, strict=True):
        problems = []
        if len(a.outputs) != sp.n:
            problems.append(f"{len(a.outputs)} samples, asked {sp.n}")
        for o in a.outputs:
            if len(o.token_ids) != n_tok or not all(0 <= t < sz.vocab for t in o.token_ids):
                problems.append(f"tokens {o.token_ids}")
            if sp.logprobs is not None:
                if o.logprobs is None or len(o.logprobs) != n_tok:
                    problems.append("missing logprobs")
                else:
                    for tok, lp in zip(o.token_ids, o.logprobs, strict=True):
                        if tok not in lp or not sp.logprobs <= len(lp) <= sp.logprobs + 1 or \
                                not all(math.isfinite(v) and v <= 1e-6 for v in lp.values()):
                            problems.append(f"bad logprobs {lp}")
                            break
        if sp.prompt_logprobs is not None and (
                a.prompt_logprobs is None or len(a.prompt_logprobs) != len(a.prompt_token_ids)):
            problems.append("missing prompt logprobs")
        repeat = [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        if (sp.seed is not None or sp.temperature == 0.0) and not repeat:
            problems.append("seeded/greedy rows differ between identical runs")
        out[name] = {"ok": not problems, "problems": problems[:3], "repeat_equal": repeat,
                     "tokens": a.outputs[0].token_ids}
    return {"ok": all(m["ok"] for m in out.values()), "modes": out}
