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
