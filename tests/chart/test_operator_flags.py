"""The operator's command line as the chart renders it parses with the real `tandem
operator` parser, for the default values, every ci/*-values.yaml and every flag values.yaml
suggests for `operator.extraArgs` (a flag it does not know would crash-loop the operator);
`operator.logLevel` sets `tandem --log-level` and the schema refuses an unknown level."""

from __future__ import annotations

import argparse
import logging
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tandem.operator.cli import add_operator_args
from tests.chart.conftest import CHART, CI_VALUES, Helm
from tests.chart.test_chart import operator_container

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def operator_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem operator", exit_on_error=False)
    add_operator_args(p)
    return p


def parses(args: list[str]) -> argparse.Namespace:
    """`args` as `tandem operator` reads them; an unknown flag or a bad value fails the test
    with argparse's own message."""
    p = operator_parser()
    try:
        ns, extra = p.parse_known_args(args)
    except argparse.ArgumentError as exc:
        pytest.fail(f"tandem operator {shlex.join(args)}: {exc}")
    if extra:
        pytest.fail(f"tandem operator {shlex.join(args)}: unrecognized arguments: "
                    f"{' '.join(extra)}")
    return ns


def suggested_extra_args() -> list[str]:
    """Every flag values.yaml names in the comment above `extraArgs` and in the ci values'
    extraArgs lists."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.strip().startswith("extraArgs:")]
    comment = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        comment.append(line)
    flags = [f for f in re.findall(r"--[a-z][-a-z]*(?:=[^\s\"',\]]+)?", "\n".join(comment))
             if f != "--help"]
    for path in CI_VALUES:
        flags += (yaml.safe_load(path.read_text()).get("operator") or {}).get("extraArgs", [])
    return flags


def test_the_extra_args_values_yaml_suggests_are_operator_flags() -> None:
    flags = suggested_extra_args()
    assert flags, "values.yaml shows no example for operator.extraArgs"
    for flag in flags:
        parses(["--all-namespaces", flag])


def test_the_checker_refuses_a_flag_the_operator_lacks() -> None:
    with pytest.raises(pytest.fail.Exception, match="--verbose"):
        parses(["--all-namespaces", "--verbose"])


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "default")
def test_the_rendered_operator_command_parses(helm: Helm, values: Path | None) -> None:
    c = operator_container(helm.render(values=(values,) if values else ()))
    assert c["command"][:2] == ["tandem", "--log-level"] and c["command"][3] == "operator"
    assert isinstance(logging.getLevelName(c["command"][2]), int)  # a level logging knows
    parses(c["args"])


def test_log_level_comes_from_values(helm: Helm) -> None:
    assert operator_container(helm.render())["command"] == [
        "tandem", "--log-level", "INFO", "operator"]
    for level in LEVELS:
        c = operator_container(helm.render(sets=(f"operator.logLevel={level}",)))
        assert c["command"] == ["tandem", "--log-level", level, "operator"]
    proc = helm.run(*helm.template_args(sets=("operator.logLevel=verbose",)), check=False)
    assert proc.returncode != 0 and "logLevel" in proc.stderr, proc.stderr
