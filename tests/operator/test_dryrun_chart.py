"""`tandem render`'s defaults are the chart's: the environment the real `helm template` of
charts/tandem gives its operator equals, variable by variable, what `chart_defaults` computes
for the same values, release and namespace (a chart default changed without the code, or a
variable added to the operator's Deployment, fails here); and `tandem render` with nothing
set renders what that operator applies: GPU pools on the CUDA image, routers on the control
image and labelled with the release, the NetworkPolicies naming the operator's namespace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.cli import build_parser
from tandem.operator import chart_defaults
from tandem.operator.cli import config_from
from tandem.operator.dryrun import environment
from tandem.operator.render import Owner, render_all
from tandem.operator.spec import parse_spec
from tests.chart.conftest import CHART, KUBE_VERSION, Helm, helm  # noqa: F401 - the fixture
from tests.operator.test_dryrun import EXAMPLES, UID, documents, tandem_render
from tests.operator.test_dryrun_schema import render_cli

# a values file that changes every input of the operator's environment
CUSTOM: dict[str, Any] = {
    "fullnameOverride": "llm",
    "image": {"repository": "registry.example/ml/tandem", "tag": "2.0", "pullPolicy": "Always"},
    "controlImage": {"repository": "registry.example/ml/control",
                     "digest": "sha256:" + "c" * 64},
    "workerImage": {"tag": "2.0-cpu", "cudaTag": "2.0-cu126"},
    "childImagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
    "watchNamespaces": ["team-a", "team-b"],
    "redis": {"enabled": True, "port": 6380},
    "security": {"allowHostPath": True, "allowedRuntimeClasses": ["nvidia", "kata"],
                 "allowedSecrets": ["team-*"], "allowedRegistries": ["registry.example/ml"],
                 "allowedClusterIssuers": ["ca"]},
    "operator": {"env": [{"name": "TANDEM_ALLOWED_SECRETS", "value": "hf-*"}]},
}


def chart_env(helm: Helm, release: str, namespace: str,  # noqa: F811 - the fixture
              values: Path | None = None, sets: tuple[str, ...] = ()) -> dict[str, str]:
    """The TANDEM_* variables `helm template` (with `--set` of each of `sets`) gives the
    operator container (a fieldRef to the pod's namespace read as the namespace the
    Deployment is rendered in)."""
    args = ["template", release, str(CHART), "--namespace", namespace,
            "--kube-version", KUBE_VERSION]
    if values is not None:
        args += ["--values", str(values)]
    for s in sets:
        args += ["--set", s]
    docs = [d for d in yaml.safe_load_all(helm.run(*args).stdout) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"
              and d["metadata"]["name"].endswith("-operator")]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    out = {}
    for var in container["env"]:
        if not var["name"].startswith("TANDEM_"):
            continue
        if "valueFrom" in var:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, var
            out[var["name"]] = dep["metadata"]["namespace"]
        else:
            out[var["name"]] = var["value"]
    return out


def render_env(*argv: str) -> dict[str, str]:
    """What `tandem render ARGV` gives `config_from`, with an empty environment."""
    args = build_parser().parse_args(["render", "-f", "-", *argv])
    values = [Path(p).read_text() for p in args.values]
    return {k: v for k, v in environment(args, {}, values).items() if k.startswith("TANDEM_")}


def test_the_default_install_gives_the_operator_what_render_assumes(helm: Helm) -> None:  # noqa: F811
    want = chart_env(helm, chart_defaults.RELEASE, chart_defaults.NAMESPACE)
    assert chart_defaults.operator_env() == want
    assert render_env() == want
    assert want["TANDEM_WORKER_CUDA_IMAGE"].endswith("-cu128")
    assert want["TANDEM_OPERATOR_RELEASE"] == "tandem"


def test_a_custom_install_gives_the_operator_what_render_assumes(
        helm: Helm, tmp_path: Path) -> None:  # noqa: F811
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(CUSTOM))
    want = chart_env(helm, "prod", "ml-ops", values)
    assert want["TANDEM_REDIS_ADDRESS"] == "llm-redis.ml-ops.svc:6380"
    assert want["TANDEM_ALLOWED_SECRETS"] == "hf-*"  # operator.env last, as in the pod
    assert want["TANDEM_WORKER_CUDA_IMAGE"] == "registry.example/ml/tandem:2.0-cu126"
    got = render_env("--values", str(values), "--release", "prod",
                     "--operator-namespace", "ml-ops")
    got.pop("TANDEM_ALLOWED_SECRETS")  # two entries in the pod: the later wins
    want.pop("TANDEM_ALLOWED_SECRETS")
    assert got == want
    # a second values file is merged over the first, as `helm -f a -f b`
    more = tmp_path / "more.yaml"
    more.write_text("workerImage: {cudaDigest: 'sha256:" + "d" * 64 + "'}\n"
                    "redis: {enabled: false}\n")
    again = render_env("--values", str(values), "--values", str(more))
    assert again["TANDEM_WORKER_CUDA_IMAGE"] == "registry.example/ml/tandem@sha256:" + "d" * 64
    assert "TANDEM_REDIS_ADDRESS" not in again


def test_set_gives_the_operator_what_helm_install_set_gives_it(
        helm: Helm, tmp_path: Path) -> None:  # noqa: F811
    """`--set` as `helm install --set`, after the values files: each case's operator
    environment is the real chart's."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(CUSTOM))
    cases: list[tuple[Path | None, tuple[str, ...]]] = [
        (None, ("redis.enabled=true,redis.port=6380",
                "security.allowedRegistries={registry.example.com,ghcr.io/team}",
                "watchNamespaces={team-a}", "image.pullPolicy=Always",
                "workerImage.cudaTag=2.0-cu126", "security.allowHostPath=true")),
        (None, ("fullnameOverride=llm", "security.allowedRuntimeClasses={kata}",
                "security.allowedSecrets={hf-*,team-?}", "redis.enabled=TRUE")),
        (values, ("redis.enabled=false", "watchNamespaces={team-z}", "controlImage.digest=",
                  "image.tag=3.0")),
    ]
    for file, sets in cases:
        argv = [a for s in sets for a in ("--set", s)]
        if file is not None:
            argv += ["--values", str(file)]
        got = render_env(*argv)
        want = chart_env(helm, chart_defaults.RELEASE, chart_defaults.NAMESPACE, file, sets)
        if file is not None:  # operator.env's second TANDEM_ALLOWED_SECRETS: the later wins
            got.pop("TANDEM_ALLOWED_SECRETS")
            want.pop("TANDEM_ALLOWED_SECRETS")
        assert got == want, sets


