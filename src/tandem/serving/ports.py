"""Free TCP ports for processes this one starts (`tandem serve`, tests, benchmarks).

A port the kernel hands out for `bind(0)` lies in the ephemeral range, which the
kernel also uses for every outgoing connection's source port and every other
`bind(0)`. Between the moment such a port is picked and the moment the child
binds it, any connection on the host can take it, and the child dies with
EADDRINUSE. So ports are chosen outside the ephemeral range (port-for reads the
host's range), and never the same one twice from this process.
"""

from __future__ import annotations

import threading

import port_for

_lock = threading.Lock()
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on `host` (nor on 0.0.0.0) listens on or binds, outside the
    kernel's ephemeral range, not returned before by this process."""
    with _lock:
        while True:
            port = port_for.select_random(exclude_ports=_handed_out)
            _handed_out.add(port)
            if host in ("127.0.0.1", "0.0.0.0", "") or not port_for.port_is_used(port, host):
                return port
