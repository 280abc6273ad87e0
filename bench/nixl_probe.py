"""Does NIXL (the `nixl` package: the transfer library of llm-d and Dynamo) move host memory
between two processes here, and how fast? Run it with a Python that has `nixl` installed (a
scratch venv: the package pulls its own CUDA build of torch, not the project's):

    python -m venv /tmp/nixl && /tmp/nixl/bin/pip install nixl
    /tmp/nixl/bin/python bench/nixl_probe.py [--mib 180] [--reps 4]

Two processes, each a NIXL agent with the UCX backend over registered DRAM (torch uint8
tensors); the initiator WRITEs the whole buffer into the target's, `--reps` times (metadata
and descriptors exchanged through files in a temporary directory); the target checks every
byte. Writes `bench/results/nixl-probe-<date>.json` with each write's seconds and GB/s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def agent(role: str, nbytes: int, reps: int, d: Path) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    buf = torch.full((nbytes,), 1 if role == "initiator" else 0, dtype=torch.uint8)
    a.register_memory(buf)
    descs = a.get_xfer_descs(buf)
    if role == "target":
        (d / "meta.tmp").write_bytes(a.get_agent_metadata())
        (d / "descs").write_bytes(a.get_serialized_descs(descs))
        os.rename(d / "meta.tmp", d / "meta")
        deadline = time.monotonic() + 120
        while not a.check_remote_xfer_done("initiator", b"done"):
            if time.monotonic() > deadline:
                raise TimeoutError("no transfer arrived")
            time.sleep(0.001)
        print(json.dumps({"target_bytes_ok": bool((buf == 1).all())}), flush=True)
        return
    while not (d / "meta").exists():
        time.sleep(0.01)
    remote = a.add_remote_agent((d / "meta").read_bytes())
    rdescs = a.deserialize_descs((d / "descs").read_bytes())
    rows = []
    for i in range(reps):
        h = a.initialize_xfer("WRITE", descs, rdescs, remote,
                              b"done" if i == reps - 1 else b"next")
        t0 = time.perf_counter()
        state = a.transfer(h)
        while state not in ("DONE", "ERR"):
            state = a.check_xfer_state(h)
        s = time.perf_counter() - t0
        rows.append({"state": state, "seconds": s, "gbps": nbytes / s / 1e9,
                     "backend": a.query_xfer_backend(h)})
        a.release_xfer_handle(h)
    print(json.dumps({"writes": rows}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=180)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    nbytes = args.mib << 20
    if args.role:
        agent(args.role, nbytes, args.reps, Path(args.dir))
        return 0
    with tempfile.TemporaryDirectory() as d:
        argv = [sys.executable, __file__, "--mib", str(args.mib), "--reps", str(args.reps),
                "--dir", d, "--role"]
        target = subprocess.Popen([*argv, "target"], stdout=subprocess.PIPE, text=True)
        init = subprocess.run([*argv, "initiator"], capture_output=True, text=True,
                              timeout=300)
        out, _ = target.communicate(timeout=300)
    if init.returncode or target.returncode:
        print(init.stderr[-4000:], file=sys.stderr)
        return 1
    report = {"benchmark": "nixl_probe", "date": dt.date.today().isoformat(),
              "bytes": nbytes, "memory": "DRAM", "backend": "UCX",
              "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
              "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
              **json.loads(init.stdout.strip().splitlines()[-1]),
              **json.loads(out.strip().splitlines()[-1])}
    import importlib.metadata as md

    report["nixl_version"] = md.version("nixl")
    path = Path(args.out) if args.out else BENCH_DIR / "results" / (
        f"nixl-probe-{report['date']}.json")
    path.write_text(json.dumps(report, indent=1))
    for r in report["writes"]:
        print(f"{r['state']} {nbytes / 2**20:.0f} MiB in {r['seconds'] * 1e3:.1f} ms: "
              f"{r['gbps']:.2f} GB/s ({r['backend']})")
    print(f"target saw every byte: {report['target_bytes_ok']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
