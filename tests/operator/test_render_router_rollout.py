"""The router's rollout settings and image as rendered: `--drain-seconds` (parsed by the real
`tandem router` parser) fits inside terminationGracePeriodSeconds after the preStop sleep,
with room to shut down; the routers run the operator's control image (TANDEM_ROUTER_IMAGE),
which spec.image and router.image override, while the workers keep the worker image."""

from __future__ import annotations

import argparse

from tandem.operator.cli import add_operator_args, config_from
from tandem.operator.render.router import EXIT_SLACK_SECONDS
from tandem.router.main import DRAIN_SECONDS, add_router_args, drain_seconds
from tests.operator.manifests import arg, by_kind, container, one, render
from tests.operator.samples import spec


def test_router_drain_fits_the_grace_period_after_the_pre_stop_sleep():
    d = one(render("aggregated"), "Deployment", "demo-router")
    pod = d["spec"]["template"]["spec"]
    c = container(d)
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = arg(c["args"], "--drain-seconds")
    assert drain == str(int(DRAIN_SECONDS))  # the router's own default
    assert pod["terminationGracePeriodSeconds"] == sleep + int(drain) + EXIT_SLACK_SECONDS
    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(c["args"][1:])  # "router" is the subcommand
    assert drain_seconds(args, {}) == DRAIN_SECONDS


def test_routers_run_the_control_image_and_workers_the_worker_image():
    docs = render("disaggregated", router_image="registry.example/tandem-control:1")
    images = {d["metadata"]["name"]: container(d)["image"] for d in by_kind(docs, "Deployment")}
    assert images == {"demo-router": "registry.example/tandem-control:1",
                      "demo-prefill": "tandem:test", "demo-decode": "tandem:test"}
    # unset: the worker image for all
    images = {container(d)["image"] for d in by_kind(render("disaggregated"), "Deployment")}
    assert images == {"tandem:test"}
    # spec.image names the InferenceService's own image: it wins over the operator's
    raw = {**spec("aggregated"), "image": "mine:2"}
    assert {container(d)["image"] for d in by_kind(
        render(raw, router_image="registry.example/tandem-control:1"), "Deployment")} == {
        "mine:2"}
    # router.image wins over both
    docs = render("pods", router_image="control:9")
    assert container(one(docs, "Deployment", "demo-router"))["image"] == (
        "registry.example/tandem-control:1")


def test_operator_config_reads_the_router_image_from_its_environment():
    p = argparse.ArgumentParser()
    add_operator_args(p)
    args = p.parse_args(["--all-namespaces"])
    cfg = config_from(args, {"TANDEM_IMAGE": "w:1", "TANDEM_ROUTER_IMAGE": "c:1"})
    assert (cfg.image, cfg.router_image) == ("w:1", "c:1")
    assert config_from(args, {"TANDEM_IMAGE": "w:1"}).router_image is None
