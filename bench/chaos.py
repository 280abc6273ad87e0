"""The chaos suite: open-loop load through a P/D fleet and two router replicas while kill -9
hits, in turn, a decode worker, a prefill worker mid-transfer, a router replica and Redis.

    .venv/bin/python bench/chaos.py [--quick] [--model PATH] [--rate R] [--duration S]
        [--faults decode,prefill,router,redis] [--seed N] [--out FILE]

The fleet is what `tandem serve --prefill 1 --decode 2` starts (its own plan,
`serving.embedded.plan`: the same worker and router command lines, one worker-auth key),
plus a second router replica over the same workers, both routers keeping their prefix index
in one `redis-server` (`--index`). This script is
the supervisor that Kubernetes would be: a killed process is started again on the same
ports (`tandem serve` itself stops the whole deployment when a child dies, so it cannot
host the run). The client spreads requests over both router URLs and, as a Service would,
sends a new request to the other replica when one refuses connections.

The workload is one seeded Poisson schedule of `--rate` requests/s over `--duration` s: a
mix of completions (token-id prompts) and chat (text), streamed and not, greedy and seeded
sampling, short prompts and long ones (which the routers send through the prefill worker).
It runs once undisturbed (the reference), then once per fault, the same schedule, with
that fault's kill -9 at `--kill-at` of the way in, once its target is busy (the prefill
worker's while a prompt's pages are computed or in flight). Each phase's requests carry a
`cache_salt` of its own, so no phase finds the prefixes an earlier one cached (the answers
are the same: a salt only keys the cache). Each request ends as:

* exact: completed with exactly the reference's text and finish reason;
* differing: completed with other text: a bug;
* clean_error: a well-formed OpenAI error (HTTP status and `{"error": {message, type, param,
  code}}` body, or an SSE error event then `[DONE]`), counted by its code;
* router_cut: its connection went down with the router replica that was killed while
  serving it (no server-side mechanism can keep a TCP connection to a dead process);
* lost: anything else (a cut without an error, a malformed answer), or hung (no end
  within `--request-timeout`).

Afterwards every process (restarted ones included) must hold nothing: no running, waiting
or in-flight request, no KV block in use, no page lease, no open KV transfer, no router
upstream connection in use and no request queued (read from their /metrics, within
`--settle` s). `nothing_lost` in the JSON is the one verdict: no differing, lost or hung
request in any phase and no leak anywhere. Writes `bench/results/chaos[-quick]-<date>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime as dt
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from servers import stop_group  # noqa: E402

FAULTS = ("decode", "prefill", "router", "redis")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")
MODEL_NAME = "chaos"  # the served name when --model is given
PREFILL_KILL_DELAY_S = 0.03  # after a long prompt is sent: while it is prefilled or sent


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


# -- the fleet ----------------------------------------------------------------------------------

@dataclass
class Proc:
    """One supervised process: restarted with the same command (same ports) after a kill."""

    name: str
    cmd: list[str]
    url: str | None  # its HTTP base URL (None: redis)
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cmd_url: str = ""  # redis: its URL
    popen: subprocess.Popen | None = None
    kills: int = 0

    def start(self) -> None:
        with open(self.log_path, "a") as f:
            self.popen = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT,
                                          env={**os.environ, **self.env},
                                          start_new_session=True)

    def kill9(self) -> None:
        assert self.popen is not None
        os.killpg(self.popen.pid, signal.SIGKILL)  # the pod's whole container
        self.popen.wait()
        self.kills += 1

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if self.popen is not None:
            stop_group(self.popen, timeout_s=30)

    def wait_ready(self, timeout: float, workers: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}); see "
                                   f"{self.log_path}")
            try:
                if self.url is None:
                    import redis

                    redis.Redis.from_url(self.cmd_url).ping()
                    return
                r = httpx.get(f"{self.url}/ready", timeout=2)
                if r.status_code == 200 and (
                        not workers or r.json().get("ready_workers", 0) >= workers):
                    return
            except Exception:  # noqa: BLE001 - not up yet, whatever the reason
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} was not ready after {timeout:g} s; see {self.log_path}")


@dataclass
class Fleet:
    redis: Proc
    prefill: list[Proc]
    decode: list[Proc]
    routers: list[Proc]

    @property
    def workers(self) -> list[Proc]:
        return [*self.prefill, *self.decode]

    @property
    def all(self) -> list[Proc]:
        return [self.redis, *self.workers, *self.routers]

    def ready(self, timeout: float) -> None:
        """Every live worker ready, and every live router routing to all of them."""
        live = [p for p in self.workers if p.alive]
        for p in live:
            p.wait_ready(timeout)
        for r in self.routers:
            if r.alive:
                r.wait_ready(timeout, workers=len(live))

    def stop(self) -> None:
        for p in reversed(self.all):
            p.stop()


def plan_fleet(model: str | None, logs: Path, worker_flags: list[str]) -> Fleet:
    """The processes: `tandem serve --prefill 1 --decode 2`'s plan, a second router replica
    and the Redis both routers share."""
    from tandem.serving.embedded import plan, worker_auth_key_file
    from tandem.serving.ports import free_port

    redis_port = free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("chaos: redis-server is required (Debian: apt-get install "
                         "redis-server)")
    redis = Proc("redis", [exe, "--port", str(redis_port), "--save", "", "--appendonly", "no",
                           "--dir", str(logs)], None, logs / "redis.log", cmd_url=redis_url)
    args = argparse.Namespace(host="127.0.0.1", port=free_port(), log_level="WARNING",
                              workers=None, prefill=1, decode=2)
    passthrough = [*worker_flags]
    router_flags = ["--index", redis_url]  # the shared prefix index (no rate limits: --redis)
    if model is not None:
        passthrough += ["--model", model, "--served-model-name", MODEL_NAME]
        router_flags += ["--tokenizer", f"{MODEL_NAME}={model}"]
    key = worker_auth_key_file()
    atexit.register(Path(key).unlink, missing_ok=True)
    deployment = plan(args, passthrough, auth_key_file=key, gpus=[], router_flags=router_flags)
    env = {"PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
    prefill, decode = [], []
    for (role, url, cmd), wenv in zip(deployment.workers, deployment.envs, strict=True):
        group = prefill if role == "prefill" else decode
        name = f"{role}{len(group)}"
        group.append(Proc(name, cmd, url, logs / f"{name}.log", {**env, **wenv}))
    routers = []
    for i in range(2):
        port = args.port if i == 0 else free_port()
        cmd = list(deployment.router)
        cmd[cmd.index("--port") + 1] = str(port)
        routers.append(Proc(f"router{i}", cmd, f"http://127.0.0.1:{port}",
                            logs / f"router{i}.log", env))
    return Fleet(redis, prefill, decode, routers)


# -- the workload --------------------------------------------------------------------------------

@dataclass
class Req:
    index: int
    at: float  # arrival offset, s
    api: str  # "completions" | "chat"
    stream: bool
    seeded: bool  # seeded sampling; else greedy
    long: bool
    body: dict


def workload(model: str, rate: float, duration: float, seed: int, long_tokens: int,
             max_tokens: int) -> list[Req]:
    """The seeded open-loop schedule: Poisson arrivals at `rate` over `duration` s."""
    rng = random.Random(seed)
    out: list[Req] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        api = rng.choice(("completions", "chat"))
        stream, seeded = rng.random() < 0.5, rng.random() < 0.5
        long = rng.random() < 0.25
        n = long_tokens if long else rng.randrange(24, 96)
        body: dict = {"model": model, "max_tokens": rng.randrange(max_tokens // 2, max_tokens + 1),
                      "ignore_eos": True, "stream": stream}
        body |= {"temperature": 0.8, "seed": rng.randrange(1 << 31)} if seeded else \
            {"temperature": 0.0}
        if api == "completions":
            body["prompt"] = [rng.randrange(100, 30000) for _ in range(n)]
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(max(n // 2, 4)))
            body["messages"] = [{"role": "user", "content": text}]
        out.append(Req(len(out), t, api, stream, seeded, long, body))


# -- one request ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    index: int
    kind: str  # ok | clean_error | router_cut | lost | hung (verdicts against the reference
    # come later: exact / differing)
    text: str = ""
    finish: str | None = None
    code: str | None = None  # a clean error's code (or type, or HTTP status)
    detail: str = ""
    router: int = -1  # the replica that served it
    failovers: int = 0  # connections refused by a dead replica before one answered
    started: float = 0.0
    ended: float = 0.0


def openai_error(obj: object) -> str | None:
    """The code of a well-formed OpenAI error body (`{"error": {message, type, param,
    code}}`), its type when the code is null; None when `obj` is not one."""
    if not isinstance(obj, dict) or set(obj) != {"error"} or not isinstance(obj["error"], dict):
        return None
    err = obj["error"]
    if not {"message", "type", "param", "code"} <= set(err) or not isinstance(
            err["message"], str) or not isinstance(err["type"], str):
        return None
    return str(err["code"] if err["code"] is not None else err["type"])


class RouterDown(Exception):
    """Every router replica refused the connection."""


async def send(client: httpx.AsyncClient, routers: list[str], req: Req, t0: float,
               timeout: float, salt: str) -> Outcome:
    out = Outcome(req.index, "lost")
    first = req.index % len(routers)
    path = "/v1/completions" if req.api == "completions" else "/v1/chat/completions"
    out.started = time.monotonic() - t0
    try:
        async with asyncio.timeout(timeout):
            for attempt in range(len(routers) * 3):
                out.router = (first + attempt) % len(routers)
                try:
                    await _exchange(client, routers[out.router] + path, req, out, salt)
                    break
                except httpx.ConnectError:  # nothing sent: a Service picks another endpoint
                    out.failovers += 1
                    await asyncio.sleep(0.05 * attempt)
            else:
                out.kind, out.detail = "lost", "every router replica refused connections"
    except TimeoutError:
        out.kind, out.detail = "hung", f"no end within {timeout:g} s"
    except (httpx.TransportError, httpx.DecodingError) as exc:
        out.kind, out.detail = "cut", f"{type(exc).__name__}: {exc}"[:300]
    out.ended = time.monotonic() - t0
    return out


async def _exchange(client: httpx.AsyncClient, url: str, req: Req, out: Outcome,
                    salt: str) -> None:
    async with client.stream("POST", url, json={**req.body, "cache_salt": salt}) as resp:
        if resp.status_code != 200 or not req.stream:
            raw = await resp.aread()
            try:
                obj = json.loads(raw)
            except ValueError:
                out.kind, out.detail = "lost", f"HTTP {resp.status_code}: not JSON {raw[:200]!r}"
                return
            if resp.status_code != 200:
                code = openai_error(obj)
                out.kind, out.code = ("clean_error", code) if code else ("lost", None)
                out.detail = f"HTTP {resp.status_code}: {raw[:200]!r}"
                return
            choice = obj["choices"][0]
            out.text = choice["text"] if req.api == "completions" else \
                choice["message"]["content"]
            out.finish, out.kind = choice["finish_reason"], "ok"
            return
        parts: list[str] = []
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if out.kind == "clean_error":
                    return
                out.text, out.kind = "".join(parts), "ok" if out.finish else "lost"
                if out.kind == "lost":
                    out.detail = "[DONE] without a finish reason"
                return
            chunk = json.loads(data)
            if "error" in chunk:
                code = openai_error(chunk)
                out.kind, out.code = ("clean_error", code) if code else ("lost", None)
                out.detail = f"SSE error: {data[:200]}"
                continue
            for choice in chunk.get("choices", []):
                delta = choice.get("text") if req.api == "completions" else \
                    (choice.get("delta") or {}).get("content")
                parts.append(delta or "")
                if choice.get("finish_reason"):
                    out.finish = choice["finish_reason"]
        out.kind, out.detail = "lost", "the stream ended without [DONE]"


# -- a phase -------------------------------------------------------------------------------------

@dataclass
class Kill:
    target: str  # the process name
    at: float  # s into the phase
    in_flight: int  # requests open at the moment
    target_busy: bool  # the target had work in hand (see `killer`)


async def run_phase(fleet: Fleet, reqs: list[Req], fault: str | None, kill_frac: float,
                    timeout: float) -> tuple[list[Outcome], Kill | None]:
    """Send the schedule; with `fault`, kill -9 its target during it (restarted once every
    request has ended)."""
    routers = [r.url for r in fleet.routers if r.url]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    t0 = time.monotonic()
    kill: Kill | None = None
    open_reqs: dict[int, int] = {}  # request -> the router replica it is on

    async def one(req: Req) -> Outcome:
        await asyncio.sleep(max(0.0, req.at - (time.monotonic() - t0)))
        open_reqs[req.index] = req.index % len(routers)
        try:
            return await send(client, routers, req, t0, timeout, f"chaos-{fault or 'reference'}")
        finally:
            open_reqs.pop(req.index, None)

    async def killer() -> None:
        """At `kill_frac` of the schedule, once the target is busy (the decode worker has a
        request running, the prefill worker a prompt or a page transfer, the router replica
        a request open), or at the schedule's end: kill -9."""
        nonlocal kill
        target = {"decode": fleet.decode[0], "prefill": fleet.prefill[0],
                  "router": fleet.routers[1], "redis": fleet.redis}[fault]
        at = reqs[-1].at * kill_frac
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        names = {"decode": ("vllm:num_requests_running",),
                 "prefill": ("tandem_kvtransfer_streams_active",)}.get(fault, ())
        # a prefill worker's prompts and pages may come and go between two polls (a tiny
        # model): failing to see it busy, it is killed right after a long prompt is sent
        longs = [r.at for r in reqs if r.long and r.at >= at]
        fallback = longs[0] + PREFILL_KILL_DELAY_S if fault == "prefill" and longs else None
        hit = fault == "redis"
        while not hit and time.monotonic() - t0 < reqs[-1].at:
            if fault == "router":
                hit = any(o == 1 for o in open_reqs.values())
            elif names:
                hit = await asyncio.to_thread(busy, target.url, names)
            if fallback is not None and time.monotonic() - t0 >= fallback:
                break
            if not hit:
                await asyncio.sleep(0.01)
        n = len(open_reqs)
        await asyncio.to_thread(target.kill9)
        kill = Kill(target.name, time.monotonic() - t0, n, hit)
        log(f"  kill -9 {target.name} at {kill.at:.2f} s ({n} requests open, target "
            f"{'busy' if hit else 'not seen busy'})")

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        tasks = [asyncio.create_task(one(r)) for r in reqs]
        if fault:
            await killer()
        outcomes = list(await asyncio.gather(*tasks))
    if kill is not None:
        for o in outcomes:  # a cut connection to the replica that died with it
            if o.kind == "cut":
                o.kind = "router_cut" if (fault == "router" and o.router == 1
                                          and o.started <= kill.at) else "lost"
    else:
        for o in outcomes:
            if o.kind == "cut":
                o.kind = "lost"
    return outcomes, kill


