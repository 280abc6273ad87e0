"""bench/router_overhead.py --guardrails: its in-process micro-benchmark on a few dozen
requests (the load part, real router processes at 500 req/s, is not run here)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import router_overhead  # noqa: E402
import router_overhead_guardrails as guardrails_bench  # noqa: E402


def test_micro_benchmark_redacts_every_planted_secret_and_times_each_layer():
    got = guardrails_bench.guardrails_micro(requests=24, full_requests=4)
    checks = got["checks"]
    # 8 distinct 4 KB answers, 4 secrets each: every one redacted by the regex layer, none
    # left in what the client would read (regex layer or full set)
    assert checks["planted"] == 32 and checks["redacted"] == 32 and checks["leaked"] == 0
    assert checks["answer_chars_out_min"] > 3500  # the rest of the answer got through
    assert got["events_per_answer"] > 1000  # ~4 KB in 4-character deltas
    for name, stats in got["layers"].items():
        assert 0 < stats["p50"] <= stats["p90"] <= stats["max"], name
        assert stats["max"] < 5.0, name
    assert checks["burst_same_text"]  # all events in one read: the same text out
    for name in ("regex", "full"):  # text held back, in tokens: far less than the longest match
        h = got["hold"][name]
        assert h["pending_only"]["mean_tokens"] * 4 < h["longest_match"]["mean_tokens"], name
        assert (h["pending_only"]["first_release_event_mean"]
                < h["longest_match"]["first_release_event_mean"]), name
    t = got["sum"]
    assert math.isclose(t["value_ms"], t["input_ms"] + t["output_ms"])
    json.dumps(got)  # the raw JSON the script writes


def test_the_target_is_read_from_the_load_rounds():
    added = {"p50": 0.00015, "per_round": [{"p50": 0.0001}, {"p50": 0.0003}]}
    t = guardrails_bench.load_target(added, 500.0, 4096, 62)
    assert t["limit_ms"] == 0.2 and math.isclose(t["value_ms"], 0.15) and t["pass"]
    assert [round(x, 6) for x in t["per_round_ms"]] == [0.1, 0.3]
    assert not guardrails_bench.load_target({**added, "p50": 0.00021}, 500, 4096, 62)["pass"]


def test_variants_prompts_and_answers():
    variants = guardrails_bench.guardrail_variants()
    assert list(variants) == ["none", "input-regex", "output-regex", "regex", "full"]
    full = variants["full"]
    assert {g["type"] for g in full["input"]} == {"regex", "blocklist", "pii", "injection",
                                                 "limits"}
    assert {g["type"] for g in full["output"]} == {"regex", "pii"}
    assert len(full["input"][3]["terms"]) == 100
    body = json.loads(guardrails_bench.gr_prompt_bodies(1, 4096, seed=3)[0])
    assert body["stream"] is True and len(body["messages"][1]["content"]) == 4096
    short = guardrails_bench.gr_answer(64, seed=0)
    assert "078-05-1120" in short and "4111 1111 1111 1111" in short


def test_histogram_from_metrics_text():
    text = "\n".join([
        '# TYPE tandem_router_guardrail_seconds histogram',
        'tandem_router_guardrail_seconds_bucket{layer="input",le="0.0001"} 60.0',
        'tandem_router_guardrail_seconds_bucket{layer="input",le="0.00025"} 90.0',
        'tandem_router_guardrail_seconds_bucket{layer="input",le="+Inf"} 100.0',
        'tandem_router_guardrail_seconds_count{layer="input"} 100.0',
        'tandem_router_guardrail_seconds_sum{layer="input"} 0.02',
        'tandem_router_guardrail_seconds_count{layer="output"} 7.0'])
    h = router_overhead.histogram(text, router_overhead.GUARDRAIL_SECONDS, 'layer="input"')
    assert h[1:] == (0.02, 100.0)
    s = router_overhead.hist_summary([h])
    assert math.isclose(s["mean"], 0.0002)
    assert math.isclose(s["p50_from_buckets"], 0.0001 * 50 / 60)
    assert s["p50_bucket_le"] == 0.0001
    assert math.isclose(s["p90_from_buckets"], 0.00025)
