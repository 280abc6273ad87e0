"""bench/host_share.py: its per-step arithmetic, and a real run on a tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import host_share  # noqa: E402
from tests.engine.utils import make_tiny_model_dir  # noqa: E402


def _row(wall: float, schedule: float, build: float, output: float) -> dict:
    return {"wall": wall, "schedule": schedule, "build": build, "forward": wall / 2,
            "sample": 0.0, "update": 0.0, "output": output}


def test_summary_splits_the_host_time_and_its_share():
    rows = [_row(1.0, 0.01, 0.02, 0.03)] + [_row(0.1, 0.001, 0.002, 0.003)] * 3
    s = host_share.summarize({"steps": rows, "tokens_per_s": 50.0, "output_thread_s": 0.4})
    assert s["steps"] == 4
    assert s["step_ms"] == pytest.approx(1e3 * 1.3 / 4)
    assert s["host_ms"] == pytest.approx(1e3 * (0.06 + 3 * 0.006) / 4)
    assert s["host_share"] == pytest.approx((0.06 + 3 * 0.006) / 1.3)
    assert s["output_share"] == pytest.approx((0.03 + 3 * 0.003) / 1.3)
    assert s["decode_step_ms"] == pytest.approx(100.0)  # the first step is not a decode
    assert s["decode_host_share"] == pytest.approx(0.06)
    assert s["output_thread_ms_per_step"] == pytest.approx(100.0)


def test_a_run_measures_both_loops(tmp_path, monkeypatch, capsys):
    make_tiny_model_dir(tmp_path / "m", "llama", seed=3, tokenizer="trained")
    out = tmp_path / "hs.json"
    monkeypatch.setattr(sys, "argv", [
        "host_share.py", "--model", str(tmp_path / "m"), "--streams", "4", "--prompt-tokens",
        "8", "--max-tokens", "5", "--rounds", "2", "--out", str(out)])
    assert host_share.main() == 0
    report = json.loads(out.read_text())
    assert [r["overlapped"] for r in report["runs"]] == [False, True, True, False]
    for run in report["runs"]:
        assert run["tokens"] == 20 and len(run["steps"]) == run["summary"]["steps"] >= 5
        assert (run["output_thread_s"] > 0) is run["overlapped"]
    assert set(report["table"]) == {"serial", "overlapped"}
    assert "overlapped / serial: tokens_per_s" in capsys.readouterr().out


def test_compare_optimistic_runs_the_three_loops(tmp_path, monkeypatch):
    make_tiny_model_dir(tmp_path / "m", "llama", seed=3, tokenizer="trained")
    out = tmp_path / "hs.json"
    monkeypatch.setattr(sys, "argv", [
        "host_share.py", "--model", str(tmp_path / "m"), "--streams", "4", "--prompt-tokens",
        "8", "--max-tokens", "5", "--rounds", "2", "--compare-optimistic", "--out", str(out)])
    assert host_share.main() == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["runs"]] == [
        "serial", "overlapped", "overlapped_host_ids",
        "overlapped", "overlapped_host_ids", "serial"]
    for run in report["runs"]:
        assert run["tokens"] == 20
        # only the optimistic loop commits steps after launching the next one
        assert (run["optimistic_steps"] > 0) is (run["mode"] == "overlapped")
        # sampling is timed as such on every path (not counted as input building)
        assert all(step["sample"] > 0 for step in run["steps"])
    assert set(report["table"]) == {"serial", "overlapped", "overlapped_host_ids"}
    assert set(report["ratios_optimistic"]) == {"tokens_per_s", "step_ms", "host_ms",
                                                "output_ms"}
