"""Structured outputs beside vLLM: the JSON-schema grammar's cost in throughput and TTFT.

    .venv/bin/python bench/structured.py [--quick] [--servers tandem,vllm] [--url NAME=URL ...]
        [--requests 32] [--requests-b1 8] [--batches 1,16] [--schemas 4] [--max-tokens 256]
        [--ttft-repeats 8] [--rounds 1] [--backend default|xgrammar|llguidance] [--seed 0]

Each server runs alone on the machine, one after another (`bench/servers.py` starts and stops
Tandem's worker and vLLM's OpenAI server on the same model, float32, same CPU settings), or
`--url NAME=URL` benchmarks endpoints already running. Every request is a streamed chat
completion at temperature 0 whose prompt asks for a record following a schema (seeded random
schemas from `tests/structured_schemas.py`: nested objects, enums, bounded arrays, integer
ranges, required fields); the constraint is `response_format: {"type": "json_schema",
"json_schema": {"name", "schema", "strict": true}}`, which both servers take (`--compact` adds
`structured_outputs: {"disable_any_whitespace": true}`, which both merge into it). Grammar
library: each server's default unless `--backend` names one for both (Tandem's default is
llguidance; vLLM's `auto` picks xgrammar for these schemas).

Throughput, per batch size B (B concurrent streams, closed loop, each stream sending its next
request when the last ends):

* `json`: the requests constrained by their schema, `max_tokens` = `--max-tokens`; the grammar
  ends each one (or the cap does: counted as `truncated`). Every output is parsed and checked
  against its schema with `jsonschema` (`valid`).
* `none`: the same prompts, unconstrained, `ignore_eos`, each with `max_tokens` = the length
  its `json` twin produced on the same server, so both modes generate the same number of
  tokens per request and the batch thins out alike: the only difference is the grammar.

Output tokens/s = tokens generated / wall time (first send to last end); the grammar's cost
is 1 - json/none (also shown: TPOT p50 json/none, the decode step's share). With `--rounds R`
each point runs R times (json then none, fresh prompts each round) and the cost is the
median of the per-round costs.

TTFT (sequential requests, `max_tokens` 4, a fresh prompt each so no prefix-cache hit favours
one kind): `cold` has a never-seen schema (a base schema plus a property with a random name,
so neither server's grammar cache has it), `cached` the base schema again (compiled before),
`none` no constraint; the three kinds take turns; medians over `--ttft-repeats`.

Writes raw JSON (with the machine, its load average before and after, and other processes'
CPU share during each point) to `bench/results/structured-<date>.json` and prints a table with
the grammar's cost per server and Tandem/vLLM ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(1, str(BENCH_DIR / "runners"))
sys.path.insert(2, str(REPO))

from _common import Timer  # noqa: E402
from tests.structured_schemas import random_schema  # noqa: E402

import servers  # noqa: E402
from loadgen import STREAM_ERRORS, bench_client, served_model, sse_chunks, stream_error  # noqa: E402

TOPICS = ("a library book", "a weather station", "a customer order", "a hiking trail",
          "a concert", "a laptop", "a city park", "a recipe", "a football match", "a museum",
          "a train connection", "a hotel room", "a bank transfer", "a plant", "a movie",
          "a software bug")
# vLLM's flag for the grammar library, per --backend (Tandem's: --structured-outputs-backend)
VLLM_BACKEND = {"xgrammar": "xgrammar", "llguidance": "guidance"}


@dataclass
class Outcome:
    """One streamed chat completion (seconds on the client's monotonic clock)."""

    ok: bool
    sent_at: float
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    valid: bool | None = None  # constrained: parses as JSON valid against its schema
    invalid_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Job:
    messages: list[dict[str, str]]
    max_tokens: int
    schema: dict[str, Any] | None = None  # the constraint, if any
    ignore_eos: bool = False
    compact: bool = False  # JSON without whitespace (vLLM's disable_any_whitespace)
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, model: str) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "messages": self.messages,
                               "max_tokens": self.max_tokens, "temperature": 0.0,
                               "stream": True, "stream_options": {"include_usage": True},
                               **self.extra}
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.schema is not None:
            out["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "record", "schema": self.schema, "strict": True}}
            if self.compact:  # both servers merge these options into response_format's
                out["structured_outputs"] = {"disable_any_whitespace": True}
        return out


def prompt(schema: dict[str, Any], topic: str, nonce: str = "") -> list[dict[str, str]]:
    head = f"[{nonce}] " if nonce else ""
    return [{"role": "user", "content": (
        f"{head}Describe {topic} as one JSON object following this JSON schema, and "
        f"nothing else: {json.dumps(schema, separators=(',', ':'))}")}]


def check(out: Outcome, schema: dict[str, Any]) -> None:
    """Set `out.valid`: the output parses and satisfies `schema` (jsonschema, Draft 2020-12)."""
    try:
        value = json.loads(out.text)
    except ValueError as exc:
        out.valid, out.invalid_reason = False, f"not JSON ({out.finish_reason}): {exc}"[:200]
        return
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=str)
    out.valid = not errors
    if errors:
        out.invalid_reason = f"schema: {errors[0].message}"[:200]


