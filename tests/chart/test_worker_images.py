"""The chart's worker images (`workerImage`): CPU pools run TANDEM_WORKER_IMAGE, pools that
request nvidia.com/gpu TANDEM_WORKER_CUDA_IMAGE (the Dockerfile's worker-cuda target, tag
`<tag>-cu128` by default), both separate from the operator's own image; the schema refuses a
malformed value; the operator, configured from the rendered env, deploys them."""

from __future__ import annotations

import argparse

import pytest

from tandem.operator.cli import add_operator_args, config_from
from tandem.operator.reconcile import manifests
from tandem.operator.spec import parse_spec
from tests.chart.conftest import Helm
from tests.chart.test_chart import env_of, operator_container
from tests.operator.manifests import OWNER, by_kind, container

REPO = "ghcr.io/tandem-llm/tandem"
DIGEST = "sha256:" + "ab" * 32


def images(helm: Helm, *sets: str) -> tuple[str, str, str]:
    """(the operator's image, TANDEM_WORKER_IMAGE, TANDEM_WORKER_CUDA_IMAGE)."""
    c = operator_container(helm.render(sets=sets))
    env = env_of(c)
    return c["image"], env["TANDEM_WORKER_IMAGE"], env["TANDEM_WORKER_CUDA_IMAGE"]


@pytest.mark.parametrize(("sets", "cpu", "cuda"), [
    ((), f"{REPO}:0.1.0", f"{REPO}:0.1.0-cu128"),  # appVersion
    (("image.tag=1.2.3",), f"{REPO}:1.2.3", f"{REPO}:1.2.3-cu128"),
    ((f"image.digest={DIGEST}",), f"{REPO}@{DIGEST}", f"{REPO}:0.1.0-cu128"),
    (("workerImage.repository=r.example/w", "workerImage.tag=v7"), "r.example/w:v7",
     "r.example/w:v7-cu128"),
    (("workerImage.cudaTag=nightly-cu126",), f"{REPO}:0.1.0", f"{REPO}:nightly-cu126"),
    ((f"workerImage.digest={DIGEST}", f"workerImage.cudaDigest={DIGEST.replace('ab', 'cd')}"),
     f"{REPO}@{DIGEST}", f"{REPO}@{DIGEST.replace('ab', 'cd')}"),
], ids=["defaults", "image-tag", "image-digest", "worker-repo", "cuda-tag", "digests"])
def test_worker_images(helm: Helm, sets, cpu, cuda) -> None:
    assert images(helm, *sets)[1:] == (cpu, cuda)


def test_worker_images_are_not_the_operators(helm: Helm) -> None:
    operator, cpu, cuda = images(helm, "controlImage.repository=r.example/control",
                                 "workerImage.repository=r.example/worker")
    assert operator == "r.example/control:0.1.0"
    assert (cpu, cuda) == ("r.example/worker:0.1.0", "r.example/worker:0.1.0-cu128")


def test_schema_refuses_a_bad_worker_image(helm: Helm) -> None:
    for bad, word in (("workerImage.cudaDigest=sha256:abc", "cudaDigest"),
                      ("workerImage.cpuTag=x", "cpuTag")):
        proc = helm.run(*helm.template_args(sets=(bad,)), check=False)
        assert proc.returncode != 0 and word in proc.stderr, proc.stderr


def test_the_operator_deploys_the_charts_worker_images(helm: Helm) -> None:
    env = {k: v for k, v in env_of(operator_container(helm.render(sets=(
        "workerImage.repository=r.example/worker",)))).items() if isinstance(v, str)}
    p = argparse.ArgumentParser()
    add_operator_args(p)
    config = config_from(p.parse_args(["--all-namespaces"]), env)
    raw = {"model": {"uri": "SmolLM2-135M-Instruct", "dtype": "bfloat16"},
           "prefill": {"replicas": 1},
           "decode": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}}}
    got = {d["metadata"]["name"]: container(d) for d in by_kind(
        manifests(parse_spec(raw), OWNER, config), "Deployment")}
    assert got["demo-prefill"]["image"] == "r.example/worker:0.1.0"
    assert got["demo-decode"]["image"] == "r.example/worker:0.1.0-cu128"
    assert got["demo-router"]["image"] == f"{REPO}-control:0.1.0"  # the control image
    args = got["demo-decode"]["args"]
    assert args[args.index("--device") + 1] == "cuda"
