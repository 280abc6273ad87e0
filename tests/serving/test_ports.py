"""Ports handed to child processes: outside the kernel's ephemeral range, never twice."""

from __future__ import annotations

import socket
from pathlib import Path

from tandem.serving.ports import free_port


def test_ports_are_bindable_distinct_and_outside_the_ephemeral_range():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert not low <= port <= high, port
        assert port > 1024
    with socket.socket() as s:  # and a child can bind it
        s.bind(("127.0.0.1", ports[-1]))

