"""The router's container stays small: it imports no torch and nothing of the engine."""

from __future__ import annotations

import subprocess
import sys


def test_router_imports_no_torch_and_no_engine():
    code = (
        "import sys\n"
        "import tandem.router.app, tandem.router.main, tandem.router.core\n"
        "import tandem.router.monitor, tandem.router.proxy, tandem.router.extproc.server\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
        "       or m.startswith('tandem.engine') or m.startswith('tandem.serving')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