async def send(client: httpx.AsyncClient, url: str, model: str, job: Job,
               t0: float) -> Outcome:
    """Stream one chat completion; TTFT is the first chunk with content (not the role
    chunk some servers send before any token)."""
    start = time.monotonic()
    out = Outcome(ok=False, sent_at=start - t0)
    parts: list[str] = []
    try:
        async for chunk in sse_chunks(client, f"{url}/v1/chat/completions", job.body(model)):
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if out.ttft is None:
                        out.ttft = time.monotonic() - start
                    parts.append(text)
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
            if chunk.get("usage"):
                out.output_tokens = int(chunk["usage"]["completion_tokens"])
    except STREAM_ERRORS as exc:
        out.error = stream_error(exc)
        return out
    out.e2e = time.monotonic() - start
    out.text = "".join(parts)
    if out.ttft is None:
        out.error = "no content chunk"
    elif job.ignore_eos and out.output_tokens != job.max_tokens:
        out.error = f"got {out.output_tokens} tokens, asked for {job.max_tokens}"
    else:
        out.ok = True
    return out


async def run_closed(url: str, model: str, jobs: list[Job], concurrency: int,
                     timeout_s: float = 900.0) -> tuple[list[Outcome], float]:
    """`jobs` over `concurrency` streams, each sending its next job when the last ends;
    results in job order and the wall time from the first send to the last end."""
    results: list[Outcome | None] = [None] * len(jobs)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(jobs)):
        queue.put_nowait(i)
    async with bench_client(timeout_s) as client:
        t0 = time.monotonic()

        async def stream() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await send(client, url, model, jobs[i], t0)

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return [r for r in results if r is not None], wall


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(outs: list[Outcome], wall: float, timer: Timer) -> dict[str, Any]:
    ok = [o for o in outs if o.ok]
    tokens = sum(o.output_tokens for o in ok)
    s: dict[str, Any] = {
        "requests": len(outs), "completed": len(ok), "wall_s": round(wall, 3),
        "output_tokens": tokens, "tokens_per_request": round(tokens / max(len(ok), 1), 1),
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_s": median([o.ttft for o in ok if o.ttft is not None]),
        "tpot_p50_s": median([t for o in ok if (t := o.tpot) is not None]),
        "finish_reasons": {r: sum(o.finish_reason == r for o in ok)
                           for r in sorted({str(o.finish_reason) for o in ok})},
        "errors": sorted({o.error for o in outs if o.error})[:5],
        **timer.contention()}
    checked = [o for o in ok if o.valid is not None]
    if checked:  # constrained: an output the cap cut short is `truncated`, not judged
        done = [o for o in checked if o.finish_reason != "length"]
        s["finished"] = len(done)
        s["valid"] = sum(bool(o.valid) for o in done)
        s["truncated"] = len(checked) - len(done)
        s["invalid"] = [{"reason": o.invalid_reason, "text": o.text[:300]}
                        for o in done if not o.valid][:5]
        s["truncated_tails"] = [o.text[-120:] for o in checked
                                if o.finish_reason == "length"][:5]
    s["per_request"] = [[o.output_tokens, o.ttft and round(o.ttft, 4),
                         o.e2e and round(o.e2e, 4), o.finish_reason, o.valid] for o in outs]
    return s


