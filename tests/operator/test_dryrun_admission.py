"""`tandem render` refuses what the chart's operator refuses before it applies: the
installation's admission (`reconcile.check_environment`: Redis for `router.managedRedis`, the
chart's `security.*` policy, its watched namespaces), with the operator's own InvalidSpec
message and exit 1; the chart's values come from `--values` and `--set` (helm's syntax,
merged after the files as helm merges them; the parser against the real helm:
test_dryrun_set.py); a bad `--set` is a usage error (exit 2)."""

from __future__ import annotations

import contextlib
import copy
import io
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tandem.cli import build_parser
from tandem.operator import chart_defaults
from tandem.operator.cli import config_from
from tandem.operator.dryrun import UsageError, render, run
from tandem.operator.spec import SpecError
from tests.operator.test_dryrun import EXAMPLES, ROOT, documents, tandem_render
from tests.operator.test_dryrun_schema import example, render_cli

DISAGGREGATED = ROOT / "charts" / "tandem" / "examples" / "disaggregated.yaml"
NO_REDIS = ("router.managedRedis: this operator has no Redis (install the chart with "
            "redis.enabled=true), or name your own in router.redisUrlSecretRef")


def operators_refusal(doc: dict[str, Any], namespace: str, *sets: str) -> str:
    """The message of the InvalidSpec condition the chart's operator (installed with `sets`)
    writes for `doc`: its own change handler's checks (`main._admitted`)."""
    from tandem.operator import main

    env = chart_defaults.operator_env(chart_defaults.load_values([], sets))
    config = config_from(build_parser().parse_args(["render", "-f", "-"]), env)
    body = {**doc, "metadata": {**doc["metadata"], "namespace": namespace, "uid": "u"}}
    with pytest.raises(SpecError) as refused:
        main._admitted(body, SimpleNamespace(config=config))
    return str(refused.value)