def judge(outcomes: list[Outcome], reference: list[Outcome]) -> dict:
    """Per-phase counts: exact, differing, clean errors by code, router_cut, lost, hung, and
    unreferenced (completed, but the undisturbed run failed it)."""
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    bad: list[dict] = []
    for o, ref in zip(outcomes, reference, strict=True):
        if o.kind == "ok" and ref.kind != "ok":
            counts["unreferenced"] += 1  # the undisturbed run failed it: nothing to compare
        elif o.kind == "ok":
            same = (o.text, o.finish) == (ref.text, ref.finish)
            counts["exact" if same else "differing"] += 1
            if not same:
                bad.append({"index": o.index, "kind": "differing", "got": o.text[:200],
                            "want": ref.text[:200]})
        elif o.kind == "clean_error":
            counts["clean_error"] += 1
            errors[o.code or "?"] += 1
        else:
            counts[o.kind] += 1
            if o.kind in ("lost", "hung"):
                bad.append({"index": o.index, "kind": o.kind, "detail": o.detail})
    return {"requests": len(outcomes), "exact": counts["exact"],
            "differing": counts["differing"], "clean_error": counts["clean_error"],
            "clean_error_by_code": dict(errors), "router_cut": counts["router_cut"],
            "lost": counts["lost"], "hung": counts["hung"],
            "unreferenced": counts["unreferenced"],
            "failovers": sum(o.failovers for o in outcomes), "problems": bad[:20]}