def test_render_with_no_flags_renders_the_default_installs_children() -> None:
    """No TANDEM_* variable, no flag: GPU pools get the CUDA worker image (the CPU one
    exits on a GPU node), routers the control image and the release label, and the objects
    are exactly `render_all` for the chart's operator."""
    example = next(p for p in EXAMPLES if p.stem == "gpu-pools")
    proc = tandem_render("-f", str(example), "-n", "ml", "--uid", UID,
                         env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in documents(proc.stdout) if d["kind"] != "Secret"]
    source = yaml.safe_load(example.read_text())
    env = chart_defaults.operator_env()
    config = config_from(build_parser().parse_args(["render", "-f", "-"]), env)
    assert docs == render_all(parse_spec(source["spec"]), Owner(source["metadata"]["name"], "ml",
                                                                  UID),
                              image=config.image, image_pull_policy="IfNotPresent",
                              router_image=config.router_image,
                              worker_image=config.worker_image,
                              worker_cuda_image=config.worker_cuda_image,
                              operator=config.operator,
                              image_pull_secrets=config.image_pull_secrets)
    images = {c["image"] for d in docs if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert env["TANDEM_WORKER_CUDA_IMAGE"] in images
    assert env["TANDEM_ROUTER_IMAGE"] in images
    routers = [d for d in docs if d["kind"] == "Deployment"
               and d["metadata"]["name"].endswith("-router")]
    assert routers and all(
        r["spec"]["template"]["metadata"]["labels"]["tandem.dev/operator-release"] == "tandem"
        for r in routers)
    assert "tandem-system" in proc.stdout  # the operator's namespace, a NetworkPolicy peer


def test_release_namespace_and_values_flags(tmp_path: Path) -> None:
    example = next(p for p in EXAMPLES if p.stem == "gpu-pools")
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"workerImage": {"cudaTag": "9.9-cu126"}}))
    code, out, err = render_cli(yaml.safe_load(example.read_text()), "--values", str(values),
                                "--release", "prod", "--operator-namespace", "ops")
    assert code == 0, err
    images = {c["image"] for d in documents(out) if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert "ghcr.io/tandem-llm/tandem:9.9-cu126" in images
    assert "tandem.dev/operator-release: prod" in out
    assert "kubernetes.io/metadata.name: ops" in out
    assert "tandem-system" not in out


@pytest.mark.parametrize("text, complaint", [
    ("image: [oops", "not valid YAML"),
    ("- a list", "a mapping is expected"),
    ("redis: {enabled: 'yes'}", 'redis.enabled: Invalid value: "yes"'),
    (None, "cannot read --values"),
])
def test_a_values_file_it_cannot_read_exits_2(tmp_path: Path, text: str | None,
                                             complaint: str) -> None:
    values = tmp_path / "values.yaml"
    if text is not None:
        values.write_text(text)
    code, out, err = render_cli(yaml.safe_load(EXAMPLES[0].read_text()), "--values",
                                str(values))
    assert (code, out) == (2, "") and complaint in err, err
