"""How much of the engine thread's step time the HTTP loop costs it, in one worker process.

A Tandem worker runs the engine thread (schedule, inputs, forward, sampling, detokenization)
and the asyncio HTTP loop (uvicorn, SSE, JSON) in one process, sharing the GIL. This script
starts the real worker app (`serving.api_server.build_app`, uvicorn with the worker's
settings, the `tandem worker` engine defaults) in this process, with the engine's methods
wrapped before its thread starts, and a load client in a subprocess (stdlib asyncio sockets,
so the client costs the machine little). Each round:

* `http`: N concurrent streaming chat completions (greedy, `ignore_eos`, fixed max_tokens);
  the engine thread records every step: wall, thread CPU (`time.thread_time`), its run-queue
  wait (`/proc/thread-self/schedstat`), and the phases (schedule, input building, forward,
  sampling, scheduler update, output processing = detokenization + stop checks + outputs);
* `direct`: the same requests (the token ids and parameters the server admitted), added at
  the same step indices, stepped by the same engine on the same thread with no HTTP traffic
  (one `AsyncLLMEngine.call`), so every step has the same batch composition as its `http`
  twin; the prefix cache is reset before every run.

Contention = (http step wall - direct step wall) / http step wall, over the paired steps.
The GIL's part is measured directly as the engine thread's blocked time in a step:
wall - CPU - run-queue wait (with one torch thread nothing else blocks that thread).
Rounds alternate http/direct (ABAB...); `--switch-intervals` adds http configs with another
`sys.setswitchinterval`. JSON: `bench/results/gil_share-<date>.json`.

    .venv/bin/python bench/gil_share.py [--quick] [--requests 64] [--max-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PHASES = ("schedule", "build", "forward", "sample", "update", "output")
PY_PHASES = ("schedule", "build", "update", "output")  # pure Python: what the loop contends with
WORDS = ("the", "model", "serves", "tokens", "quickly", "while", "every", "request", "streams",
         "its", "answer", "back", "over", "a", "socket", "and", "engine", "steps", "batch",
         "cache", "blocks", "prefix", "kernel", "thread", "loop", "time", "story", "about")


# -- load client (a subprocess: `gil_share.py --client`) -----------------------------------------
async def _stream_one(port: int, body: bytes) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    buf = bytearray()
    while chunk := await reader.read(1 << 16):
        buf += chunk
    writer.close()
    usage = re.findall(rb'"completion_tokens":\s*(\d+)', buf)
    return {"status": int(buf[9:12] or 0), "events": buf.count(b"\ndata: "),
            "done": b"data: [DONE]" in buf, "tokens": int(usage[-1]) if usage else None}


def client_main(port: int) -> int:
    """Per stdin line (a JSON list of request bodies): send them all at once, print results."""
    for line in sys.stdin:
        bodies = [json.dumps(b).encode() for b in json.loads(line)]
        c0, t0 = time.process_time(), time.perf_counter()

        async def run(bodies: list[bytes] = bodies) -> list[dict[str, Any]]:
            return await asyncio.gather(*(_stream_one(port, b) for b in bodies))

        results = asyncio.run(run())
        print(json.dumps({"results": results, "cpu_s": time.process_time() - c0,
                          "wall_s": time.perf_counter() - t0}), flush=True)
    return 0


def chat_bodies(n: int, max_tokens: int, words: int, model: str) -> list[dict[str, Any]]:
    """n distinct user turns of `words` pseudo-English words (seeded), greedy, ignore_eos."""
    import random

    rng = random.Random(0)
    return [{"model": model, "stream": True, "stream_options": {"include_usage": True},
             "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
             "messages": [{"role": "user", "content": f"Request {i}: " + " ".join(
                 rng.choice(WORDS) for _ in range(words))}]} for i in range(n)]


# -- engine-thread instrumentation ---------------------------------------------------------------
class StepRecorder:
    """Wraps one `LLMEngine`'s methods (instance attributes; no source change) and records,
    while active, one row per `step()` on the engine thread."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.active = False
        self.steps: list[dict[str, Any]] = []
        self.adds: list[tuple[int, Any, Any, dict[str, Any]]] = []  # step index, prompt, ...
        self._wall: dict[str, float] = defaultdict(float)
        self._cpu: dict[str, float] = defaultdict(float)
        self._shape: tuple[int, int, int] = (0, 0, 0)
        self._fd: int | None = None
        self.engine_tid = 0
        self._orig_add = engine.add_request
        engine.add_request = self._add_request
        sched, runner, outputs = engine.scheduler, engine.runner, engine.outputs
        sched.schedule = self._timed("schedule", sched.schedule, shape=True)
        sched.update_after_step = self._timed("update", sched.update_after_step)
        runner.execute = self._timed("execute", runner.execute)
        runner.model.forward = self._timed("forward", runner.model.forward)
        runner.sampler = _TimedCall(runner.sampler, self._timed("sample", runner.sampler))
        outputs.process_token = self._timed("detok", outputs.process_token)
        outputs.make_output = self._timed("make_output", outputs.make_output)
        self._step = engine.step
        engine.step = self.step

    def _timed(self, name: str, fn: Any, shape: bool = False) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                out = fn(*args, **kwargs)
            finally:
                self._wall[name] += time.perf_counter() - t0
                self._cpu[name] += time.thread_time() - c0
            if shape:
                s = out.scheduled
                nd = sum(1 for x in s if x.num_new_tokens == 1)
                self._shape = (nd, sum(x.num_new_tokens for x in s) - nd,
                               sum(x.start + x.num_new_tokens for x in s))
            return out
        return wrapped

    def _add_request(self, request_id: str, prompt: Any, params: Any = None,
                     **kwargs: Any) -> list[int]:
        ids = self._orig_add(request_id, prompt, params, **kwargs)
        if self.active:
            self.adds.append((len(self.steps), prompt, params, kwargs))
        return ids

    def _run_delay_ns(self) -> int:
        if self._fd is None:
            self.engine_tid = threading.get_native_id()
            self._fd = os.open(f"/proc/self/task/{self.engine_tid}/schedstat", os.O_RDONLY)
        return int(os.pread(self._fd, 128, 0).split()[1])

    def step(self) -> list[Any]:
        if not self.active:
            return self._step()
        self._wall.clear()
        self._cpu.clear()
        self._shape = (0, 0, 0)
        q0 = self._run_delay_ns()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self._step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        runq = (self._run_delay_ns() - q0) / 1e9
        w, c = self._wall, self._cpu
        row: dict[str, Any] = {"wall": wall, "cpu": cpu, "runq": runq,
                               "blocked": max(0.0, wall - cpu - runq), "shape": self._shape}
        inner = {"schedule": ("schedule",), "forward": ("forward",), "sample": ("sample",),
                 "update": ("update",)}
        for phase, keys in inner.items():
            row[phase], row[phase + "_cpu"] = sum(w[k] for k in keys), sum(c[k] for k in keys)
        row["build"] = w["execute"] - w["forward"] - w["sample"]
        row["build_cpu"] = c["execute"] - c["forward"] - c["sample"]
        row["output"] = wall - w["schedule"] - w["execute"] - w["update"]
        row["output_cpu"] = cpu - c["schedule"] - c["execute"] - c["update"]
        row["detok"] = w["detok"]
        row["make_output"] = w["make_output"]
        self.steps.append(row)
        return out

    def begin(self) -> None:
        self.steps, self.adds = [], []
        self.active = True

    def end(self) -> tuple[list[dict[str, Any]], list[tuple[int, Any, Any, dict[str, Any]]]]:
        self.active = False
        return self.steps, self.adds

    def replay(self, adds: list[tuple[int, Any, Any, dict[str, Any]]], tag: str) -> None:
        """On the engine thread: add each request at its recorded step index and step until
        all are done (the `direct` run)."""
        eng, k = self.engine, 0
        pending = sorted(((at, i, prompt, params, kw) for i, (at, prompt, params, kw)
                          in enumerate(adds)), key=lambda a: a[0])
        while pending or eng.has_unfinished_requests():
            while pending and pending[0][0] <= k:
                _, i, prompt, params, kw = pending.pop(0)
                self._orig_add(f"{tag}-{i}", prompt, params, **kw)
            self.step()
            k += 1


