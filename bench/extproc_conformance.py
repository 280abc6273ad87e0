"""A conformance report for the endpoint picker: runs its conformance-style suite
(tests/router/test_extproc_conformance.py, modelled on the Gateway API Inference Extension's
conformance tests and protocol clauses) and the end-to-end tests through a real Envoy
(tests/router/test_extproc_envoy.py), and records each test's outcome.

    .venv/bin/python bench/extproc_conformance.py [--out PATH]

Writes `bench/results/extproc_conformance-<date>.json`: every test with its outcome and
seconds, the totals, the Envoy version used and the machine. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("tests/router/test_extproc_conformance.py", "tests/router/test_extproc_envoy.py")


def envoy_version() -> str | None:
    exe = Path(os.environ.get("TANDEM_TOOLS_DIR", ROOT / ".tools")) / "bin" / "envoy"
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                             timeout=60)
    except OSError:
        return None
    return out.stdout.strip().rsplit(" ", 1)[-1] or None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"--junitxml={junit}", *SUITES], cwd=ROOT).returncode
        tree = ET.parse(junit)
    tests = []
    for case in tree.iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
        tests.append({"suite": case.get("classname", "").rsplit(".", 1)[-1],
                      "test": case.get("name"), "outcome": outcome,
                      "seconds": round(float(case.get("time", 0)), 3)})
    counts = {k: sum(1 for t in tests if t["outcome"] == k)
              for k in ("passed", "failed", "error", "skipped")}
    result = {"bench": "extproc_conformance", "date": dt.date.today().isoformat(),
              "envoy": envoy_version(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "totals": counts, "tests": tests}
    out = Path(args.out) if args.out else \
        ROOT / "bench" / "results" / f"extproc_conformance-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(counts), f"-> {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
