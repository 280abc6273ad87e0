"""bench/grammar_backends.py runs end to end at its smallest size: both backends, every
number finite and positive, the valid instances each backend refuses recorded."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_small_run_writes_its_report(tmp_path, bundled_gguf):
    out = tmp_path / "gb.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "grammar_backends.py"),
                          "--schemas", "16", "--rounds", "1", "--repeat", "1", "--out",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert (report["schemas"], report["vocab"]) == (16, 49152)
    results = {r["backend"]: r for r in report["results"]}
    assert set(results) == {"xgrammar", "llguidance"}
    for r in results.values():
        numbers = [v for v in r.values() if isinstance(v, float)]
        assert len(numbers) >= 10 and all(math.isfinite(v) and v > 0 for v in numbers), r
        assert len(r["cases"]) == 19  # 16 schemas, a regex, a choice, json_object
    assert results["llguidance"]["refused"] == []
    # xgrammar 0.2.9 refuses "tab\there" in a string with maxLength (seed 9), no other
    assert set(results["xgrammar"]["refused"]) <= {"schema-9"}
    assert "apply_batch16_ms" in run.stdout and "refused" in run.stdout


def test_schemas_must_fill_a_batch_of_16() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "grammar_backends.py"),
                          "--schemas", "8"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--schemas must be at least 16" in run.stderr