def point_jobs(schemas: list[dict[str, Any]], n: int, batch: int, max_tokens: int,
               seed: int, tag: str, compact: bool = False) -> list[Job]:
    """`n` constrained jobs for one batch size: schema i % len(schemas), varied topics; the
    nonce (`tag`: the mode and round) gives every run its own prompts of the same length, so
    no run finds another's in the prefix cache."""
    rng = random.Random(seed * 1000 + batch)
    return [Job(prompt(schemas[i % len(schemas)], rng.choice(TOPICS), f"{tag}-b{batch}-{i}"),
                max_tokens, schemas[i % len(schemas)], compact=compact) for i in range(n)]


def throughput_point(url: str, model: str, schemas: list[dict[str, Any]], n: int, batch: int,
                     args: argparse.Namespace, name: str) -> dict[str, Any]:
    """json then none (each request as long as its json twin of the same round),
    `args.rounds` times."""
    per: dict[str, list[dict[str, Any]]] = {"json": [], "none": []}
    lengths: list[int] | None = None
    for r in range(args.rounds):
        for mode in ("json", "none"):
            jobs = point_jobs(schemas, n, batch, args.max_tokens, args.seed, f"{mode[0]}{r}",
                              args.compact)
            if mode == "none":
                assert lengths is not None
                jobs = [Job(j.messages, max(k, 1), None, ignore_eos=True)
                        for j, k in zip(jobs, lengths, strict=True)]
            with Timer() as timer:
                outs, wall = asyncio.run(run_closed(url, model, jobs, batch))
            if mode == "json":
                for o, j in zip(outs, jobs, strict=True):
                    if o.ok:
                        check(o, j.schema or {})
                lengths = [o.output_tokens if o.ok else j.max_tokens
                           for o, j in zip(outs, jobs, strict=True)]
            s = summarize(outs, wall, timer)
            per[mode].append(s)
            valid = (f", valid {s['valid']}/{s['finished']} (truncated {s['truncated']})"
                     if "valid" in s else "")
            print(f"[{name}] batch {batch} {mode} round {r}: {s['completed']}/{s['requests']} "
                  f"ok, {s['tokens_per_request']} tok/req, {s['output_tok_s']} tok/s{valid}, "
                  f"other CPU {s['other_cpu_share']}", file=sys.stderr, flush=True)
    pairs = list(zip(per["json"], per["none"], strict=True))
    costs = [1 - j["output_tok_s"] / n["output_tok_s"] for j, n in pairs
             if j["output_tok_s"] and n["output_tok_s"]]
    tpot = [j["tpot_p50_s"] / n["tpot_p50_s"] for j, n in pairs
            if j["tpot_p50_s"] and n["tpot_p50_s"]]
    return {"batch": batch, "json": per["json"], "none": per["none"],
            "grammar_cost": median(costs), "grammar_cost_per_round": costs,
            "tpot_json_over_none": median(tpot)}


