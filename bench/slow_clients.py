"""What a client that stops reading costs a worker and a router: resident memory and running
requests over time, for one or more source trees side by side in one run.

    .venv/bin/python bench/slow_clients.py [--compare OLD_SRC] [--clients 4] [--stall-s 30]

Worker probe: a `tandem worker` on the bundled model (`--request-timeout`, default 15 s)
gets `--clients` streaming completions (`n=4`, `--logprobs` (20), `ignore_eos`, a large
`max_tokens`) from sockets with a 4 KiB receive buffer that never read; the probe samples
the worker's RSS and `vllm:num_requests_running` every second for `--stall-s`, then closes
the sockets and samples for 5 s more. Router probe: a `tandem router` in front of that worker
gets `GET /metrics` pipelined for `--pipeline-s` from a client that never reads; the probe
samples the router's RSS, then closes and samples again. Each tree (this one, and
`--compare SRC`, e.g. a `git worktree` of an older commit's `src`) runs in its own
processes, one after the other; the JSON goes to `bench/results/slow_clients-<date>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from servers import LOG_DIR, free_port, stop_group  # noqa: E402

RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", re.M)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(src: str, argv: list[str], port: int, ready: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "--log-level", "WARNING",
                             *argv, "--port", str(port)], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{argv[0]} exited {proc.returncode}: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready}", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{argv[0]} did not start: see {log}")


def running(port: int) -> float:
    try:
        m = RUNNING.search(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
        return float(m[1]) if m else float("nan")
    except httpx.HTTPError:
        return float("nan")


def stalled_socket(port: int, request: bytes) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def worker_probe(port: int, pid: int, clients: int, stall_s: float, logprobs: int) -> dict:
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Write a very long story about a lighthouse.",
                       "n": 4, "max_tokens": 4000, "logprobs": logprobs, "ignore_eos": True,
                       "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
               f"\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    samples = [{"t": 0.0, "rss_mib": rss_mib(pid), "running": running(port)}]
    socks = [stalled_socket(port, request) for _ in range(clients)]
    t0 = time.monotonic()
    while (t := time.monotonic() - t0) < stall_s:
        time.sleep(1.0)
        samples.append({"t": round(t, 1), "rss_mib": rss_mib(pid), "running": running(port)})
    for s in socks:
        s.close()
    closed_at = time.monotonic() - t0
    for _ in range(5):
        time.sleep(1.0)
        samples.append({"t": round(time.monotonic() - t0, 1), "rss_mib": rss_mib(pid),
                        "running": running(port)})
    return {"samples": samples, "closed_at_s": round(closed_at, 1),
            "rss_start_mib": samples[0]["rss_mib"],
            "rss_peak_mib": max(x["rss_mib"] for x in samples),
            "rss_end_mib": samples[-1]["rss_mib"],
            "running_at_close": next(x["running"] for x in samples if x["t"] >= closed_at - 1.5),
            "running_3s_after_close": next(x["running"] for x in samples
                                           if x["t"] >= closed_at + 3)}


def router_probe(port: int, pid: int, pipeline_s: float) -> dict:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    burst = b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n" * 64
    start_rss, sent, peak = rss_mib(pid), 0, 0.0
    t0 = time.monotonic()
    while time.monotonic() - t0 < pipeline_s:
        _, writable, _ = select.select([], [s], [], 0.2)
        if writable:
            with contextlib.suppress(BlockingIOError, ConnectionError):
                sent += s.send(burst)
        peak = max(peak, rss_mib(pid))
    s.close()
    time.sleep(3.0)
    return {"rss_start_mib": start_rss, "rss_peak_mib": peak, "rss_3s_after_close_mib":
            rss_mib(pid), "request_bytes_sent": sent}


def run_tree(name: str, src: str, args: argparse.Namespace, logs: Path) -> dict:
    wport, rport = free_port(), free_port()
    worker = start(src, ["worker", "--request-timeout", str(args.request_timeout)], wport,
                   "/ready", logs / f"slow-{name}-worker.log")
    try:
        w = worker_probe(wport, worker.pid, args.clients, args.stall_s, args.logprobs)
        print(f"[{name}] worker RSS {w['rss_start_mib']:.0f} -> peak {w['rss_peak_mib']:.0f} "
              f"-> {w['rss_end_mib']:.0f} MiB; running at close {w['running_at_close']:.0f}, "
              f"3 s after {w['running_3s_after_close']:.0f}", flush=True)
        router = start(src, ["router", "--workers", f"http://127.0.0.1:{wport}"], rport,
                       "/health", logs / f"slow-{name}-router.log")
        try:
            r = router_probe(rport, router.pid, args.pipeline_s)
        finally:
            stop_group(router, 30)
        print(f"[{name}] router RSS {r['rss_start_mib']:.0f} -> peak {r['rss_peak_mib']:.0f} "
              f"-> {r['rss_3s_after_close_mib']:.0f} MiB after close "
              f"({r['request_bytes_sent'] / 2**20:.1f} MiB of requests sent)", flush=True)
    finally:
        stop_group(worker, 30)
    return {"src": src, "worker": w, "router": r}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", default=None, metavar="SRC",
                    help="another tree's src directory, run after this one")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--stall-s", type=float, default=60.0)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--pipeline-s", type=float, default=20.0)
    ap.add_argument("--request-timeout", type=float, default=15.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    trees = {"this": str(REPO / "src")}
    if args.compare:
        trees["compare"] = args.compare
    results = {name: run_tree(name, src, args, LOG_DIR) for name, src in trees.items()}
    if "compare" in results:
        for part, key in (("worker", "rss_peak_mib"), ("router", "rss_peak_mib")):
            grow = {n: r[part][key] - r[part]["rss_start_mib"] for n, r in results.items()}
            print(f"{part} RSS growth: this {grow['this']:.0f} MiB, compare "
                  f"{grow['compare']:.0f} MiB")
    day = datetime.date.today().isoformat()
    out = Path(args.out or REPO / "bench" / "results" / f"slow_clients-{day}.json")
    out.write_text(json.dumps({"date": day, "machine": platform.processor() or platform.machine(),
                               "cores": os.cpu_count(), "args": vars(args),
                               "results": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
