"""The router's CPU per worker readiness probe: httpx against the router's own upstream pool.

    .venv/bin/python bench/probe_cost.py [--probes 2000] [--rounds 3] [--out PATH]

A stub worker (`bench/stub_worker.py --http raw`, its own process) answers `GET /ready`; in
this process, on uvloop, one keep-alive `httpx.AsyncClient` (what the router probed with
before) and one `tandem.router.probe.UpstreamProbe` (what it probes with now) take turns,
`--probes` sequential probes per turn, each answer's JSON parsed as the monitor does. Reports
this process's CPU time (user + system) per probe for each client, per round and the median;
the router pays it `1 / probe_interval_s` times a second per worker (1 s by default). Raw JSON
under `bench/results/probe_cost-<date>.json` (machine and load average included).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvloop

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from servers import free_port, stop_group  # noqa: E402
from tandem.router.probe import UpstreamProbe  # noqa: E402
from tandem.router.upstream import UpstreamPool  # noqa: E402


async def measure(url: str, probes: int, rounds: int) -> dict[str, list[float]]:
    """CPU seconds per probe for each client, one entry per round."""
    clients = {"httpx": httpx.AsyncClient(), "upstream": UpstreamProbe(UpstreamPool())}
    out: dict[str, list[float]] = {name: [] for name in clients}
    deadline = time.monotonic() + 30
    while True:  # the stub is up
        try:
            await clients["httpx"].get(url, timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    for _ in range(rounds):
        for name, client in clients.items():
            for _ in range(50):  # warm: connection open, caches filled
                await client.get(url, timeout=2)
            t = time.process_time()
            for _ in range(probes):
                (await client.get(url, timeout=2)).json()
            out[name].append((time.process_time() - t) / probes)
    await clients["httpx"].aclose()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    port, grpc_port = free_port(), free_port()
    stub = subprocess.Popen([sys.executable, str(BENCH_DIR / "stub_worker.py"), "--port",
                             str(port), "--grpc-port", str(grpc_port), "--random-blocks", "10",
                             "--http", "raw"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    load_start = os.getloadavg()
    try:
        per_probe = uvloop.run(measure(f"http://127.0.0.1:{port}/ready", args.probes,
                                       args.rounds))
    finally:
        stop_group(stub, 5)
    median = {name: statistics.median(v) for name, v in per_probe.items()}
    for name, v in per_probe.items():
        print(f"{name:9s} CPU per probe: median {median[name] * 1e6:.0f} us "
              f"(rounds: {', '.join(f'{x * 1e6:.0f}' for x in v)})")
    date = datetime.datetime.now(datetime.UTC)
    result = {"benchmark": "probe_cost", "date": date.isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
              "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
              "probes_per_round": args.probes, "rounds": args.rounds,
              "cpu_s_per_probe": per_probe, "median_cpu_s_per_probe": median}
    out = Path(args.out or BENCH_DIR / "results" / f"probe_cost-{date:%Y-%m-%d}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
