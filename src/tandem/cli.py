"""`tandem` command line: thin wiring only.

* `tandem serve`    - the embedded default: a local deployment on the bundled model as
  separate processes (the router in front of `--workers N` workers). Prints the URL and a
  curl example; Ctrl-C stops every process it started.
* `tandem worker`   - one worker process (`--role both|prefill|decode`).
* `tandem router`   - the KV-cache-aware router in front of workers.
* `tandem generate` - one-shot offline generation.
* `tandem bench offline|serve` - runs `bench/offline_throughput.py` or `bench/serve.py`
  (e.g. `tandem bench serve --url tandem=http://host:8000`) from a source checkout.
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tandem.router.main import add_router_args
from tandem.serving.worker import add_engine_args, add_server_args, engine_config

BENCH_SCRIPTS = {"offline": "offline_throughput.py", "serve": "serve.py"}


def _generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    llm = LLM(**vars(engine_config(args)))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def _die_with_parent() -> None:
    """In the child: get SIGTERM if `tandem serve` itself dies (Linux), so no orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group (workers drain), then SIGKILL what outlives the grace."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 40
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _serve(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Start the local deployment - `--workers N` aggregated workers on free ports behind
    the router on `--port` - as child processes, and supervise them until Ctrl-C."""
    url = f"http://{args.host}:{args.port}"
    base = [sys.executable, "-m", "tandem.cli", "--log-level", args.log_level]
    worker_urls, procs = [], []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if args.workers > 1 and "--num-threads" not in passthrough:
        # workers on one host share its cores: split them instead of oversubscribing
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        passthrough = [*passthrough, "--num-threads", str(max(1, cores // args.workers))]
    try:
        for _ in range(args.workers):
            port = _free_port(args.host)
            worker_urls.append(f"http://{args.host}:{port}")
            procs.append(_spawn([*base, "worker", "--host", args.host, "--port", str(port),
                                 "--grpc-port", str(_free_port(args.host)), *passthrough]))
        procs.append(_spawn([*base, "router", "--host", args.host, "--port", str(args.port),
                             "--workers", ",".join(worker_urls)]))
        print(f"starting {args.workers} worker(s) behind a router on {url} "
              "(the first start prepares the model) ...", flush=True)
        for wurl, proc in zip(worker_urls, procs, strict=False):
            if not _wait_ready(wurl, proc, timeout=600):
                if not stopping:
                    print(f"the worker at {wurl} did not become ready", file=sys.stderr)
                return 1
        if not _wait_ready(url, procs[-1], timeout=60):
            if not stopping:
                print("the router did not become ready", file=sys.stderr)
            return 1
        print(f"\nTandem is serving the bundled model at {url}\n\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
              "\"max_tokens\": 32}'\n\n"
              "Press Ctrl-C to stop.", flush=True)
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        if not stopping:
            dead = next(p for p in procs if p.poll() is not None)
            print(f"a child process exited ({dead.returncode}); stopping", file=sys.stderr)
            return dead.returncode or 1
        return 0
    finally:
        _stop_all(procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the embedded default deployment")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="the router's port")
    serve.add_argument("--workers", type=int, default=1, help="aggregated workers")

    router = sub.add_parser("router", help="run the KV-cache-aware router")
    add_router_args(router)

    worker = sub.add_parser("worker", help="run one worker process")
    add_engine_args(worker)
    add_server_args(worker)

    gen = sub.add_parser("generate", help="generate completions offline")
    add_engine_args(gen)
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")

    bench = sub.add_parser("bench", help="benchmarks (from a source checkout)")
    bench.add_argument("kind", choices=sorted(BENCH_SCRIPTS))
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args, extra)  # unknown options go to the worker (engine args)
    if args.command == "worker":
        from tandem.serving.worker import run

        return run(args)
    if args.command == "router":
        from tandem.router.main import run as run_router

        return run_router(args)
    if args.command == "generate":
        return _generate(args)
    script = Path.cwd() / "bench" / BENCH_SCRIPTS[args.kind]
    if not script.exists():
        parser.error(f"{script} not found: run from a Tandem source checkout")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
