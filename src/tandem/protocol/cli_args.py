"""Command-line values every `tandem` command shares (torch-free: the router imports it).

- `port_number`: the argparse type of every port flag; a port outside 1-65535 is a usage
  error (exit 2), never a random port or a server that waits forever.
- `busy_ports`: before anything loads, the ports a command will listen on that something
  else already holds; the command then exits 1 with `busy_message` (one line, naming the
  flag and the port), not a bind traceback after the model has loaded.
- `default_served_name`: the served model name when `--served-model-name` is not given (the
  engine, the router's tokenizer map and the operator must agree: block hashes are rooted
  in it).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePath

MIN_PORT, MAX_PORT = 1, 65535


def port_number(text: str) -> int:
    """argparse type: an integer port in 1-65535 (0, a negative or a larger one refused)."""
    try:
        value = int(text, 10)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not MIN_PORT <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{value} is not a port in {MIN_PORT}-{MAX_PORT}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text, 10)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1, not {text!r}")
    return value


def _seconds(text: str, *, zero_ok: bool) -> float:
    """argparse type: a finite number of seconds, > 0 (or >= 0 with `zero_ok`)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise argparse.ArgumentTypeError(
            f"a number of seconds {'>=' if zero_ok else '>'} 0, not {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    return _seconds(text, zero_ok=False)


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    return _seconds(text, zero_ok=True)


@dataclass(frozen=True)
class BusyPort:
    """A port a command was asked to listen on that it cannot bind."""

    flag: str  # e.g. "--port"
    host: str
    port: int
    reason: str  # "is already in use", "needs privileges", ...


def _bind_error(host: str, port: int) -> OSError | None:
    """Bind `host:port` as a server would (SO_REUSEADDR, as uvicorn and the lean server set
    it: a port left in TIME_WAIT is free) and let it go; the error, or None."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return exc
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            return exc
    return None


def busy_ports(host: str, ports: Iterable[tuple[str, int | None]]) -> list[BusyPort]:
    """Of `(flag, port)` pairs (None: not listened on), those `host` cannot bind now, or
    that an earlier flag names too."""
    busy: list[BusyPort] = []
    seen: dict[int, str] = {}
    for flag, port in ports:
        if port is None:
            continue
        if port in seen:
            busy.append(BusyPort(flag, host, port, f"is {seen[port]} too"))
            continue
        seen[port] = flag
        exc = _bind_error(host, port)
        if exc is None:
            continue
        if exc.errno == errno.EADDRINUSE:
            reason = "is already in use"
        elif exc.errno == errno.EACCES:
            reason = "needs privileges this process lacks"
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = f"cannot be bound: {host!r} is not an address of this machine"
        else:
            reason = f"cannot be bound ({exc.strerror or exc})"
        busy.append(BusyPort(flag, host, port, reason))
    return busy


def busy_message(prog: str, busy: list[BusyPort]) -> str:
    """One line per port: `tandem worker: error: --port 8000 is already in use on
    127.0.0.1`."""
    return "\n".join(f"{prog}: error: {b.flag} {b.port} {b.reason} on {b.host or '*'}"
                     for b in busy)


def default_served_name(model: str | None, bundled_name: str) -> str:
    """The served name of `model` when none is given, as vLLM (the `--model` argument as
    given) but without a local directory's parents: a path (absolute, relative from `.` or
    `~`, or one that exists here) is served under its last component, a `.gguf` file
    without the extension (`/models/Qwen2.5-7B-Instruct` -> `Qwen2.5-7B-Instruct`,
    `/m/Llama-3.1-8B-Instruct.Q4_K_M.gguf` -> `Llama-3.1-8B-Instruct.Q4_K_M`); a hub-style
    id (`org/name`) in full; None (the bundled model) -> `bundled_name`."""
    if model is None:
        return bundled_name
    text = model.rstrip("/") or model
    is_path = (text.startswith(("/", ".", "~")) or text.endswith(".gguf")
               or os.path.exists(text))
    if not is_path:
        return text
    name = PurePath(text).name or text
    return name.removesuffix(".gguf") or name
