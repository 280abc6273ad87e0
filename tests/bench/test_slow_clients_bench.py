"""Smoke test of `bench/slow_clients.py`: one short run on this tree, a worker and a router
as real processes, stalled sockets that never read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_quick_run_aborts_stalled_streams_and_reports_both_probes(tmp_path):
    out = tmp_path / "slow.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "slow_clients.py"), "--clients",
                        "1", "--stall-s", "6", "--pipeline-s", "1", "--request-timeout", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())["results"]
    assert list(got) == ["this"]
    worker, router = got["this"]["worker"], got["this"]["router"]
    # the stream ran (n=4 of one request), then the 3 s deadline aborted it while stalled
    assert max(s["running"] for s in worker["samples"]) == 4
    assert worker["running_at_close"] == 0 and worker["running_3s_after_close"] == 0
    assert router["request_bytes_sent"] > 0 and router["rss_peak_mib"] > 0
    assert "[this] worker RSS" in r.stdout and "[this] router RSS" in r.stdout
