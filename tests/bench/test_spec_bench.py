"""bench/spec_decode.py end to end in its `--quick` form: the baseline and n-gram engines
as long-lived processes taking runs in rotating order, every speculative output equal to
the baseline's (exit code 0), and a JSON with both engines' runs, drafts and the baseline's
n-gram ceiling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_spec_bench_runs_both_engines_on_every_job(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "spec_decode.py"), "--quick",
                           "--engines", "baseline,ngram", "--workloads", "grounded,code",
                           "--batch-sizes", "1,2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mismatches"] == []
    jobs = ["grounded/b1", "grounded/b2", "code/b1", "code/b2"]
    base, ngram = data["results"]["baseline"], data["results"]["ngram"]
    assert list(base["runs"]) == jobs and list(ngram["runs"]) == jobs
    assert ngram["spec_enabled"] is True and base["spec_enabled"] is False
    for key in jobs:
        assert ngram["runs"][key]["matches_baseline"] is True
        assert ngram["runs"][key]["output_sha1"] == base["runs"][key]["output_sha1"]
        assert base["runs"][key]["tokens"] == ngram["runs"][key]["tokens"] > 0
    # a grounded prompt repeats its passage: prompt lookup finds something to draft
    assert ngram["runs"]["grounded/b1"]["spec"]["spec_num_drafts"] > 0
    assert set(base["runs"]["grounded/b1"]["ngram_ceiling"]) == {"k4", "k8"}
    assert set(base["sample_text"]) == {"grounded", "code"}
    assert "per prompt ngram grounded/b1" in proc.stdout
