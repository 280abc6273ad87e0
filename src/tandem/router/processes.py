"""`tandem router --processes N`: N router processes behind one port.

One Python process routes ~1,000 requests/s on one core (about 1 ms of CPU each: parse,
chat template, tokenize, hash, pick, proxy). With N > 1 the command becomes a supervisor
that starts N copies of itself (`CHILD_ENV` set, each binding the port with SO_REUSEPORT, so
the kernel spreads connections over them) and waits:

* each child is a full router: it watches discovery, subscribes to every worker's KV events
  and keeps its own index, as active-active replicas do (they converge to the same index);
* metrics are summed over the children (prometheus_client's multiprocess files, in a
  directory the supervisor creates and removes), so any child answers /metrics for all;
* SIGTERM/SIGINT go to every child (each drains its in-flight requests); a child that exits
  on its own takes the others down and the supervisor exits non-zero, so the pod restarts
  rather than serving at reduced capacity unnoticed.

Per-tenant rate limits need `--redis` to hold exactly across children; in memory each child
enforces the limits on the connections it holds.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger(__name__)
CHILD_ENV = "TANDEM_ROUTER_CHILD"  # set in a child: its index


def is_child() -> bool:
    return CHILD_ENV in os.environ


def supervise(n: int, argv: list[str], grace_s: float = 15.0) -> int:
    """Run `python -m tandem.cli *argv` N times until a signal or a child's exit."""
    metrics_dir = tempfile.mkdtemp(prefix="tandem-router-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    children = [subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv],
                                 env={**env, CHILD_ENV: str(i)}) for i in range(n)]
    logger.info("router supervisor: %d processes (pids %s)", n,
                ", ".join(str(c.pid) for c in children))
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    code = 0
    try:
        while not stopping:
            exited = [c for c in children if c.poll() is not None]
            if exited:
                code = exited[0].returncode or 1
                logger.error("router process %d exited with %s; stopping the others",
                             exited[0].pid, exited[0].returncode)
                break
            time.sleep(0.2)
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in children:
            try:
                c.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code
