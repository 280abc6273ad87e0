"""bench/gil_share.py: its step pairing and arithmetic, and a real `--quick` run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gil_share  # noqa: E402


def _row(wall: float, shape: tuple[int, int, int], *, forward: float = 0.0, runq: float = 0.0,
         blocked: float = 0.0, output: float = 0.0) -> dict:
    row = {p: 0.0 for p in gil_share.PHASES} | {"forward": forward, "output": output}
    return row | {"wall": wall, "cpu": wall - runq - blocked, "runq": runq, "blocked": blocked,
                  "detok": output, "shape": list(shape)}


def test_exact_replay_pairs_step_by_step_and_computes_the_shares():
    http = [_row(0.10, (0, 40, 40), forward=0.09), _row(0.05, (4, 0, 44), forward=0.03,
                                                         blocked=0.01, runq=0.005)]
    direct = [_row(0.08, (0, 40, 40), forward=0.08), _row(0.02, (4, 0, 44), forward=0.02,
                                                           output=0.002)]
    c = gil_share.compare(http, direct)
    assert c["shapes_match"] and c["paired_steps"] == 2
    assert c["contention"] == pytest.approx((0.15 - 0.10) / 0.15)
    assert c["contention_decode_only"] == pytest.approx((0.05 - 0.02) / 0.05)
    assert c["median_step_increase"] == pytest.approx((0.2 + 0.6) / 2)
    assert c["gil_wait"] == pytest.approx(0.01 / 0.15)
    assert c["runq_http"] == pytest.approx(0.005 / 0.15) and c["runq_direct"] == 0.0
    assert c["forward_lost"] == pytest.approx((0.12 - 0.10) / 0.15)
    assert c["output_share_direct"] == pytest.approx(0.002 / 0.10)


def test_diverged_replay_pairs_only_equal_shapes():
    http = [_row(0.3, (0, 10, 10)), _row(0.2, (2, 0, 20)), _row(0.2, (2, 0, 22))]
    direct = [_row(0.1, (2, 0, 20)), _row(0.1, (0, 7, 7)), _row(0.1, (2, 0, 22))]
    pairs, exact = gil_share.pair_steps(http, direct)
    assert not exact
    assert [(a["shape"], b["shape"]) for a, b in pairs] == [([2, 0, 20], [2, 0, 20]),
                                                            ([2, 0, 22], [2, 0, 22])]
    assert gil_share.compare(http, direct)["contention"] == pytest.approx(0.5)


@pytest.mark.slow
def test_quick_run_writes_a_sane_report(tmp_path):
    out = tmp_path / "gil.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gil_share.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gil wait" in proc.stdout and "5 %)" in proc.stdout
    report = json.loads(out.read_text())
    wl = report["workload"]
    assert (wl["requests"], wl["max_tokens"], wl["rounds"]) == (4, 8, 1)
    [pair] = report["pairs"]
    [run] = report["runs"]
    assert pair["config"] == "http" and pair["shapes_match"]  # the replay is step-exact
    assert pair["paired_steps"] == pair["http_steps"] == pair["direct_steps"] > 0
    for kind in ("http", "direct"):
        cols = run[kind]["steps"]
        steps = [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]
        assert len(steps) == pair[f"{kind}_steps"]
        # every request decodes max_tokens - 1 tokens after the step that ends its prompt
        assert sum(s["shape"][0] for s in steps) == wl["requests"] * (wl["max_tokens"] - 1)
        for s in steps:
            assert 0 < s["forward"] < s["wall"] and s["cpu"] > 0
            assert all(s[p] >= -1e-4 for p in gil_share.PHASES)
        assert run[kind]["cpu"]["engine_thread_cpu_s"] > 0
    assert run["http"]["cpu"]["main_thread_cpu_s"] > 0  # the HTTP loop did the streaming
    for key in ("contention", "contention_decode_only", "gil_wait", "py_phases_lost",
                "forward_lost"):
        assert -1.0 <= pair[key] <= 1.0, key
    for key in ("blocked_http", "blocked_direct", "runq_http", "runq_direct",
                "output_share_direct", "detok_share_direct"):
        assert 0.0 <= pair[key] <= 1.0, key
    assert report["summary"]["http"]["contention"]["median"] == pair["contention"]