# -- leaks ---------------------------------------------------------------------------------------

# what each process must read 0 on once the fleet is idle: the sum of a gauge's samples (with
# a label filter: only the samples that carry it)
WORKER_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "tandem_kv_leases_active",
                 "tandem_worker_requests_in_flight", "tandem_kvtransfer_streams_active")
ROUTER_GAUGES = ("tandem_router_worker_requests_in_flight",
                 'tandem_router_upstream_connections{state="active"}',
                 "tandem_router_flow_queued")
OPTIONAL = {"tandem_router_flow_queued"}  # exported only with flow control on (none: 0 queued)


def gauges(url: str, wanted: tuple[str, ...]) -> dict[str, float | None]:
    """The sum of the samples of each gauge of `wanted` in `url`/metrics (None: not
    exported; an OPTIONAL one absent reads 0)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float | None] = {w: 0.0 if w in OPTIONAL else None for w in wanted}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for w in wanted:
            base, _, label = w.partition("{")
            if name == base and (not label or label.rstrip("}") in line):
                out[w] = (out[w] or 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def migrations(fleet: Fleet) -> dict[str, dict[str, float]]:
    """`tandem_router_migrations_total` by result, per live router replica: {replica:
    {result: count}} (a killed replica's count is lost with it)."""
    out: dict[str, dict[str, float]] = {}
    for r in fleet.routers:
        if not (r.url and r.alive):
            continue
        try:
            text = httpx.get(f"{r.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        counts = out.setdefault(r.name, {})
        for line in text.splitlines():
            if line.startswith("tandem_router_migrations_total{"):
                result = line.split('result="', 1)[1].split('"', 1)[0] \
                    if 'result="' in line else "?"
                counts[result] = counts.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def migrated(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
             ) -> dict[str, float]:
    """What the replicas alive at both readings counted in between, by result."""
    out: dict[str, float] = {}
    for name, counts in after.items():
        for result, v in counts.items():
            d = v - before.get(name, {}).get(result, 0.0)
            if d > 0:
                out[result] = out.get(result, 0.0) + d
    return out


def busy(url: str, names: tuple[str, ...]) -> bool:
    """Whether any of the gauges `names` reads above 0 at `url` now."""
    try:
        return any((v or 0) > 0 for v in gauges(url, names).values())
    except httpx.HTTPError:
        return False


def leaks(fleet: Fleet, settle: float) -> dict:
    """Each process's gauges once they read 0 (or after `settle` s): {process: {gauge:
    value}}, and the list of (process, gauge) that never came back to 0 or is missing."""
    deadline = time.monotonic() + settle
    while True:
        readings = {p.name: gauges(p.url, WORKER_GAUGES) for p in fleet.workers
                    if p.url and p.alive}
        readings |= {r.name: gauges(r.url, ROUTER_GAUGES) for r in fleet.routers
                     if r.url and r.alive}
        left = [f"{name}: {g}={v}" for name, gs in readings.items() for g, v in gs.items()
                if v != 0]
        if not left or time.monotonic() > deadline:
            return {"gauges": readings, "left": left}
        time.sleep(0.5)


# -- the run -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="CI size: 8 s of arrivals at 3 requests/s, short outputs")
    ap.add_argument("--model", default=None, help="a model directory, or `tiny`: a tiny random "
                    "Llama made for the run (the tests' `make_tiny_model_dir`; default: the "
                    "bundled model)")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default 2; quick 3)")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds of arrivals per phase (default 30; quick 8)")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help=f"comma-separated, in order, of {', '.join(FAULTS)}")
    ap.add_argument("--kill-at", type=float, default=0.4,
                    help="how far into each phase's schedule the kill lands (0-1)")
    ap.add_argument("--long-tokens", type=int, default=None,
                    help="a long prompt's tokens (default 1024; quick 320)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="most output tokens a request asks (default 48; quick 64)")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--settle", type=float, default=45.0,
                    help="seconds the fleet has to hold nothing after the last phase")
    ap.add_argument("--no-restart", action="store_true",
                    help="leave a killed process dead: the later phases run on fewer (CI)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not faults or any(f not in FAULTS for f in faults):
        ap.error(f"--faults: a comma-separated list of {', '.join(FAULTS)}")
    if not 0 <= args.kill_at <= 1:
        ap.error("--kill-at: between 0 and 1")
    rate = args.rate or (3.0 if args.quick else 2.0)
    duration = args.duration or (8.0 if args.quick else 30.0)
    long_tokens = args.long_tokens or (320 if args.quick else 1024)
    max_tokens = args.max_tokens or (64 if args.quick else 48)
    logs = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    if args.model == "tiny":
        sys.path.insert(0, str(REPO))
        from tests.engine.utils import make_tiny_model_dir

        make_tiny_model_dir(logs / "tiny")
        model: str | None = str(logs / "tiny")
    else:
        model = str(Path(args.model).resolve()) if args.model else None
    if model is None:
        from tandem.protocol.bundled import BUNDLED_NAME
        served = BUNDLED_NAME
    else:
        served = MODEL_NAME
    reqs = workload(served, rate, duration, args.seed, long_tokens, max_tokens)
    worker_flags = ["--num-threads", "1", "--max-model-len", str(long_tokens + max_tokens + 64),
                    "--kv-cache-memory", str((128 if args.quick else 512) << 20)]
    fleet = plan_fleet(model, logs, worker_flags)
    report: dict = {"benchmark": "chaos", "date": dt.date.today().isoformat(),
                    "quick": args.quick, "model": args.model or "bundled", "seed": args.seed,
                    "rate_per_s": rate, "duration_s": duration, "requests_per_phase": len(reqs),
                    "mix": dict(Counter(f"{r.api}/{'stream' if r.stream else 'whole'}/"
                                        f"{'seeded' if r.seeded else 'greedy'}"
                                        f"{'/long' if r.long else ''}" for r in reqs)),
                    "topology": {"prefill": 1, "decode": 2, "routers": 2, "redis": 1},
                    "restart": not args.no_restart,
                    "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                "platform": platform.platform()},
                    "logs": str(logs), "phases": []}
    log(f"chaos: {len(reqs)} requests per phase over {duration:g} s; logs in {logs}")
    try:
        for p in fleet.all:
            p.start()
        fleet.redis.wait_ready(30)
        fleet.ready(600)
        log("reference run (no fault)")
        reference, _ = asyncio.run(run_phase(fleet, reqs, None, 0, args.request_timeout))
        ref_ok = [o for o in reference if o.kind == "ok"]
        report["reference"] = {"completed": len(ref_ok), "requests": len(reqs),
                               "problems": [asdict(o) for o in reference if o.kind != "ok"][:5]}
        if len(ref_ok) != len(reqs):
            log(f"the undisturbed run itself failed {len(reqs) - len(ref_ok)} requests")
        for fault in faults:
            log(f"fault: {fault}")
            before = migrations(fleet)
            outcomes, kill = asyncio.run(run_phase(fleet, reqs, fault, args.kill_at,
                                                   args.request_timeout))
            after = migrations(fleet)  # the routers that lived through the phase
            moved = migrated(before, after)
            killed = next(p for p in fleet.all if kill and p.name == kill.target)
            t = time.monotonic()
            if not args.no_restart:
                killed.start()  # as kubelet restarts the container
                killed.wait_ready(600)
            fleet.ready(600)  # the routers see the restarted worker again (or its loss)
            phase = {"fault": fault, "kill": asdict(kill) if kill else None,
                     "restart_s": round(time.monotonic() - t, 2),
                     "migrations": moved, **judge(outcomes, reference)}
            report["phases"].append(phase)
            log(f"  {phase['exact']} exact, {phase['differing']} differing, "
                f"{phase['clean_error']} clean errors {phase['clean_error_by_code']}, "
                f"{phase['router_cut']} router cut, {phase['lost']} lost, {phase['hung']} hung, "
                f"migrations {moved}")
        report["leaks"] = leaks(fleet, args.settle)
    finally:
        fleet.stop()
    report["reference_complete"] = report.get("reference", {}).get("completed") == len(reqs)
    report["nothing_lost"] = bool(
        report["reference_complete"] and len(report["phases"]) == len(faults)
        and all(p["differing"] == 0 and p["lost"] == 0 and p["hung"] == 0
                for p in report["phases"])
        and not report.get("leaks", {"left": ["not read"]})["left"])
    out = Path(args.out) if args.out else BENCH_DIR / "results" / (
        f"chaos{'-quick' if args.quick else ''}-{report['date']}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'fault':8s} {'exact':>6s} {'differ':>6s} {'clean':>6s} {'r.cut':>6s} "
          f"{'lost':>5s} {'hung':>5s}  clean errors by code")
    for p in report["phases"]:
        print(f"{p['fault']:8s} {p['exact']:6d} {p['differing']:6d} {p['clean_error']:6d} "
              f"{p['router_cut']:6d} {p['lost']:5d} {p['hung']:5d}  {p['clean_error_by_code']}")
    left = report.get("leaks", {}).get("left", ["not read"])
    print(f"left behind: {', '.join(left) if left else 'nothing'}")
    print(f"nothing lost: {report['nothing_lost']}\nwrote {out}")
    return 0 if report["nothing_lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
