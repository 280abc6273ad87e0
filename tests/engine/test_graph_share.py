"""Which steps replay the decode graphs and which run eagerly, and why: rank 0's per-reason
step counts (`EngineStats.step_paths`) for a scripted workload on a tiny model with the
static-buffer decode path (TANDEM_STATIC_DECODE=1, the CPU stand-in for CUDA graphs), and
their `tandem_engine_steps_total` / `tandem_engine_step_seconds_total` series on the worker's
/metrics registry; and `bench/graph_share.py`'s stand-in graphs (eager replay on a backend
without graphs) deciding every step as the static path does."""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import generate_latest

from tandem import LLM, SamplingParams
from tandem.engine.cuda_graphs import STATIC_DECODE_ENV
from tandem.engine.model_runner import EAGER_REASONS
from tandem.serving.metrics import ServerMetrics

SIZES = (1, 2, 4)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import graph_share  # noqa: E402 - bench/graph_share.py


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _workload(llm: LLM) -> list[list[int]]:
    out = llm.generate([[5] * 4, [6] * 6], [_params(3), _params(5, prompt_logprobs=1)])
    out += llm.generate([[7] * 5, [8] * 3], [_params(2), _params(2)])
    out += llm.generate([[9 + i] * 3 for i in range(5)], [_params(2)] * 5)
    return [o.outputs[0].token_ids for o in out]


def _counts(llm: LLM) -> dict[tuple[str, str], int]:
    return {(p.path, p.reason): p.steps for p in llm.engine.stats().step_paths}


def test_steps_are_counted_by_path_and_reason(tiny_model, monkeypatch):
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    llm = LLM(tiny_model, attention_backend="triton", dtype="float32", num_kv_blocks=64,
              max_num_seqs=8, cuda_graph_sizes=SIZES, enable_prefix_caching=False)
    zero = {("graph", "decode"): 0} | {("eager", r): 0 for r in EAGER_REASONS}
    assert _counts(llm) == zero  # every series exists before the first step
    # both prompts in one step (prompt logprobs: eager), then 2 decode steps of 2 rows and
    # 2 of 1 row (graphs); a prefill step without prompt logprobs (mixed), then 1 decode
    # step of 2 rows; 5 rows: one prefill step, then a decode of 5 rows (above the largest
    # size 4: too_large)
    _workload(llm)
    graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None
    llm.generate([[4] * 3], [_params(3)])  # the engine without graphs: 3 steps
    llm.engine.runner.graphs = graphs
    assert _counts(llm) == zero | {
        ("graph", "decode"): 5, ("eager", "prompt_logprobs"): 1, ("eager", "mixed"): 2,
        ("eager", "too_large"): 1, ("eager", "disabled"): 3}
    assert sum(_counts(llm).values()) == llm.engine.runner.timings.steps == 12
    ran = {(p.path, p.reason): p.seconds for p in llm.engine.stats().step_paths}
    assert all((ran[k] > 0) == (n > 0) for k, n in _counts(llm).items())

    # on /metrics (the worker's registry, read at scrape time from the engine's stats)
    metrics = ServerMetrics("tiny", llm.engine.stats)
    text = generate_latest(metrics.registry).decode()
    for (path, reason), n in _counts(llm).items():
        assert (f'tandem_engine_steps_total{{model_name="tiny",path="{path}",'
                f'reason="{reason}"}} {float(n)}') in text.splitlines()
    seconds = [line for line in text.splitlines()
               if line.startswith("tandem_engine_step_seconds_total{")]
    assert len(seconds) == len(EAGER_REASONS) + 1
    assert ('tandem_engine_step_seconds_total{model_name="tiny",path="eager",'
            'reason="lora"} 0.0') in seconds


def test_the_bench_stand_in_decides_every_step_as_the_static_path(tiny_model, monkeypatch):
    """The cpu backend has no graphs; with `EagerGraphs` of the same sizes the runner makes
    the static path's decision every step (same counts) and computes the same tokens."""
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=8, cuda_graph_sizes=SIZES,
              enable_prefix_caching=False)
    static = LLM(tiny_model, attention_backend="triton", **kw)
    cpu = LLM(tiny_model, attention_backend="cpu", **kw)
    assert cpu.engine.runner.graphs is None
    runner = cpu.engine.runner
    runner.graphs = graph_share.EagerGraphs(runner.model, runner.backend, runner.kv_caches,
                                            SIZES)
    assert _workload(cpu) == _workload(static)
    assert _counts(cpu) == _counts(static) != {}
    assert _counts(cpu)[("graph", "decode")] == 5


def test_the_bench_shares_are_differences_of_two_scrapes():
    before = {("graph", "decode"): {"steps": 10, "seconds": 1.0},
              ("eager", "mixed"): {"steps": 1, "seconds": 0.5}}
    after = {("graph", "decode"): {"steps": 16, "seconds": 1.6},
             ("eager", "mixed"): {"steps": 3, "seconds": 1.3},
             ("eager", "lora"): {"steps": 0, "seconds": 0.0}}
    got = graph_share.shares(before, after)
    assert got["steps"] == 8 and got["seconds"] == 1.4
    assert got["by_path_reason"] == {
        "graph/decode": {"steps": 6, "seconds": 0.6, "mean_step_s": 0.1},
        "eager/mixed": {"steps": 2, "seconds": 0.8, "mean_step_s": 0.4}}
    assert got["eager_step_share"] == 0.25 and got["eager_time_share"] == 0.5714
    assert got["eager_step_share_by_reason"] == {"mixed": 0.25}
