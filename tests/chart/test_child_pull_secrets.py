"""childImagePullSecrets: the chart hands them to the operator (TANDEM_IMAGE_PULL_SECRETS),
the operator's config reads them, and every child pod it renders carries them, ahead of a
pool's own; the gpu-pools example renders through the operator into valid pods."""

from __future__ import annotations

import argparse

import kubernetes_validate
import yaml

from tandem.operator.cli import add_operator_args, config_from
from tandem.operator.reconcile import manifests
from tandem.operator.render import Owner
from tandem.operator.spec import parse_spec
from tests.chart.conftest import CHART, Helm, one

OWNER = Owner("llama-pd", "ml", "0b5c6a9e-1111-4222-8333-444455556666")


def _env(helm: Helm, *sets: str) -> dict[str, str]:
    dep = one(helm.render(sets=sets), "Deployment", "tandem-operator")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in c["env"]}


def test_child_pull_secrets_go_from_values_through_the_operator_to_every_child(helm: Helm):
    assert "TANDEM_IMAGE_PULL_SECRETS" not in _env(helm)
    env = _env(helm, "childImagePullSecrets[0].name=regcred",
               "childImagePullSecrets[1].name=mirror")
    assert env["TANDEM_IMAGE_PULL_SECRETS"] == "regcred,mirror"
    p = argparse.ArgumentParser()
    add_operator_args(p)
    config = config_from(p.parse_args(["--all-namespaces"]), env)
    assert config.image_pull_secrets == ("regcred", "mirror")
    example = yaml.safe_load((CHART / "examples" / "gpu-pools.yaml").read_text())
    docs = manifests(parse_spec(example["spec"]), OWNER, config)
    secrets = {d["metadata"]["name"]: [s["name"] for s in d["spec"]["template"]["spec"][
        "imagePullSecrets"]] for d in docs if d["kind"] == "Deployment"}
    assert secrets == {"llama-pd-router": ["regcred", "mirror"],  # the pool's own: deduplicated
                       "llama-pd-prefill": ["regcred", "mirror"],
                       "llama-pd-decode": ["regcred", "mirror"]}
    for doc in docs:
        if doc["kind"] in ("Deployment", "Service", "PodDisruptionBudget"):
            kubernetes_validate.validate(doc, "1.32", strict=True)
