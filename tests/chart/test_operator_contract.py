"""What the chart's operator Deployment asks of `tandem operator`: the entry point exists and
accepts every flag the chart passes (kopf's: --standalone, --all-namespaces or --namespace,
--liveness), and the operator reads TANDEM_IMAGE, the image the chart sets as its default for
the workers and routers it deploys."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.chart.conftest import ROOT, Helm, one

TANDEM = Path(sys.executable).with_name("tandem")


def chart_flags(helm: Helm) -> set[str]:
    flags = set()
    for sets in ((), ("watchNamespaces={team-a}",)):
        dep = one(helm.render(sets=sets), "Deployment", "tandem-operator")
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["tandem", "--log-level", "INFO", "operator"]
        flags.update(a.split("=", 1)[0] for a in container["args"])
    return flags


def test_tandem_operator_accepts_the_charts_flags(helm: Helm) -> None:
    flags = chart_flags(helm)
    assert flags == {"--standalone", "--all-namespaces", "--namespace", "--liveness",
                     "--leader-elect", "--lease-name", "--lease-duration", "--renew-deadline",
                     "--retry-period"}
    # the chart's command line, as the container runs it
    proc = subprocess.run([str(TANDEM), "--log-level", "INFO", "operator", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"`tandem operator --help` failed:\n{proc.stderr[-2000:]}"
    offered = set(re.findall(r"--[a-z][-a-z]*", proc.stdout))
    assert flags <= offered, f"`tandem operator` lacks {sorted(flags - offered)}"


def test_operator_reads_the_image_the_chart_sets() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "tandem" / "operator").rglob("*.py"))
    assert "TANDEM_IMAGE" in source, "the chart sets TANDEM_IMAGE; the operator ignores it"
