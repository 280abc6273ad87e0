"""The release workflow publishes what the chart deploys by default, and CI runs `.ci/run`.

The chart's default images come from a real `helm template` of charts/tandem (the operator's
image and the images it hands its children); the workflow's from its build matrix, with the
version the tag check prints. scripts/release_version.py, which gates the release, runs for
real on good and bad tags.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.conftest import Helm, helm  # noqa: F401 - the real-helm fixture
from tests.chart.test_chart import env_of, operator_container

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CHART = yaml.safe_load((ROOT / "charts" / "tandem" / "Chart.yaml").read_text())
CHART_REPOSITORY = "oci://ghcr.io/tandem-llm/charts"


def workflow(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


RELEASE = workflow("release.yml")


def expand(template: str, matrix: dict[str, str]) -> str:
    """`${{ matrix.X }}` and the version job's output, as Actions would expand them."""
    def value(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        if expr == "needs.version.outputs.version":
            return VERSION
        if expr.startswith("matrix."):
            return str(matrix[expr.removeprefix("matrix.")])
        raise AssertionError(f"unexpected expression {expr!r} in {template!r}")
    return re.sub(r"\$\{\{(.*?)\}\}", value, template)


def step(job: dict[str, Any], action: str) -> dict[str, Any]:
    (found,) = [s for s in job["steps"] if s.get("uses", "").startswith(action + "@")]
    return found


def published_images() -> dict[str, str]:
    """image:tag -> the Dockerfile target it is built from ("" is the default target)."""
    job = RELEASE["jobs"]["images"]
    build = step(job, "docker/build-push-action")["with"]
    assert build["push"] is True and build["context"] == "."
    out = {}
    for entry in job["strategy"]["matrix"]["include"]:
        out[expand(build["tags"], entry)] = expand(build["target"], entry)
    return out


def dockerfile_stages() -> list[str]:
    """Every stage's name in order ("" for an unnamed one)."""
    stages = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?\s*$", line, re.IGNORECASE)
        if m:
            stages.append(m.group(1) or "")
    return stages


def test_the_images_are_the_charts_defaults(helm: Helm) -> None:  # noqa: F811
    container = operator_container(helm.render())
    env = env_of(container)
    images = published_images()
    assert images == {
        env["TANDEM_WORKER_IMAGE"]: "",  # CPU pools: the default target
        env["TANDEM_WORKER_CUDA_IMAGE"]: "worker-cuda",
        container["image"]: "control",
    }
    assert env["TANDEM_ROUTER_IMAGE"] == container["image"]
    assert env["TANDEM_IMAGE"] == env["TANDEM_WORKER_IMAGE"]
    assert env["TANDEM_WORKER_IMAGE"] == f"ghcr.io/tandem-llm/tandem:{VERSION}"
    assert env["TANDEM_WORKER_CUDA_IMAGE"] == f"ghcr.io/tandem-llm/tandem:{VERSION}-cu128"


def test_every_target_is_a_dockerfile_stage_and_the_default_is_the_cpu_one() -> None:
    stages = dockerfile_stages()
    for target in published_images().values():
        assert target == "" or target in stages, target
    # the default target is the last stage, the one that copies the CPU-torch build
    text = (ROOT / "Dockerfile").read_text()
    last = text[text.rindex("\nFROM "):]
    assert "COPY --from=build /opt/tandem" in last
    assert 'TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu' in text


def test_platforms_per_image() -> None:
    rows = {e["name"]: e for e in RELEASE["jobs"]["images"]["strategy"]["matrix"]["include"]}
    assert {n: r["platforms"] for n, r in rows.items()} == {
        "cpu": "linux/amd64,linux/arm64",
        "cuda": "linux/amd64",  # PyTorch's CUDA wheels are x86-64 only
        "control": "linux/amd64,linux/arm64",
    }
    build = step(RELEASE["jobs"]["images"], "docker/build-push-action")["with"]
    assert build["platforms"] == "${{ matrix.platforms }}"


def test_versions_agree() -> None:
    assert CHART["name"] == "tandem"
    assert CHART["version"] == CHART["appVersion"] == VERSION


@pytest.mark.parametrize(("tag", "code"), [(f"v{VERSION}", 0), (f"v{VERSION}.1", 1),
                                            (VERSION, 1)])
def test_the_tag_check(tag: str, code: int) -> None:
    out = subprocess.run([sys.executable, "scripts/release_version.py", tag], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == code, out.stderr
    if code == 0:
        assert out.stdout == f"version={VERSION}\n"
    else:
        assert out.stdout == ""
        assert out.stderr == (f"release_version: tag {tag!r} is not 'v{VERSION}' "
                              f"(pyproject.toml's version)\n")


def test_the_tag_check_reads_the_chart(tmp_path: Path) -> None:
    (tmp_path / "charts" / "tandem").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text('[project]\nversion = "1.2.0"\n')
    (tmp_path / "charts" / "tandem" / "Chart.yaml").write_text(
        'apiVersion: v2\nname: tandem\nversion: 1.2.0\nappVersion: "1.1.0"\n')
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import release_version
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert release_version.problems("v1.2.0", tmp_path) == (
        "1.2.0", ["charts/tandem/Chart.yaml appVersion is '1.1.0', not '1.2.0'"])


def test_the_release_runs_on_version_tags_and_checks_first() -> None:
    assert RELEASE["on"] == {"push": {"tags": ["v*"]}}
    jobs = RELEASE["jobs"]
    check = jobs["version"]["steps"][-1]
    assert check["id"] == "check"
    assert check["run"] == ('python3 scripts/release_version.py "$GITHUB_REF_NAME" '
                            '>> "$GITHUB_OUTPUT"')
    assert jobs["version"]["outputs"]["version"] == "${{ steps.check.outputs.version }}"
    assert jobs["images"]["needs"] == "version"
    assert jobs["chart"]["needs"] == ["version", "images"]
    for name in ("images", "chart"):
        assert jobs[name]["permissions"] == {"contents": "read", "packages": "write"}
    login = step(jobs["images"], "docker/login-action")["with"]
    assert login["password"] == "${{ secrets.GITHUB_TOKEN }}"


def test_the_chart_is_pushed_to_the_oci_repository() -> None:
    assert RELEASE["env"]["CHART_REPOSITORY"] == CHART_REPOSITORY
    run = "\n".join(s.get("run", "") for s in RELEASE["jobs"]["chart"]["steps"])
    assert "helm package charts/tandem --destination dist" in run
    # `helm package` names the archive <name>-<version>.tgz
    assert f'helm push "dist/{CHART["name"]}-$VERSION.tgz" "$CHART_REPOSITORY"' in run
    push = RELEASE["jobs"]["chart"]["steps"][-1]
    assert push["env"]["VERSION"] == "${{ needs.version.outputs.version }}"


def test_docs_name_the_published_chart_and_images() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        for ref in re.findall(r"oci://[\w./-]+", text):
            assert ref in (CHART_REPOSITORY, f"{CHART_REPOSITORY}/{CHART['name']}"), (page, ref)
        for image in re.findall(r"ghcr\.io/tandem-llm/[\w.-]+", text):
            assert image in ("ghcr.io/tandem-llm/tandem", "ghcr.io/tandem-llm/tandem-control",
                             "ghcr.io/tandem-llm/charts"), (page, image)


@pytest.mark.parametrize("name", ["release.yml", "ci.yml"])
def test_actions_are_pinned_by_version_tag(name: str) -> None:
    doc = workflow(name)
    uses = [s["uses"] for job in doc["jobs"].values() for s in job["steps"] if "uses" in s]
    assert uses
    for ref in uses:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+(\.\d+){0,2}", ref), ref


def test_ci_runs_the_ci_entry_point() -> None:
    ci = workflow("ci.yml")
    (job,) = ci["jobs"].values()
    assert [s["run"] for s in job["steps"] if "run" in s] == ["bash .ci/run"]
    # the CPU build of torch: the Makefile takes torch from TORCH_INDEX_URL first
    assert job["env"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "TORCH_INDEX_URL ?=" in (ROOT / "Makefile").read_text()
