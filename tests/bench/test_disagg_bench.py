"""bench/disagg.py's setups and report, without running servers: each P/D setup's router
flags (the threshold rule, the cost decision, Dynamo's rule), the ratios it prints, and the
P/D decision counts it reads from a real router's /metrics text format."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import disagg  # noqa: E402


def test_each_setup_names_its_decision_rule():
    assert disagg.router_flags("disaggregated", 16, 0) == [
        "--pd-decision", "threshold", "--pd-threshold", "16", "--pd-max-prefill-queue", "0"]
    assert disagg.router_flags("disaggregated-q2", 16, 0)[-1] == "2"
    assert disagg.router_flags("adaptive", 16, 0) == [
        "--pd-decision", "cost", "--pd-threshold", "16", "--pd-max-prefill-queue", "0"]
    assert disagg.router_flags("dynamo", 16, 0) == [
        "--pd-decision", "threshold", "--pd-threshold", "1000", "--pd-max-prefill-queue", "2",
        "--pd-max-local-prefill", "0"]
    assert disagg.parse_setups("aggregated,adaptive,dynamo") == ["aggregated", "adaptive",
                                                                "dynamo"]
    assert disagg.prefill_flags("adaptive") == () and disagg.prefill_flags("dynamo") == ()
    with pytest.raises(argparse.ArgumentTypeError):
        disagg.parse_setups("adaptive,sometimes")


def test_adaptive_variants_weigh_the_stall_or_cap_the_decode_chunk():
    assert disagg.router_flags("adaptive-w2.5", 16, 0)[-2:] == ["--pd-itl-weight", "2.5"]
    assert disagg.decode_flags("adaptive-w2.5") == ()
    assert disagg.decode_flags("adaptive-dcap32") == ("--long-prefill-token-threshold", "32")
    assert "--pd-itl-weight" not in disagg.router_flags("adaptive-dcap32", 16, 0)
    assert disagg.decode_flags("disaggregated") == ()
    assert disagg.prefill_flags("adaptive-w2-pcap64-dcap16") == (
        "--long-prefill-token-threshold", "64")
    assert disagg.decode_flags("adaptive-w2-pcap64-dcap16") == (
        "--long-prefill-token-threshold", "16")
    assert disagg.router_flags("adaptive-pcap64", 16, 0)[-1] == "0"
    assert disagg.router_flags("adaptive-b0.005-pcap64", 16, 0)[-2:] == [
        "--pd-stall-budget", "0.005"]
    assert disagg.prefill_flags("adaptive-b0.005-pcap64")[-1] == "64"
    assert disagg.router_flags("adaptive-b0", 16, 0)[-2:] == ["--pd-stall-budget", "0"]
    for bad in ("adaptive-w", "adaptive-dcap0", "adaptive-w1e9", "adaptive-dcap3-w2",
                "adaptive-b1"):
        with pytest.raises(argparse.ArgumentTypeError):
            disagg.parse_setups(bad)


def _run(setup: str, itl_p99: float, ttft_p50: float) -> dict:
    return {"setup": setup, "by_class": {"short": {"itl": {"p99": itl_p99},
                                                   "ttft": {"p50": ttft_p50}}}}


def test_ratios_are_over_aggregated():
    runs = [_run("aggregated", 0.2, 0.25), _run("adaptive", 0.08, 0.3),
            _run("disaggregated", 0.1, 1.0)]
    got = disagg.ratios(runs)
    assert got == {"adaptive": {"short_itl_p99": pytest.approx(0.4),
                                "short_ttft_p50": pytest.approx(1.2)},
                   "disaggregated": {"short_itl_p99": pytest.approx(0.5),
                                     "short_ttft_p50": pytest.approx(4.0)}}
    assert disagg.ratios(runs[1:]) == {}  # nothing to compare with


def test_decision_counts_from_the_metrics_text(monkeypatch):
    from prometheus_client import generate_latest

    from tandem.router.metrics import RouterMetrics

    m = RouterMetrics()
    m.child(m.disaggregated, "grpc").inc(5)
    m.child(m.aggregated, "prefill_backlog").inc(3)
    m.child(m.aggregated, "below_threshold").inc()
    text = generate_latest(m.registry).decode()

    class Answer:
        def __init__(self, text: str) -> None:
            self.text = text

    import httpx
    monkeypatch.setattr(httpx, "get", lambda url, timeout: Answer(text))
    assert disagg.pd_counts("http://router") == {
        "disaggregated": 5.0, "aggregated:prefill_backlog": 3.0,
        "aggregated:below_threshold": 1.0}
