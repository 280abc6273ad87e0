"""The operator's image stays small: it imports neither torch nor the engine (nor the worker
server or the KV transfer code, which need torch)."""

from __future__ import annotations

import subprocess
import sys


def test_operator_imports_no_torch_and_no_engine():
    code = (
        "import sys\n"
        "import tandem.operator, tandem.operator.spec, tandem.operator.render\n"
        "from tandem.operator.spec import parse_spec\n"
        "from tandem.operator.render import Owner, render_all\n"
        "render_all(parse_spec({'model': {'uri': 'pvc://m/x.gguf'}, 'prefill': {'replicas': 1},"
        " 'monitoring': {'serviceMonitor': True}}), Owner('a', 'ns', 'uid'))\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
        "       or m.startswith(('tandem.engine', 'tandem.serving', 'tandem.kvtransfer',\n"
        "                        'tandem.router'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


BAD = ("bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
       "       or m.startswith(('tandem.engine', 'tandem.serving', 'tandem.kvtransfer',\n"
       "                        'tandem.router'))]\n"
       "assert not bad, bad\n")


def test_the_running_operator_imports_no_torch_and_no_engine():
    """kopf's handlers (`tandem.operator.main`) with everything they call: the Kubernetes
    client glue, metrics scraping, reconcile, status, autoscale; and kopf's settings."""
    code = (
        "import sys\n"
        "from tandem.operator.cli import settings\n"
        "from tandem.operator.main import registry\n"
        "from tandem.operator.reconcile import OperatorConfig\n"
        "import tandem.operator.kube, tandem.operator.metrics, tandem.operator.status\n"
        "import tandem.operator.autoscale\n"
        "registry(OperatorConfig()); settings()\n" + BAD)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tandem_operator_cli_path_imports_no_torch_and_no_engine():
    """`tandem operator ...` through `tandem.cli.main`, which skips the engine's imports
    the other subcommands' arguments need."""
    code = (
        "import contextlib, io, sys\n"
        "from tandem.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        main(['--log-level', 'WARNING', 'operator', '--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "assert '--all-namespaces' in out.getvalue()\n"
        "try:\n"
        "    main(['operator', '--standalone'])\n"
        "except SystemExit as e:\n"
        "    assert 'all-namespaces' in str(e), e\n" + BAD)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tandem_render_imports_no_torch_and_no_engine():
    """`tandem render -f` through `tandem.cli.main`: parse, config and `reconcile.apply`
    against its recorder, no engine."""
    code = (
        "import contextlib, io, sys\n"
        "from tandem.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert main(['render', '-f', 'charts/tandem/examples/aggregated.yaml']) == 0\n"
        "assert 'kind: Deployment' in out.getvalue()\n" + BAD)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
