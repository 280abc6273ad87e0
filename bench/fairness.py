"""Flow-control fairness: two tenants, one sending 10x the other's rate, into a saturated pool.

    .venv/bin/python bench/fairness.py [--quick] [--out PATH]

A pool of stub workers (this file's `--worker` mode: at most `--max-running` requests run at
once for `--service-ms` each, the rest wait in the worker, FIFO; `/ready` and gRPC `GetLoad`
report running and waiting as a Tandem worker does) behind real `tandem router` processes
with API keys (two tenants, `heavy` and `light`). Open-loop Poisson clients: `heavy` at 10x
`light`'s rate, both above their fair share of the pool, so both stay backlogged. Each
configuration runs for `warmup + duration` seconds; the requests the workers completed for
each tenant in the measured window (after the warm-up, counted by the workers themselves)
are its service, and its share of the total is compared with its fairness weight's share
(target: within 10 %):

* `no-flow-control`: one router, flow control off (the baseline: service follows the rates);
* `one-router`: one router, `flow_control: {enabled: true, fairness: least-attained}`;
* `two-replicas`: two routers sharing one fair queue through Redis (`shared: true`), each
  request sent to either at random, as a load balancer would;
* `weighted`: one router, `tenant_weights: {heavy: 2}` (heavy's share should be 2/3).

Writes `bench/results/fairness-<date>.json` (`--quick`: shorter runs,
`fairness-quick-<date>.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from servers import free_port, stop_group  # noqa: E402

MODEL = "stub"
KEYS = {"heavy": "key-heavy", "light": "key-light"}


# -- the stub worker (`--worker`) -------------------------------------------------------------
def serve_worker(port: int, grpc_port: int, max_running: int, service_s: float) -> None:
    import uvicorn
    from fastapi import FastAPI

    from stub_worker import BLOCK_SIZE, StubWorkerService, start_grpc  # bench/
    from tandem.protocol import worker_pb2

    state = {"running": 0, "waiting": 0}
    stop = threading.Event()

    class Service(StubWorkerService):
        def GetLoad(self, request, context):  # noqa: ANN001, ANN201, N802 - gRPC name
            return worker_pb2.Load(worker_id="stub", model=MODEL, role="both",
                                   block_size=BLOCK_SIZE, num_running=state["running"],
                                   num_waiting=state["waiting"])

    grpc_server = start_grpc("127.0.0.1", grpc_port, Service(MODEL, [], stop))
    app = FastAPI()
    slots: asyncio.Semaphore | None = None

    @app.get("/ready")
    async def ready() -> dict:
        return {"status": "ready", "role": "both", "model": MODEL, "grpc_port": grpc_port,
                "block_size": BLOCK_SIZE, "max_model_len": 4096}

    served: dict[str, int] = {}

    @app.post("/reset")
    async def reset() -> dict:
        served.clear()
        return {}

    @app.get("/served")
    async def served_counts() -> dict:
        return dict(served)

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        nonlocal slots
        slots = slots or asyncio.Semaphore(max_running)
        state["waiting"] += 1
        async with slots:
            state["waiting"] -= 1
            state["running"] += 1
            try:
                await asyncio.sleep(service_s)
            finally:
                state["running"] -= 1
        tenant = str(body.get("prompt", "")).split(" ")[0]  # "<tenant> says hello"
        served[tenant] = served.get(tenant, 0) + 1
        return {"id": "c", "object": "text_completion", "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}

    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        stop.set()
        grpc_server.stop(0)


# -- the run ------------------------------------------------------------------------------------
def start(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_http(url: str, path: str = "/ready", timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}{path} not ready")
        time.sleep(0.1)


async def tenant_load(urls: list[str], tenant: str, rate: float, warmup: float,
                      duration: float, seed: int, timeout_s: float) -> dict:
    """Open-loop Poisson arrivals for one tenant: its answers by status (arrivals after
    `warmup`) and their median latency."""
    import httpx

    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    t0 = time.monotonic()
    tasks = []
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    body = {"model": MODEL, "prompt": f"{tenant} says hello", "max_tokens": 1}
    async with httpx.AsyncClient(timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=2000)) as c:
        async def one(url: str, measured: bool) -> None:
            sent = time.monotonic()
            try:
                r = await c.post(url + "/v1/completions", json=body, headers=headers)
                status = str(r.status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            if measured:
                statuses[status] = statuses.get(status, 0) + 1
                if status == "200":
                    latencies.append(time.monotonic() - sent)

        at = t0
        while at - t0 < warmup + duration:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tasks.append(asyncio.create_task(one(rng.choice(urls), at - t0 >= warmup)))
        await asyncio.gather(*tasks)
    latencies.sort()
    return {"rate": rate, "statuses": statuses,
            "p50_s": latencies[len(latencies) // 2] if latencies else None}


def run_config(name: str, flow: dict | None, replicas: int, opts: argparse.Namespace,
               workdir: Path, redis_url: str | None) -> dict:
    import httpx

    workers, procs = [], []
    try:
        for i in range(opts.workers):
            port, gport = free_port(), free_port()
            procs.append(start([sys.executable, str(BENCH_DIR / "fairness.py"), "--worker",
                                "--port", str(port), "--grpc-port", str(gport),
                                "--max-running", str(opts.max_running),
                                "--service-ms", str(opts.service_ms)],
                               workdir / f"{name}-worker{i}.log"))
            workers.append(f"http://127.0.0.1:{port}")
        for w in workers:
            wait_http(w)
        config = workdir / f"{name}.yaml"
        config.write_text(json.dumps({"flow_control": flow} if flow else {}))
        urls = []
        for i in range(replicas):
            port = free_port()
            extra = ["--redis", redis_url] if redis_url and flow and flow.get("shared") else []
            procs.append(start([sys.executable, "-m", "tandem.cli", "router", "--port",
                                str(port), "--workers", ",".join(workers), "--config",
                                str(config), "--api-keys", str(workdir / "keys"),
                                "--worker-auth-key-file", str(workdir / "worker.key"),
                                "--redis-key-prefix", f"fair-{name}:", *extra],
                               workdir / f"{name}-router{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_http(u)
        time.sleep(1.0)  # the load loops have reported

        async def measure() -> dict[str, int]:
            """What the workers computed for each tenant in the measured window."""
            import httpx

            await asyncio.sleep(opts.warmup)
            async with httpx.AsyncClient(timeout=10) as c:
                for w in workers:
                    await c.post(w + "/reset")
                await asyncio.sleep(opts.duration)
                totals: dict[str, int] = {}
                for w in workers:
                    for t, n in (await c.get(w + "/served")).json().items():
                        totals[t] = totals.get(t, 0) + n
            return totals

        async def both() -> list:
            # each tenant's client on an event loop (thread) of its own
            return await asyncio.gather(measure(), asyncio.to_thread(asyncio.run, tenant_load(
                urls, "heavy", opts.light_rate * 10, opts.warmup, opts.duration, 1,
                opts.client_timeout)), asyncio.to_thread(asyncio.run, tenant_load(
                    urls, "light", opts.light_rate, opts.warmup, opts.duration, 2,
                    opts.client_timeout)))

        served, heavy, light = asyncio.run(both())
        heavy["served"], light["served"] = served.get("heavy", 0), served.get("light", 0)
        flow_metrics = [line for u in urls for line in httpx.get(
            u + "/metrics", headers={"Authorization": f"Bearer {KEYS['heavy']}"},
            timeout=10).text.splitlines() if line.startswith("tandem_router_flow_")
            and "_bucket" not in line]
    finally:
        for p in procs:
            stop_group(p, 10)
    weights = (flow or {}).get("tenant_weights", {})
    w = {"heavy": weights.get("heavy", 1.0), "light": weights.get("light", 1.0)}
    total = heavy["served"] + light["served"]
    result = {"config": name, "replicas": replicas, "flow_control": flow,
              "tenants": {"heavy": heavy, "light": light}, "served_total": total,
              "router_flow_metrics": flow_metrics,
              "served_per_s": total / opts.duration}
    for t, res in (("heavy", heavy), ("light", light)):
        share = res["served"] / total if total else 0.0
        expected = w[t] / (w["heavy"] + w["light"])
        res.update(share=share, weight_share=expected,
                   deviation=(share - expected) / expected)
    result["max_abs_deviation"] = max(abs(heavy["deviation"]), abs(light["deviation"]))
    result["within_10pct"] = result["max_abs_deviation"] <= 0.10
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int)
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-running", type=int, default=2)
    p.add_argument("--service-ms", type=float, default=1000.0)
    p.add_argument("--light-rate", type=float, default=4.0,
                   help="light's requests/s (heavy sends 10x); above half the pool's rate")
    p.add_argument("--client-timeout", type=float, default=5.0,
                   help="a client gives up on an answer after this many seconds")
    p.add_argument("--only", action="append", default=[],
                   help="run only this configuration (repeatable)")
    p.add_argument("--warmup", type=float, default=None)
    p.add_argument("--duration", type=float, default=None)
    opts = p.parse_args(argv)
    if opts.worker:
        serve_worker(opts.port, opts.grpc_port, opts.max_running, opts.service_ms / 1000)
        return 0
    opts.warmup = opts.warmup if opts.warmup is not None else (3.0 if opts.quick else 6.0)
    opts.duration = opts.duration if opts.duration is not None else (
        12.0 if opts.quick else 60.0)
    workdir = Path(tempfile.mkdtemp(prefix="fairness-"))
    (workdir / "keys").write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    key = workdir / "worker.key"
    key.touch(mode=0o600)
    key.write_bytes(os.urandom(32).hex().encode())
    redis_exe = shutil.which("redis-server")
    if redis_exe is None:
        raise SystemExit("redis-server is required for the two-replica run")
    redis_port = free_port()
    redis = subprocess.Popen([redis_exe, "--port", str(redis_port), "--save", "",
                              "--appendonly", "no", "--dir", str(workdir)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    base = {"enabled": True, "fairness": "least-attained", "ttl_s": 3,
            "saturation": {"waiting": 1}}
    configs = [("no-flow-control", None, 1), ("one-router", base, 1),
               ("two-replicas", {**base, "shared": True}, 2),
               ("weighted", {**base, "tenant_weights": {"heavy": 2.0}}, 1)]
    results = []
    try:
        for name, flow, replicas in configs:
            if opts.only and name not in opts.only:
                continue
            r = run_config(name, flow, replicas, opts, workdir, redis_url)
            results.append(r)
            h, lt = r["tenants"]["heavy"], r["tenants"]["light"]
            print(f"{name:16s} served {r['served_per_s']:5.1f}/s  heavy {h['share']:.3f} "
                  f"(weight {h['weight_share']:.3f})  light {lt['share']:.3f} (weight "
                  f"{lt['weight_share']:.3f})  max deviation {r['max_abs_deviation']:.1%}",
                  flush=True)
    finally:
        redis.kill()
        redis.wait()
    date = dt.date.today().isoformat()
    out = Path(opts.out) if opts.out else (
        BENCH_DIR / "results" / f"fairness{'-quick' if opts.quick else ''}-{date}.json")
    doc = {"bench": "fairness", "date": date, "machine": os.uname().nodename,
           "cpus": os.cpu_count(),
           "setup": {"workers": opts.workers, "max_running": opts.max_running,
                     "service_ms": opts.service_ms, "light_rate": opts.light_rate,
                     "heavy_rate": opts.light_rate * 10, "warmup_s": opts.warmup,
                     "duration_s": opts.duration, "client_timeout_s": opts.client_timeout,
                     "pool_rate": opts.workers * opts.max_running * 1000 / opts.service_ms},
           "results": results}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
