"""The serving benchmark's load generator: its statistics, and a real run against a worker."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import loadgen  # noqa: E402
from serve_chart import plot  # noqa: E402
from tests.serving.helpers import start_worker  # noqa: E402
from workload import make_workload  # noqa: E402


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    a = loadgen.arrival_times(4000, rate=2.0, seed=7)
    assert a == loadgen.arrival_times(4000, rate=2.0, seed=7)
    assert a != loadgen.arrival_times(4000, rate=2.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.5) < 0.03  # mean gap 1/rate
    assert abs(gaps.std() - 0.5) < 0.05  # exponential: std == mean
    assert loadgen.arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        loadgen.arrival_times(3, 0.0, 0)


def test_summary_percentiles_goodput_and_failures():
    def ok(sent, ttft, e2e, n):
        return loadgen.RequestResult(True, sent, 10, n, n, ttft, e2e, [0.1] * (n - 1))

    results = [ok(0.0, 0.5, 2.5, 5), ok(1.0, 3.0, 4.0, 5), ok(2.0, 0.2, 8.0, 5),
               loadgen.RequestResult(False, 3.0, 10, 5, error="HTTP 503: busy")]
    s = loadgen.summarize(1.0, results, loadgen.SLO(ttft_s=2.0, tpot_s=1.0))
    assert (s.completed, s.failed) == (3, 1)
    assert s.duration_s == pytest.approx(10.0)  # first send 0.0 -> last end 2.0 + 8.0
    assert s.output_throughput == pytest.approx(1.5)
    # request 2 misses the TTFT SLO, request 3 the TPOT SLO ((8.0 - 0.2) / 4 > 1.0)
    assert s.goodput == pytest.approx(0.1)
    assert s.ttft["p50"] == pytest.approx(0.5)
    assert s.errors == ["HTTP 503: busy"]
    assert s.to_json()["rate"] == 1.0


def test_server_timing_header_parsing():
    assert loadgen._server_timing("engine;dur=12.5, total;desc=\"x\";dur=14") == {
        "engine": 0.0125, "total": 0.014}
    assert loadgen._server_timing("garbage;dur=abc") == {}


@pytest.mark.slow
def test_load_generator_against_a_real_worker(tmp_path):
    worker = start_worker(tmp_path)
    try:
        model = asyncio.run(loadgen.served_model(worker.url))
        reqs = make_workload(4, seed=3, prompt_len=(8, 40), output_len=(3, 6),
                             special_ids=range(17))
        results = asyncio.run(loadgen.run_rate(worker.url, model, reqs, rate=20.0, seed=1))
        for req, res in zip(reqs, results, strict=True):
            assert res.ok, res.error
            assert res.output_tokens == req.max_tokens  # ignore_eos: exactly max_tokens
            assert 0 < res.ttft <= res.e2e
            assert len(res.itl) >= req.max_tokens - 1  # tokens arrived in separate chunks
        lat = loadgen.one_token_latency(worker.url, model, reqs[0].prompt_token_ids, 5)
        assert lat.engine is not None  # Tandem reports Server-Timing
        assert 0 < lat.engine["p50"] < lat.client["p50"]
        assert lat.overhead["p50"] > 0
        summary = loadgen.summarize(20.0, results, loadgen.SLO())
        report = {"servers": {"tandem": {"runs": {"mixed": [summary.to_json()]}}},
                  "date": "test", "machine": {}}
        png = tmp_path / "chart.png"
        plot(report, png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        assert worker.stop() == 0, worker.log()


def test_interleaved_ratios_are_medians_of_per_round_pairs():
    import serve

    def entry(ttfts, tputs):
        rounds = [{"ttft_p50": a, "tpot_p50": 0.1, "output_throughput": b, "completed": 3}
                  for a, b in zip(ttfts, tputs, strict=True)]
        return {"rate": 2.0, "ttft": {"p50": ttfts[0]}, "output_throughput": tputs[0],
                "rounds": rounds}

    res = {"tandem": {"runs": {"mixed": [entry([1.0, 2.0, 4.0], [10.0, 10.0, 10.0])]}},
           "vllm": {"runs": {"mixed": [entry([1.5, 1.0, 8.0], [5.0, 20.0, 10.0])]}}}
    r = serve.ratios(res)["mixed"][0]
    assert r["ttft_p50_vllm_over_tandem_per_round"] == [1.5, 0.5, 2.0]
    assert r["ttft_p50_vllm_over_tandem"] == 1.5  # the median round, not a ratio of medians
    assert r["throughput_tandem_over_vllm"] == 1.0
    # one round each: the plain ratio
    single = {n: {"runs": {"mixed": [{"rate": 1.0, "ttft": {"p50": t},
                                      "output_throughput": 4.0}]}}
              for n, t in (("tandem", 2.0), ("vllm", 3.0))}
    assert serve.ratios(single)["mixed"][0]["ttft_p50_vllm_over_tandem"] == 1.5