def cold_schema(base: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """`base` plus an optional integer property with a random name: a schema no grammar cache
    has seen."""
    out = copy.deepcopy(base)
    out["properties"][f"x{rng.getrandbits(48):012x}"] = {"type": "integer"}
    return out


def ttft_run(url: str, model: str, base: dict[str, Any], repeats: int, seed: int,
             name: str, compact: bool = False) -> dict[str, Any]:
    rng = random.Random(seed + 77)
    kinds = ("cold", "cached", "none")
    got: dict[str, list[Outcome]] = {k: [] for k in kinds}
    for i in range(repeats):
        order = kinds if i % 2 == 0 else kinds[::-1]
        for kind in order:
            schema = cold_schema(base, rng) if kind == "cold" else base
            job = Job(prompt(base, TOPICS[i % len(TOPICS)], f"ttft-{kind}-{seed}-{i}"), 4,
                      None if kind == "none" else schema, compact=compact)
            outs, _ = asyncio.run(run_closed(url, model, [job], 1))
            got[kind].append(outs[0])
    out: dict[str, Any] = {}
    for kind, outs in got.items():
        ttfts = [o.ttft for o in outs if o.ok and o.ttft is not None]
        out[kind] = {"p50_s": median(ttfts), "ok": len(ttfts), "requests": len(outs),
                     "all_s": [round(t, 4) for t in ttfts],
                     "errors": sorted({o.error for o in outs if o.error})[:3]}
    print(f"[{name}] TTFT p50: " + ", ".join(
        f"{k} {v['p50_s'] * 1e3:.0f} ms" if v["p50_s"] is not None else f"{k} n/a"
        for k, v in out.items()), file=sys.stderr, flush=True)
    return out


def bench_server(name: str, url: str, args: argparse.Namespace,
                 schemas: list[dict[str, Any]]) -> dict[str, Any]:
    model = asyncio.run(served_model(url))
    # warm-up, not measured: first-call work (graph compiles, the grammar library's
    # tokenizer setup) and every schema's compile (the throughput points run on cached
    # grammars; the TTFT runs measure a cold compile on its own)
    warm_schema = random_schema(args.seed + 999, max_depth=2)
    warm = [Job(prompt(warm_schema, "a test", "warm-a"), 8, None),
            Job(prompt(warm_schema, "a test", "warm-b"), 16, warm_schema),
            *(Job(prompt(s, "a test", f"warm-{i}"), 8, s, compact=args.compact)
              for i, s in enumerate(schemas))]
    outs, _ = asyncio.run(run_closed(url, model, warm, 1))
    if not all(o.ok for o in outs):
        raise RuntimeError(f"[{name}] warm-up failed: {[o.error for o in outs]}")
    res: dict[str, Any] = {"model": model, "throughput": [], "ttft": None}
    for batch in args.batches:
        n = args.requests_b1 if batch == 1 else args.requests
        res["throughput"].append(throughput_point(url, model, schemas, n, batch, args, name))
    res["ttft"] = ttft_run(url, model, schemas[0], args.ttft_repeats, args.seed, name,
                           args.compact)
    return res


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Tandem / vLLM output tokens/s per point and mode (>1: Tandem more), and vLLM / Tandem
    TTFT p50 per kind (>1: Tandem faster)."""
    t, v = results.get("tandem"), results.get("vllm")
    if not t or not v:
        return {}
    out: dict[str, Any] = {"throughput_tandem_over_vllm": {}, "ttft_vllm_over_tandem": {}}
    for a, b in zip(t["throughput"], v["throughput"], strict=True):
        for mode in ("json", "none"):
            x = statistics.median(s["output_tok_s"] for s in a[mode])
            y = statistics.median(s["output_tok_s"] for s in b[mode])
            out["throughput_tandem_over_vllm"][f"b{a['batch']}-{mode}"] = round(x / y, 3)
    for kind in ("cold", "cached", "none"):
        x, y = t["ttft"][kind]["p50_s"], v["ttft"][kind]["p50_s"]
        if x and y:
            out["ttft_vllm_over_tandem"][kind] = round(y / x, 3)
    return out


def print_table(results: dict[str, Any], rat: dict[str, Any]) -> None:
    print(f"{'server':7} {'batch':>5} {'mode':5} {'ok':>6} {'valid':>6} {'cut':>4} {'tok/req':>7} "
          f"{'tok/s':>7} {'tpot p50':>8} {'other cpu':>9}")
    for name, res in results.items():
        for p in res["throughput"]:
            # the round whose json tok/s is the median, both modes (their lengths match)
            order = sorted(range(len(p["json"])), key=lambda k: p["json"][k]["output_tok_s"] or 0)
            for mode in ("none", "json"):
                s = p[mode][order[len(order) // 2]]
                valid = f"{s['valid']}/{s['finished']}" if "valid" in s else "-"
                trunc = s.get("truncated", "-")
                tpot = f"{s['tpot_p50_s'] * 1e3:.1f}ms" if s["tpot_p50_s"] else "-"
                print(f"{name:7} {p['batch']:>5} {mode:5} {s['completed']:>3}/{s['requests']:<2} "
                      f"{valid:>6} {trunc!s:>4} {s['tokens_per_request']:>7} "
                      f"{s['output_tok_s']:>7} {tpot:>8} {s['other_cpu_share']!s:>9}")
            if p["grammar_cost"] is not None:
                tpot = p["tpot_json_over_none"]
                print(f"{'':7} {p['batch']:>5} grammar cost (1 - json/none tok/s): "
                      f"{p['grammar_cost'] * 100:.1f}%"
                      + (f"; TPOT json/none {tpot:.2f}x" if tpot else ""))
    for name, res in results.items():
        tt = res["ttft"]
        cells = ", ".join(f"{k} {tt[k]['p50_s'] * 1e3:.0f} ms" if tt[k]["p50_s"] else f"{k} -"
                          for k in ("none", "cached", "cold"))
        print(f"TTFT p50 {name}: {cells}")
    if rat:
        print("Tandem/vLLM output tok/s: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in rat["throughput_tandem_over_vllm"].items()))
        print("vLLM/Tandem TTFT p50: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in rat["ttft_vllm_over_tandem"].items()))


def server_specs(args: argparse.Namespace) -> dict[str, servers.ServerSpec]:
    specs: dict[str, servers.ServerSpec] = {}
    for name in args.servers:
        if name == "tandem":
            extra = args.tandem_args.split()
            if args.backend != "default":
                extra += ["--structured-outputs-backend", args.backend]
            specs[name] = servers.tandem_spec(extra)
        elif name == "vllm":
            if not servers.vllm_available():
                print("[vllm] skipped: run bench/setup_vllm.sh first", file=sys.stderr)
                continue
            extra = args.vllm_args.split()
            if args.backend != "default":
                extra += ["--structured-outputs-config.backend", VLLM_BACKEND[args.backend]]
            specs[name] = servers.vllm_spec(extra)
    return specs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer requests and repeats (a few minutes per server)")
    ap.add_argument("--servers", default="tandem,vllm")
    ap.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                    help="benchmark a running endpoint instead of starting servers")
    ap.add_argument("--batches", default="1,16", help="concurrent streams, comma-separated")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per point at batch > 1 (default 32; 16 with --quick)")
    ap.add_argument("--requests-b1", type=int, default=None,
                    help="requests per point at batch 1 (default 8; 3 with --quick)")
    ap.add_argument("--schemas", type=int, default=4, help="seeded random schemas per point")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="cap on a constrained output (one that reaches it is 'truncated')")
    ap.add_argument("--ttft-repeats", type=int, default=None,
                    help="requests per TTFT kind (default 8; 3 with --quick)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per throughput point (json/none order alternating)")
    ap.add_argument("--backend", choices=("default", "xgrammar", "llguidance"),
                    default="default", help="grammar library on both servers (default: "
                    "each server's own default)")
    ap.add_argument("--compact", action="store_true",
                    help="constrained requests also send structured_outputs."
                    "disable_any_whitespace (JSON without whitespace)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tandem-args", default="", help="extra `tandem worker` arguments")
    ap.add_argument("--vllm-args", default="", help="extra vLLM server arguments")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        ap.error(f"--batches: integers, comma-separated, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        ap.error("--batches: at least one batch size, each >= 1")
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = set(args.servers) - {"tandem", "vllm"}
    if unknown:
        ap.error(f"--servers: unknown {sorted(unknown)}; choose from tandem, vllm")
    args.requests = args.requests or (16 if args.quick else 32)
    args.requests_b1 = args.requests_b1 or (3 if args.quick else 8)
    args.ttft_repeats = args.ttft_repeats or (3 if args.quick else 8)
    for flag in ("requests", "requests_b1", "ttft_repeats", "schemas", "max_tokens", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be >= 1")

    from offline_throughput import machine_info

    schemas = [random_schema(args.seed + i) for i in range(args.schemas)]
    machine = machine_info()
    results: dict[str, Any] = {}
    if args.url:
        for name, _, url in (item.partition("=") for item in args.url):
            results[name] = bench_server(name, url.rstrip("/"), args, schemas)
    else:
        for name, spec in server_specs(args).items():
            with servers.launched(spec) as url:
                results[name] = bench_server(name, url, args, schemas)
    if not results:
        print("no server to benchmark", file=sys.stderr)
        return 1
    rat = ratios(results)
    report = {"benchmark": "structured", "date": dt.date.today().isoformat(),
              "machine": machine, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
              "quick": args.quick, "seed": args.seed, "backend": args.backend,
              "settings": {k: v for k, v in vars(args).items() if k not in ("url", "out")},
              "schemas": schemas, "servers": results, "ratios": rat}
    print_table(results, rat)
    suffix = "-quick" if args.quick else ""
    out = Path(args.out or BENCH_DIR / "results" / f"structured{suffix}-{report['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    failed = [s for r in results.values() for p in r["throughput"] for m in ("json", "none")
              for s in p[m] if s["completed"] != s["requests"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