def test_managed_redis_without_the_charts_redis_is_refused_as_the_operator_refuses_it() -> None:
    """The chart's default `redis.enabled: false`: the example's routers would have no Redis;
    the operator refuses the spec (InvalidSpec) and so does render, in its words, exit 1."""
    proc = tandem_render("-f", str(DISAGGREGATED), env={"PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"tandem render: {DISAGGREGATED}: InferenceService \"qwen-pd\": "
                           f"InvalidSpec: {NO_REDIS}\n")
    assert operators_refusal(yaml.safe_load(DISAGGREGATED.read_text()), "default") == NO_REDIS


def test_managed_redis_renders_with_the_charts_redis_from_set_or_values(tmp_path: Path) -> None:
    doc = example(DISAGGREGATED)
    on = render_cli(doc, "--set", "redis.enabled=true")
    values = tmp_path / "redis.yaml"
    values.write_text("redis:\n  enabled: true\n")
    assert on[0] == 0, on[2]
    assert render_cli(doc, "--values", str(values)) == on
    secrets = [d["metadata"]["name"] for d in documents(on[1]) if d["kind"] == "Secret"]
    assert secrets == ["qwen-pd-worker-auth", "qwen-pd-redis"]
    # --set comes after every --values file, as in helm; a later --set wins
    assert render_cli(doc, "--values", str(values), "--set", "redis.enabled=false")[0] == 1
    assert render_cli(doc, "--set", "redis.enabled=false", "--set", "redis.enabled=true") == on
    # a URL Secret of the user's own needs no chart Redis
    own = copy.deepcopy(doc)
    own["spec"]["router"].pop("managedRedis")
    own["spec"]["router"]["redisUrlSecretRef"] = {"name": "my-redis", "key": "url"}
    assert render_cli(own)[0] == 0


@pytest.mark.parametrize("image, refused", [
    ("docker.io/someone/tandem:1.0", True),
    ("tandem:1.0", True),  # docker.io/library/tandem
    ("registry.example.com/ml/tandem:1.0", False),
])
def test_an_image_outside_the_allowed_registries_is_refused(image: str, refused: bool) -> None:
    doc = example()
    doc["spec"]["image"] = image
    allow = ("--set", "security.allowedRegistries={registry.example.com}")
    code, out, err = render_cli(doc, *allow)
    if not refused:
        assert (code, err) == (0, "") and f"image: {image}" in out
        return
    message = (f"spec.image: {image!r} is not from an allowed registry "
               "(registry.example.com)")
    assert (code, out) == (1, "")
    assert err == f'tandem render: stdin: InferenceService "smollm2": InvalidSpec: {message}\n'
    assert operators_refusal(doc, "default", allow[1]) == message
    assert render_cli(doc)[0] == 0  # the chart's default: any registry


def test_the_charts_security_values_reach_the_admission() -> None:
    doc = example()
    doc["spec"]["decode"]["runtimeClassName"] = "kata"
    code, _, err = render_cli(doc)
    assert code == 1 and err.endswith(
        "InvalidSpec: decode.runtimeClassName: 'kata' is not allowed (the chart's "
        "security.allowedRuntimeClasses: nvidia)\n"), err
    assert render_cli(doc, "--set", "security.allowedRuntimeClasses={nvidia,kata}")[0] == 0
    # the watched namespaces (or security.allowedNamespaces) are the only ones it deploys to
    plain = example()
    for flags in (["--set", "watchNamespaces={team-a}"],
                  ["--set", "security.allowedNamespaces={team-a,team-c}"]):
        code, _, err = render_cli(plain, "-n", "team-b", *flags)
        assert code == 1 and "InvalidSpec: metadata.namespace: this operator may not deploy " \
            "into 'team-b' (allowed: team-a" in err, err
        assert render_cli(plain, "-n", "team-a", *flags)[0] == 0


def test_every_example_renders_with_the_values_its_comments_name() -> None:
    """Each shipped example renders with the chart's defaults, but the one whose comment
    installs the chart with --set redis.enabled=true, which renders with exactly that."""
    for path in EXAMPLES:
        doc = example(path)
        code, _, err = render_cli(doc)
        if "--set redis.enabled=true" in path.read_text():
            assert code == 1 and NO_REDIS in err, path.name
            code, _, err = render_cli(doc, "--set", "redis.enabled=true")
        assert code == 0, (path.name, err)


@pytest.mark.parametrize("flag, message", [
    ("redis.enabled", "'redis.enabled': key 'redis.enabled' has no value"),
    ("redis.enabled=yes", 'redis.enabled: Invalid value: "yes": redis.enabled in body must '
     'be of type boolean: "string"'),
    ("redis.enabled=true,redis.port=70000", "redis.port: Invalid value: 70000: redis.port in "
     "body should be less than or equal to 65535"),
    ("security.allowedRegistries[0]=registry.example.com",
     "list indexes (allowedRegistries[...]) are not supported: give a list whole ({a,b}) or "
     "use --values"),
    ("security.allowedRegistries={a", "list must terminate with '}'"),
])
def test_a_bad_set_is_a_usage_error(flag: str, message: str) -> None:
    code, out, err = render_cli(example(), "--set", flag)
    assert (code, out) == (2, "")
    assert err.startswith("tandem render: stdin: the chart's values (--values, --set): ")
    assert err.endswith(f"{message}\n"), err


def test_a_bad_set_exits_2_from_the_command() -> None:
    proc = tandem_render("-f", str(EXAMPLES[0]), "--set", "redis.port=6379,=1",
                         env={"PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.endswith("'redis.port=6379,=1': an empty key\n"), proc.stderr


def test_an_environment_the_operator_would_not_start_with_is_a_usage_error() -> None:
    args = build_parser().parse_args(["render", "-f", "-"])
    with pytest.raises(UsageError, match=r"^TANDEM_REDIS_ADDRESS: 'nowhere' is not HOST:PORT$"):
        render(args, DISAGGREGATED.read_text(), {"TANDEM_REDIS_ADDRESS": "nowhere",
                                                 "TANDEM_REDIS_ADMIN_PASSWORD_FILE": "/p"})


def documented_render_commands() -> list[str]:
    """`tandem render` command lines of `tandem render --help`'s examples and of the code
    blocks of README.md and docs/ (before a pipe or a comment)."""
    from tandem.cli import EXAMPLES as HELP_EXAMPLES

    lines = HELP_EXAMPLES["render"].splitlines()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", page.read_text(),
                                re.S):
            lines += block.splitlines()
    out = []
    for line in lines:
        line = line.strip().removeprefix("$ ").split(" #")[0].split(" | ")[0].strip()
        if line.startswith("tandem render "):
            out.append(line)
    return sorted(set(out))


@pytest.mark.parametrize("command", documented_render_commands())
def test_every_documented_render_command_renders(command: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    args = build_parser().parse_args(shlex.split(command)[1:])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(args, stdout=io.StringIO())
    assert code == 0, (command, err.getvalue())