class _TimedCall:
    """A callable proxy whose calls are timed; attributes pass through."""

    def __init__(self, inner: Any, timed: Any) -> None:
        self._inner, self._call = inner, timed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# -- process-wide CPU accounting -----------------------------------------------------------------
def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, keyed "comm/tid" (schedstat, ns)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            base = f"/proc/self/task/{tid}"
            comm = Path(f"{base}/comm").read_text().strip()
            out[f"{comm}/{tid}"] = int(Path(f"{base}/schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue
    return out


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(vals[:8]) - vals[3] - vals[4] - vals[7]) / tick, vals[7] / tick


def cpu_window(before: tuple, after: tuple, engine_tid: int, client_pid: int) -> dict[str, Any]:
    (t0, th0, cl0, m0), (t1, th1, cl1, m1) = before, after
    per = {k: th1[k] - th0.get(k, 0.0) for k in th1}
    main = sum(v for k, v in per.items() if k.endswith(f"/{os.getpid()}"))
    eng = sum(v for k, v in per.items() if k.endswith(f"/{engine_tid}"))
    ours = sum(per.values())
    return {"window_s": t1 - t0, "main_thread_cpu_s": main, "engine_thread_cpu_s": eng,
            "other_threads_cpu_s": ours - main - eng, "client_cpu_s": cl1 - cl0,
            "other_processes_cpu_s": max(0.0, (m1[0] - m0[0]) - ours - (cl1 - cl0)),
            "steal_s": m1[1] - m0[1],  # the hypervisor's: counts as blocked in a step
            "busiest_threads": dict(sorted(((k, round(v, 3)) for k, v in per.items()),
                                           key=lambda kv: -kv[1])[:6])}


def snap(client_pid: int) -> tuple:
    return time.perf_counter(), thread_cpu(), proc_cpu(client_pid), machine_busy()


# -- analysis ------------------------------------------------------------------------------------
def pair_steps(http: list[dict], direct: list[dict]) -> tuple[list[tuple[dict, dict]], bool]:
    """Step i with step i when the batch shapes agree throughout (the replay is exact);
    otherwise steps of equal shape, in order."""
    if [s["shape"] for s in http] == [s["shape"] for s in direct]:
        return list(zip(http, direct, strict=True)), True
    by_shape: dict[tuple, list[dict]] = defaultdict(list)
    for s in direct:
        by_shape[tuple(s["shape"])].append(s)
    pairs = []
    for s in http:
        twins = by_shape.get(tuple(s["shape"]))
        if twins:
            pairs.append((s, twins.pop(0)))
    return pairs, False


def compare(http: list[dict], direct: list[dict]) -> dict[str, Any]:
    pairs, exact = pair_steps(http, direct)

    def total(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows)

    h, d = [p[0] for p in pairs], [p[1] for p in pairs]
    hw, dw = total(h, "wall"), total(d, "wall")
    dec = [(a, b) for a, b in pairs if a["shape"][1] == 0]
    py_h = sum(total(h, p) for p in PY_PHASES)
    py_d = sum(total(d, p) for p in PY_PHASES)
    out: dict[str, Any] = {
        "paired_steps": len(pairs), "http_steps": len(http), "direct_steps": len(direct),
        "shapes_match": exact, "http_step_s": hw, "direct_step_s": dw,
        "contention": (hw - dw) / hw if hw else 0.0,
        "contention_decode_only": ((sum(a["wall"] for a, _ in dec) - sum(b["wall"] for _, b
                                    in dec)) / sum(a["wall"] for a, _ in dec)) if dec else 0.0,
        "median_step_increase": statistics.median(
            (a["wall"] - b["wall"]) / a["wall"] for a, b in pairs) if pairs else 0.0,
        "blocked_http": total(h, "blocked") / hw if hw else 0.0,
        "blocked_direct": total(d, "blocked") / dw if dw else 0.0,
        "runq_http": total(h, "runq") / hw if hw else 0.0,
        "runq_direct": total(d, "runq") / dw if dw else 0.0,
        "py_phases_increase": (py_h - py_d) / py_d if py_d else 0.0,
        "py_phases_lost": (py_h - py_d) / hw if hw else 0.0,
        "forward_lost": (total(h, "forward") - total(d, "forward")) / hw if hw else 0.0,
        "output_share_direct": total(d, "output") / dw if dw else 0.0,
        "detok_share_direct": total(d, "detok") / dw if dw else 0.0,
        "phase_s_http": {p: total(h, p) for p in PHASES},
        "phase_s_direct": {p: total(d, p) for p in PHASES},
    }
    out["gil_wait"] = out["blocked_http"] - out["blocked_direct"] * dw / hw if hw else 0.0
    # the same without run-queue waits (cores taken by other processes): the share a step
    # would lose on a machine with a free core for each thread
    hr, dr = hw - total(h, "runq"), dw - total(d, "runq")
    out["contention_off_runq"] = (hr - dr) / hr if hr > 0 else 0.0
    return out


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def summarize(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("contention", "contention_off_runq", "contention_decode_only",
            "median_step_increase", "gil_wait", "break_even_step_ms",
            "blocked_http", "blocked_direct", "runq_http", "runq_direct", "py_phases_increase",
            "py_phases_lost", "forward_lost", "output_share_direct", "detok_share_direct",
            "loop_cpu_ms_per_step", "loop_cpu_us_per_token", "engine_cpu_between_steps_ms",
            "http_step_ms", "direct_step_ms")
    out: dict[str, Any] = {}
    for cfg in dict.fromkeys(p["config"] for p in pairs):
        rows = [p for p in pairs if p["config"] == cfg]
        out[cfg] = {k: spread([r[k] for r in rows]) for k in keys}
        out[cfg]["all_shapes_match"] = all(r["shapes_match"] for r in rows)
    return out


def columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-step rows as one list per field (the JSON's `steps`)."""
    return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 7) if abs(x) < 1 else round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


# -- the experiment ------------------------------------------------------------------------------
def wait_ready(port: int, timeout: float = 300.0) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the worker did not become ready")


def experiment(args: argparse.Namespace, port: int, aeng: Any, rec: StepRecorder,
               client: subprocess.Popen, model: str) -> dict[str, Any]:
    wait_ready(port)
    bodies = json.dumps(chat_bodies(args.requests, args.max_tokens, args.words, model))
    default_si = sys.getswitchinterval()
    configs = {f"http-si{si * 1e3:g}ms" if si != default_si else "http": si
               for si in [default_si, *args.switch_intervals]}

    def on_engine(fn: Any) -> Any:
        return asyncio.run(aeng._call(fn))

    def http_run(si: float) -> dict[str, Any]:
        on_engine(lambda e: e.reset_prefix_cache())
        sys.setswitchinterval(si)
        rec.begin()
        before = snap(client.pid)
        client.stdin.write(bodies + "\n")
        client.stdin.flush()
        reply = json.loads(client.stdout.readline())
        after = snap(client.pid)
        steps, adds = rec.end()
        sys.setswitchinterval(default_si)
        bad = [r for r in reply["results"] if r["status"] != 200 or not r["done"]
               or r["tokens"] != args.max_tokens]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed: {bad[:3]}")
        return {"steps": steps, "adds": adds, "client": {k: reply[k] for k in ("cpu_s", "wall_s")},
                "cpu": cpu_window(before, after, rec.engine_tid, client.pid)}

    def direct_run(adds: list, tag: str) -> dict[str, Any]:
        on_engine(lambda e: e.reset_prefix_cache())
        before = snap(client.pid)

        def replay(_: Any) -> list[dict[str, Any]]:
            rec.begin()
            rec.replay(adds, tag)
            return rec.end()[0]
        steps = on_engine(replay)
        after = snap(client.pid)
        return {"steps": steps, "cpu": cpu_window(before, after, rec.engine_tid, client.pid)}

    load0 = os.getloadavg()
    if not args.quick:  # native kernels, allocator, caches: a round that is not recorded
        direct_run(http_run(default_si)["adds"], "warm")
    runs, pairs = [], []
    for r in range(args.rounds):
        names = list(configs)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate the config order
        for name in names:
            h = http_run(configs[name])
            d = direct_run(h.pop("adds"), f"r{r}-{name}")
            cmp = compare(h["steps"], d["steps"])
            tokens = args.requests * args.max_tokens
            cmp |= {"config": name, "round": r, "switch_interval_s": configs[name],
                    "http_step_ms": 1e3 * cmp["http_step_s"] / max(1, cmp["paired_steps"]),
                    "direct_step_ms": 1e3 * cmp["direct_step_s"] / max(1, cmp["paired_steps"]),
                    "loop_cpu_ms_per_step": 1e3 * h["cpu"]["main_thread_cpu_s"]
                    / max(1, len(h["steps"])),
                    "loop_cpu_us_per_token": 1e6 * h["cpu"]["main_thread_cpu_s"] / tokens}
            # below this step time the loop's CPU per step, all of it holding the GIL, would
            # be over 5 % of a step if it serialized with the engine thread (a GPU's regime)
            cmp["break_even_step_ms"] = cmp["loop_cpu_ms_per_step"] / 0.05
            # the engine thread's own work between steps (stats, handing outputs to the loop)
            cmp["engine_cpu_between_steps_ms"] = 1e3 * (
                h["cpu"]["engine_thread_cpu_s"] - sum(x["cpu"] for x in h["steps"])
            ) / max(1, len(h["steps"]))
            pairs.append(cmp)
            runs.append({"config": name, "round": r, "http": h, "direct": d})
            print(f"round {r} {name}: contention {cmp['contention']:+.2%}, GIL wait "
                  f"{cmp['gil_wait']:+.2%}, {cmp['http_step_ms']:.1f} vs "
                  f"{cmp['direct_step_ms']:.1f} ms/step, shapes match {cmp['shapes_match']}",
                  flush=True)
    return {"pairs": pairs, "runs": runs, "summary": summarize(pairs),
            "loadavg_before": load0, "loadavg_after": os.getloadavg()}


def print_table(summary: dict[str, Any]) -> None:
    def cell(v: dict[str, Any], scale: float = 100.0, fmt: str = "{:+.1f}") -> str:
        return (f"{fmt.format(v['median'] * scale)} [{fmt.format(v['min'] * scale)}, "
                f"{fmt.format(v['max'] * scale)}]")

    head = ("config", "lost: wall %", "lost: off run-queue %", "GIL wait %",
            "run-queue % h/d", "step ms h/d", "output %", "loop ms/step")
    print("\n" + " | ".join(head))
    for cfg, s in summary.items():
        med = {k: v["median"] for k, v in s.items() if isinstance(v, dict)}
        print(" | ".join((cfg, cell(s["contention"]), cell(s["contention_off_runq"]),
                          cell(s["gil_wait"]),
                          f"{med['runq_http']:.0%} / {med['runq_direct']:.0%}",
                          f"{med['http_step_ms']:.1f} / {med['direct_step_ms']:.1f}",
                          f"{med['output_share_direct']:.1%}",
                          f"{med['loop_cpu_ms_per_step']:.2f}")))
    print("(median [min, max] over rounds; output % = output processing (detokenization, stop "
          "checks, RequestOutputs) as a share of a step with no HTTP load)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 requests x 8 tokens, 1 round")
    ap.add_argument("--requests", type=int, default=64, help="concurrent streams")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--words", type=int, default=40, help="words per user turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--switch-intervals", type=float, nargs="*", default=[],
                    help="extra http configs with sys.setswitchinterval(S) (seconds)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the engine's overlapped step loop (outputs on their own thread)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client_main(args.port)
    if args.quick:
        args.requests, args.max_tokens, args.rounds, args.words = 4, 8, 1, 12

    import torch
    import uvicorn

    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.engine.cpu_tuning import limit_malloc_arenas
    from tandem.engine.llm_engine import LLMEngine
    from tandem.serving.api_server import ServerSettings, build_app
    from tandem.serving.ports import free_port
    from tandem.serving.worker import add_engine_args, add_server_args, engine_config

    limit_malloc_arenas()  # as `tandem worker`, before any thread starts
    wp = argparse.ArgumentParser()
    add_engine_args(wp)
    add_server_args(wp)
    config = engine_config(wp.parse_args(
        (["--num-threads", str(args.threads)] if args.threads else [])
        + [f"--{'' if args.async_scheduling else 'no-'}async-scheduling"]), serving=True)
    engine = LLMEngine(config)
    rec = StepRecorder(engine)  # wrapped before the engine thread starts
    aeng = AsyncLLMEngine(engine)
    port = free_port()
    app = build_app(ServerSettings(served_model_name=config.model_name,
                                   worker_id=f"127.0.0.1:{port}"), lambda: aeng)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    client = subprocess.Popen([sys.executable, __file__, "--client", "--port", str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    result: dict[str, Any] = {}

    def orchestrate() -> None:
        try:
            result.update(experiment(args, port, aeng, rec, client, config.model_name))
        except BaseException as exc:  # noqa: BLE001 - reported after the server stops
            result["error"] = exc
        finally:
            server.should_exit = True

    t0 = time.time()
    threading.Thread(target=orchestrate, name="bench-orchestrator", daemon=True).start()
    server.run()
    client.stdin.close()
    client.wait(timeout=10)
    if "error" in result:
        raise result["error"]
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=HERE).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", str(HERE.parent / "src")],
                                capture_output=True, text=True, cwd=HERE).stdout.strip())
    for run in result["runs"]:
        for kind in ("http", "direct"):
            run[kind]["steps"] = columns(run[kind]["steps"])
    report = {
        "bench": "gil_share", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_rev": rev, "src_dirty": dirty, "duration_s": time.time() - t0,
        "workload": {"requests": args.requests, "max_tokens": args.max_tokens,
                     "words": args.words, "endpoint": "/v1/chat/completions", "stream": True,
                     "temperature": 0.0, "ignore_eos": True, "rounds": args.rounds},
        "engine_config": {k: getattr(config, k) for k in (
            "max_num_seqs", "max_num_batched_tokens", "block_size", "dtype", "num_threads",
            "attention_backend", "enable_prefix_caching")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "note": "shared dev box: other sessions' tests may run concurrently; see "
                            "each run's cpu.other_processes_cpu_s and loadavg"},
        **result,
    }
    out = Path(args.out) if args.out else HERE / "results" / (
        f"gil_share{'-quick' if args.quick else ''}-{time.strftime('%Y-%m-%d', time.gmtime(t0))}"
        ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    print_table(result["summary"])
    for cfg, s in result["summary"].items():
        med = {k: s[k]["median"] for k in ("contention", "contention_off_runq", "gil_wait",
                                           "loop_cpu_ms_per_step", "break_even_step_ms")}
        over = {k: med[k] > 0.05 for k in ("contention", "contention_off_runq", "gil_wait")}
        verdict = ", ".join(f"{k.replace('_', ' ')} {med[k]:+.1%} "
                            f"({'ABOVE' if over[k] else 'below'} 5 %)" for k in over)
        print(f"{cfg}, step time lost to the HTTP loop (median of "
              f"{len(s['contention']['values'])} rounds): {verdict}; the loop's "
              f"{med['loop_cpu_ms_per_step']:.1f} ms CPU/step would pass 5 % of steps under "
              f"{med['break_even_step_ms']:.0f} ms")
        report.setdefault("verdict", {})[cfg] = {"above_5pct": over, **med}
    out.write_text(json.dumps(_rounded(report), separators=(",", ":")))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
