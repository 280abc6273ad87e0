"""The Dockerfile's `worker-cuda` target, read instruction by instruction (no image can be
built here): CUDA torch at the pinned version from a cu* index whose CUDA version is the
chart's default tag suffix, a build that fails without Triton or with a CPU-only torch, the
same runtime (compiler, unprivileged user, entry point) as the default target, no
NVIDIA_VISIBLE_DEVICES; the default target stays last and CPU; the header's commands name
real targets."""

from __future__ import annotations

import json
import re
import tomllib

from tests.chart.conftest import ROOT
from tests.chart.test_dockerfile import final_stage, instructions, stages


def _args() -> dict[str, str]:
    return dict(re.findall(r"ARG (\w+)=(\S+)", "\n".join(
        f"{w} {a}" for w, a in instructions() if w == "ARG")))


def test_cuda_build_installs_the_pinned_cuda_torch_and_checks_triton() -> None:
    s = stages()
    build = " ".join(a for _, a in s["cuda-build"])
    args = _args()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={args['TORCH_VERSION']}" in deps
    index = args["CUDA_TORCH_INDEX_URL"]
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", index), index
    assert 'pip install --index-url "${CUDA_TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in build
    assert "import torch, triton" in build and "assert torch.version.cuda" in build
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    runtime = ",".join(sorted(set(extras) - {"test"}))  # operator, ray (multi-node pools)
    assert f'pip install ".[{runtime}]"' in build
    assert "find_bundled_gguf" in build  # the bundled model, as in the CPU image
    # the chart's default CUDA tag names the same CUDA version (<appVersion>-cu128)
    helpers = (ROOT / "charts" / "tandem" / "templates" / "_helpers.tpl").read_text()
    assert f'"%s-{index.rsplit("/", 1)[1]}"' in helpers


def test_worker_cuda_runs_like_the_default_target() -> None:
    s = stages()
    assert list(s)[-1].startswith("#")  # the unnamed default target is last: `docker build .`
    cuda, default = s["worker-cuda"], final_stage()
    assert cuda[0] == ("FROM", "runtime AS worker-cuda") and default[0] == ("FROM", "runtime")
    assert ("COPY", "--from=cuda-build /opt/tandem /opt/tandem") in cuda
    assert ("COPY", "--from=build /opt/tandem /opt/tandem") in default
    for word in ("USER", "ENTRYPOINT", "CMD", "EXPOSE"):
        assert [a for w, a in cuda if w == word] == [a for w, a in default if w == word], word
    assert json.loads([a for w, a in cuda if w == "ENTRYPOINT"][-1]) == ["tandem"]
    runtime = " ".join(a for _, a in s["runtime"])
    assert "gcc" in runtime and "libc6-dev" in runtime  # Triton compiles its launchers
    env = " ".join(a for w, a in cuda if w == "ENV")
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    text = " ".join(a for _, a in instructions())
    assert "NVIDIA_VISIBLE_DEVICES" not in text  # a pod sees only the GPUs it requests
    assert _args()["TORCH_INDEX_URL"].endswith("/cpu")  # the default target stays CPU


def test_header_commands_name_real_targets() -> None:
    header = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    targets = re.findall(r"docker build --target (\S+)", "\n".join(header))
    assert sorted(targets) == ["control", "worker-cuda"]
    assert set(targets) <= set(stages())
