"""KV sharing across replicas: TTFT of a prefix miss served by recompute, a peer pull, the host
tier and the disk tier, in one run.

    .venv/bin/python bench/kv_sharing.py [--quick] [--requests N] [--prefix-tokens T]
        [--rate R] [--holder-load K] [--modes recompute,peer,host,disk] [--seed N]

Two `tandem worker`s of the bundled model (SmolLM2-135M, float32), one CPU core each
(`taskset`, one engine thread), standing in for two replicas: the holder has served every
request's prefix before (`--requests` distinct prefixes of `--prefix-tokens` tokens, each
prefilled there once), and during the measurement it is kept saturated by `--holder-load`
concurrent streams of long decodes, so the requests go to the other replica, the target.
Each request is its prefix plus a fresh 32-token suffix, 4 output tokens, arriving open-loop
(Poisson, `--rate` per second, seeded: the same schedule in every mode), and is the first on
the target for its prefix. Modes:

* recompute: the target computes the whole prompt;
* peer: every request goes to the target, named the holder as its KV peer: it pulls the
  prefix's blocks over kvtransfer (gRPC) before computing the suffix. The bench signs
  `x-tandem-kv-peer` itself with the run's worker key, exactly as the router does, and adds
  `x-tandem-kv-peer-blocks` (the prefix's blocks);
* peer-router: the same workers behind `tandem router --peer-pull` (with the worker key): the
  router picks the worker and names the holder itself. Its TTFT mixes the router's picks (the
  holder itself, when its cost model finds it cheaper, or the target with a pull); `routed`
  counts how many requests went which way;
* host / disk: the target alone, with a host tier (`--kv-offload-host-bytes`; disk: a
  `HOST_FOR_DISK` host tier, far smaller than one prefix, spilling to a disk tier of
  `--kv-offload-disk-path`, `--kv-offload-disk-bytes`) and a device pool of three prompts: it
  prefilled every prefix, then three unrelated prompts (so every prefix was evicted from the
  device pool to the tier), then serves the requests, loading each prefix from the tier. A
  worker that refuses those flags makes the mode skipped, with the reason recorded.

Reports TTFT p50/p99 per mode, each mode's p50 ratio to recompute (target: at most 0.5 for
prefixes of 2k tokens or more), whether each mode's greedy tokens equal recompute's, and the
target's peer-pull counters. Writes `bench/results/kv_sharing[-quick]-<date>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime as dt
import functools
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO / "src"))

from loadgen import arrival_times, bench_client, percentiles  # noqa: E402
from servers import LOG_DIR, ServerSpec, free_port, launched  # noqa: E402
from tandem.protocol.bundled import BUNDLED_NAME  # noqa: E402
from tandem.protocol.signing import SIGNATURE_HEADER, sign  # noqa: E402
from tandem.protocol.web import (  # noqa: E402
    PEER_BLOCKS_HEADER,  # noqa: E402
    PEER_HEADER,
    forward_target,
)
from tandem.serving.embedded import worker_auth_key_file  # noqa: E402

MODES = ("recompute", "peer", "peer-router", "host", "disk")
TARGET_TTFT_RATIO = 0.5
SUFFIX = 32
OUTPUT = 4
BLOCK = 16  # the worker's default block size
HOLDER_DECODE = (64, 256)  # the holder's background streams: prompt, output tokens
HOST_FOR_DISK = 16 << 20  # the disk mode's host tier: about 20 blocks, so prefixes spill


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


@functools.cache
def worker_auth_key() -> tuple[str, bytes]:
    """(path, key): this run's own worker-auth key, in a private 0600 file (as `tandem
    serve` makes it; a shared bench cache may be rewritten by another run meanwhile)."""
    path = worker_auth_key_file()
    atexit.register(Path(path).unlink, missing_ok=True)
    return path, Path(path).read_bytes()


def cli(command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", command,
            "--worker-auth-key-file", worker_auth_key()[0], *args]


def worker(name: str, core: int, blocks: int, grpc_port: int | None,
           extra: tuple[str, ...] = ()) -> ServerSpec:
    argv = ["taskset", "-c", str(core), *cli(
        "worker", "--port", "{port}", "--num-threads", "1", "--num-kv-blocks", str(blocks),
        "--max-num-batched-tokens", "2048", *extra)]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]
    spec = ServerSpec(f"kv-sharing-{name}", argv, {"PYTHONPATH": str(REPO / "src")})
    spec.start_timeout_s = 300.0
    return spec


@dataclass
class Workload:
    prefixes: list[list[int]]
    prompts: list[list[int]]
    offsets: list[float]

    @classmethod
    def make(cls, n: int, prefix_tokens: int, rate: float, seed: int) -> Workload:
        rng = random.Random(seed)

        def ids(k: int) -> list[int]:
            return [rng.randrange(100, 40000) for _ in range(k)]

        prefixes = [ids(prefix_tokens) for _ in range(n)]
        return cls(prefixes, [p + ids(SUFFIX) for p in prefixes],
                   arrival_times(n, rate, seed))


@dataclass
class Result:
    ttft: float | None = None
    text: str = ""
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class ModeRun:
    mode: str
    results: list[Result] = field(default_factory=list)
    skipped: str | None = None
    via: str = ""
    target_metrics: dict[str, float] = field(default_factory=dict)
    holder_metrics: dict[str, float] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        ok = [r for r in self.results if r.error is None and r.ttft is not None]
        return {"mode": self.mode, "skipped": self.skipped, "via": self.via,
                "requests": len(self.results), "ok": len(ok),
                "errors": sorted({r.error for r in self.results if r.error})[:5],
                "ttft": percentiles([r.ttft for r in ok]),
                "cached_tokens": percentiles([float(r.cached_tokens) for r in ok]),
                "ttfts": [r.ttft for r in self.results],
                "texts": [r.text for r in self.results],
                "target_metrics": self.target_metrics,
                "holder_metrics": self.holder_metrics, "routed": self.routed}


def payload(prompt: list[int], max_tokens: int = OUTPUT) -> bytes:
    return json.dumps({"model": BUNDLED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def stream(client: httpx.AsyncClient, url: str, body: bytes,
                 headers: dict[str, str]) -> Result:
    """One streamed completion: TTFT (send -> first token chunk), text, cached tokens."""
    res = Result()
    t0 = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", content=body,
                                 headers={"Content-Type": "application/json", **headers}) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("choices"):
                    if res.ttft is None:
                        res.ttft = time.monotonic() - t0
                    res.text += chunk["choices"][0].get("text", "")
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def open_loop(url: str, work: Workload, headers_for) -> list[Result]:  # noqa: ANN001
    async with bench_client(600.0) as client:
        t0 = time.monotonic()

        async def later(prompt: list[int], at: float) -> Result:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            body = payload(prompt)
            return await stream(client, url, body, headers_for(body))

        return list(await asyncio.gather(*(later(p, at) for p, at in
                                           zip(work.prompts, work.offsets, strict=True))))


async def with_holder_load(holder: str, streams: int, work) -> list[Result]:  # noqa: ANN001
    """Run `work` (a coroutine) while `streams` long decodes keep the holder busy."""
    stop = asyncio.Event()
    rng = random.Random(99)

    async def busy(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            prompt = [rng.randrange(100, 40000) for _ in range(HOLDER_DECODE[0])]
            await stream(client, holder, payload(prompt, HOLDER_DECODE[1]), {})

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        tasks = [asyncio.ensure_future(busy(client)) for _ in range(streams)]
        await asyncio.sleep(1.0 if streams else 0.0)  # saturated before the first request
        try:
            return await work
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def warm(url: str, prefixes: list[list[int]]) -> None:
    """Prefill every prefix on `url` (one token each), in order."""
    for p in prefixes:
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": BUNDLED_NAME, "prompt": p + [13], "max_tokens": 1, "temperature": 0.0})
        r.raise_for_status()


def scrape(url: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(prefixes):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


METRICS = ("tandem_kv_peer_pulls_total", "tandem_kv_peer_pulled_blocks_total",
           "vllm:prefix_cache_hits", "vllm:prompt_tokens_total", "tandem_kv_tier_loads_total",
           "tandem_kv_tier_validation_failures_total")


def run_mode(mode: str, work: Workload, args: argparse.Namespace,
             cores: list[int]) -> ModeRun:
    run = ModeRun(mode)
    c0, c1 = cores[0], cores[-1]
    blocks_per_prompt = -(-(args.prefix_tokens + SUFFIX + OUTPUT) // BLOCK)
    big = blocks_per_prompt * (len(work.prompts) + 1) + 128  # every prefix, and room to work
    with contextlib.ExitStack() as stack:
        if mode in ("recompute", "peer", "peer-router"):
            hgrpc = free_port()
            holder = stack.enter_context(launched(worker("holder", c0, big, hgrpc)))
            target = stack.enter_context(launched(worker("target", c1, big, free_port())))
            log(f"[{mode}] warming the holder with {len(work.prefixes)} prefixes")
            warm(holder, work.prefixes)
            url, headers_for = target, (lambda body: {})
            if mode == "peer-router":
                url = stack.enter_context(launched(ServerSpec(
                    "kv-sharing-router", cli("router", "--port", "{port}", "--workers",
                                             f"{holder},{target}", "--peer-pull"),
                    {"PYTHONPATH": str(REPO / "src")})))
                run.via = "router --peer-pull"
            elif mode == "peer":
                peer, key = f"127.0.0.1:{hgrpc}", worker_auth_key()[1]
                signed_for = forward_target(None, peer)

                held = str(args.prefix_tokens // BLOCK)  # the router's hint

                def headers_for(body: bytes) -> dict[str, str]:
                    return {PEER_HEADER: peer, PEER_BLOCKS_HEADER: held,
                            SIGNATURE_HEADER: sign(key, body, signed_for)}
                run.via = "signed x-tandem-kv-peer (as the router sends it)"
            run.results = asyncio.run(with_holder_load(
                holder, args.holder_load, open_loop(url, work, headers_for)))
            run.holder_metrics = scrape(holder, METRICS)  # the router may pick the holder
            if mode == "peer-router":
                pulls = sum(v for k, v in scrape(target, METRICS).items()
                            if k.startswith("tandem_kv_peer_pulls_total"))
                hits = sum(v for k, v in run.holder_metrics.items()
                           if k.startswith("vllm:prefix_cache_hits"))
                run.routed = {"target_with_pull": int(pulls),
                              "holder_prefix_hit": int(hits) // args.prefix_tokens}
        else:
            tier = tempfile.mkdtemp(prefix="kv-sharing-disk-")
            flags = (("--kv-offload-host-bytes", str(args.tier_bytes)) if mode == "host"
                     else ("--kv-offload-disk-path", tier, "--kv-offload-disk-bytes",
                           str(args.tier_bytes), "--kv-offload-host-bytes",
                           str(HOST_FOR_DISK)))
            try:
                target = stack.enter_context(launched(worker(
                    mode, c1, blocks_per_prompt * 3, None, flags)))
            except (RuntimeError, TimeoutError) as exc:
                logf = LOG_DIR / f"serve-kv-sharing-{mode}.log"
                tail = logf.read_text()[-400:] if logf.exists() else ""
                run.skipped = f"the worker refused {flags[0]}: {exc}; {tail.strip()}"
                log(f"[{mode}] skipped: {run.skipped}")
                return run
            log(f"[{mode}] warming the target (evicting into the {mode} tier)")
            rng = random.Random(args.seed + 1)
            fillers = [[rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]
                       for _ in range(3)]  # the device pool's worth: every prefix evicted
            warm(target, work.prefixes + fillers)
            run.results = asyncio.run(open_loop(target, work, lambda body: {}))
        run.target_metrics = scrape(target, METRICS)
    ok = [r.ttft for r in run.results if r.error is None and r.ttft is not None]
    if ok:
        p = percentiles(ok)
        log(f"[{mode}] {len(ok)}/{len(run.results)} ok, ttft p50 {p['p50']:.3f} s, "
            f"p99 {p['p99']:.3f} s")
    return run


def parse_modes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in MODES for n in names):
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="4 requests of 2,048-token prefixes at 0.05/s, 2 holder streams")
    ap.add_argument("--requests", type=int, default=16, help="distinct prefixes = requests")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--rate", type=float, default=0.2, help="arrivals per second")
    ap.add_argument("--holder-load", type=int, default=4,
                    help="concurrent long decodes keeping the holder busy")
    ap.add_argument("--tier-bytes", type=int, default=4 << 30,
                    help="the host or disk tier's size, bytes")
    ap.add_argument("--modes", type=parse_modes, default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.prefix_tokens < BLOCK or args.rate <= 0:
        ap.error("--requests >= 1, --prefix-tokens >= 16 and --rate > 0")
    if args.quick:
        args.requests, args.rate, args.holder_load = 4, 0.05, 2
    work = Workload.make(args.requests, args.prefix_tokens, args.rate, args.seed)
    cores = sorted(os.sched_getaffinity(0))
    report: dict = {
        "benchmark": "kv_sharing", "date": dt.date.today().isoformat(), "quick": args.quick,
        "model": BUNDLED_NAME, "requests": args.requests, "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": SUFFIX, "output_tokens": OUTPUT, "rate": args.rate,
        "holder_load": args.holder_load, "seed": args.seed,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "loadavg": os.getloadavg()},
        "modes": []}
    for mode in args.modes:
        report["modes"].append(run_mode(mode, work, args, cores).to_json())
    base = next((m for m in report["modes"] if m["mode"] == "recompute" and m["ok"]), None)
    for m in report["modes"]:
        m["ttft_p50_ratio_to_recompute"] = (m["ttft"]["p50"] / base["ttft"]["p50"]
                                            if base and m["ok"] else None)
    for m in report["modes"]:  # greedy: every mode must give recompute's text
        m["texts_equal_recompute"] = (m["texts"] == base["texts"]
                                      if base and m["ok"] == m["requests"] > 0 else None)
    out = Path(args.out) if args.out else BENCH_DIR / "results" / (
        f"kv_sharing{'-quick' if args.quick else ''}-{report['date']}.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"\n{args.requests} requests, {args.prefix_tokens}-token prefixes, {args.rate:g}/s, "
          f"holder busy with {args.holder_load} streams")
    print(f"{'mode':12s} {'ok':>5s} {'ttft p50':>9s} {'ttft p99':>9s} {'p50/recompute':>14s}")
    for m in report["modes"]:
        if m["skipped"]:
            print(f"{m['mode']:12s} skipped: {m['skipped'][:200]}")
            continue
        ratio = m["ttft_p50_ratio_to_recompute"]
        print(f"{m['mode']:12s} {m['ok']:5d} {m['ttft']['p50']:9.3f} {m['ttft']['p99']:9.3f} "
              f"{'' if ratio is None else f'{ratio:14.2f}'}")
    for m in report["modes"]:
        ratio = m["ttft_p50_ratio_to_recompute"]
        if m["mode"] == "peer-router" and ratio is not None:
            print(f"peer-router: TTFT p50 {1 / ratio:.2f}x lower than recompute, routed "
                  f"{m['routed']}; same text as recompute: {m['texts_equal_recompute']}")
        elif m["mode"] != "recompute" and ratio is not None:
            verdict = "met" if ratio <= TARGET_TTFT_RATIO else "MISSED"
            print(f"{m['mode']}: TTFT p50 {1 / ratio:.2f}x lower than recompute (target >= "
                  f"{1 / TARGET_TTFT_RATIO:g}x): {verdict}; same text as recompute: "
                  f"{m['texts_equal_recompute']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
