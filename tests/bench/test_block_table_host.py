"""bench/block_table_host.py runs end to end at a small size: both block-table paths give the
same buffer (the script asserts it) and the report has every timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_small_run_writes_its_report(tmp_path):
    out = tmp_path / "bt.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "block_table_host.py"), "--batch", "8",
                    "--blocks", "6", "--repeat", "3", "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    report = json.loads(out.read_text())
    assert (report["batch"], report["blocks"], report["repeat"]) == (8, 6, 3)
    assert set(report["median_ms"]) == {"lists", "persistent", "execute"}
    assert all(v > 0 for v in report["median_ms"].values())
