"""The chart's control image (the Dockerfile's torch-free `control` target): it runs the
operator and, through TANDEM_ROUTER_IMAGE, the routers the operator deploys; unset, every
image is `image`; the schema refuses a malformed digest. The operator's config reads it."""

from __future__ import annotations

from tandem.operator.cli import add_operator_args, config_from
from tests.chart.conftest import Helm
from tests.chart.test_chart import env_of, operator_container


def test_control_image_runs_the_operator_and_the_routers(helm: Helm) -> None:
    c = operator_container(helm.render(sets=(
        "image.repository=registry.example.com/ml/tandem", "image.tag=1.2.3",
        "controlImage.repository=registry.example.com/ml/tandem-control")))
    assert c["image"] == "registry.example.com/ml/tandem-control:0.1.0"  # appVersion
    env = env_of(c)
    assert env["TANDEM_IMAGE"] == "registry.example.com/ml/tandem:1.2.3"  # the workers'
    assert env["TANDEM_ROUTER_IMAGE"] == c["image"]
    digest = "sha256:" + "cd" * 32
    c = operator_container(helm.render(sets=(
        "controlImage.repository=r.example/control", "controlImage.tag=v7",
        f"controlImage.digest={digest}")))
    assert c["image"] == env_of(c)["TANDEM_ROUTER_IMAGE"] == f"r.example/control@{digest}"


def test_the_default_control_image_is_the_published_one(helm: Helm) -> None:
    c = operator_container(helm.render())
    env = env_of(c)
    assert c["image"] == env["TANDEM_ROUTER_IMAGE"] == "ghcr.io/tandem-llm/tandem-control:0.1.0"
    assert env["TANDEM_IMAGE"] == env["TANDEM_WORKER_IMAGE"] == "ghcr.io/tandem-llm/tandem:0.1.0"
    assert env["TANDEM_WORKER_CUDA_IMAGE"] == "ghcr.io/tandem-llm/tandem:0.1.0-cu128"


def test_without_a_control_image_everything_runs_the_tandem_image(helm: Helm) -> None:
    c = operator_container(helm.render(sets=("controlImage.repository=",)))
    env = env_of(c)
    assert c["image"] == env["TANDEM_IMAGE"] == env["TANDEM_ROUTER_IMAGE"] == (
        "ghcr.io/tandem-llm/tandem:0.1.0")


def test_schema_refuses_a_bad_control_image(helm: Helm) -> None:
    for bad, word in (("controlImage.digest=sha256:abc", "digest"),
                      ("controlImage.registry=x", "registry")):
        proc = helm.run(*helm.template_args(sets=(bad,)), check=False)
        assert proc.returncode != 0 and word in proc.stderr, proc.stderr


def test_the_rendered_env_reaches_the_operator_config(helm: Helm) -> None:
    import argparse

    c = operator_container(helm.render(sets=("controlImage.repository=r.example/control",)))
    env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
    p = argparse.ArgumentParser()
    add_operator_args(p)
    cfg = config_from(p.parse_args(["--all-namespaces"]), env)
    assert cfg.router_image == "r.example/control:0.1.0"
    assert cfg.image == "ghcr.io/tandem-llm/tandem:0.1.0"
