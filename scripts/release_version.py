#!/usr/bin/env python3
"""Check a release tag against the versions the repository declares; print `version=X`.

Usage: python3 scripts/release_version.py v0.1.0 >> "$GITHUB_OUTPUT"

The tag must be `v` + pyproject.toml's `[project] version`, which must equal
charts/tandem/Chart.yaml's `version` and `appVersion` (the chart's default image tags are its
appVersion). Exits 1 naming every disagreement; needs only the standard library.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chart_field(text: str, key: str) -> str | None:
    """A top-level scalar of Chart.yaml (quoted or not)."""
    m = re.search(rf"^{key}:\s*[\"']?([^\"'\s#]+)", text, re.MULTILINE)
    return m.group(1) if m else None


def problems(tag: str, root: Path = ROOT) -> tuple[str, list[str]]:
    """(pyproject's version, what disagrees with it)."""
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    chart = (root / "charts" / "tandem" / "Chart.yaml").read_text()
    found = []
    if tag != f"v{version}":
        found.append(f"tag {tag!r} is not 'v{version}' (pyproject.toml's version)")
    for key in ("version", "appVersion"):
        value = chart_field(chart, key)
        if value != version:
            found.append(f"charts/tandem/Chart.yaml {key} is {value!r}, not {version!r}")
    return version, found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: release_version.py TAG", file=sys.stderr)
        return 2
    version, found = problems(argv[0])
    for problem in found:
        print(f"release_version: {problem}", file=sys.stderr)
    if found:
        return 1
    print(f"version={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
