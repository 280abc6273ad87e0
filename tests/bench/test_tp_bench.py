"""bench/tp.py end to end in its `--quick` form: the bundled model at TP = 1 and 3 and the
random 8-head model at TP = 1 and 2 (real rank processes over gloo) on its three
workloads, greedy tokens equal (exit code 0), and a JSON with per-workload ratios and the
TP engine's communication share in (0, 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_tp_bench_writes_ratios_and_comm_share(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tp.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {k: m["tp"] for k, m in data["models"].items()} == {"bundled": 3,
                                                                "random-8-heads": 2}
    for model in data["models"].values():
        tp = f"tp{model['tp']}"
        assert set(model["summary"]) == {"prefill", "decode-1", "decode-16"}
        for row in model["summary"].values():
            assert row["greedy_equal"] is True
            assert row["ratio"] > 0
            assert 0 < row[tp]["comm_share"] < 1 and row[tp]["collectives"] > 0
            assert row[tp]["steps"] >= 1 and row["tp1"]["steps"] >= 1
