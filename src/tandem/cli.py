"""`tandem` command line: thin wiring only.

* `tandem serve`    - the embedded default: a local deployment on the bundled model as
  separate processes (the router in front of `--workers N` workers, or of `--prefill N`
  prefill and `--decode M` decode workers for P/D), sharing a fresh random worker-auth key
  (a 0600 temp file, removed at exit). Prints the URL and a curl example; Ctrl-C stops
  every process it started.
* `tandem worker`   - one worker process (`--role both|prefill|decode`).
* `tandem router`   - the KV-cache-aware router in front of workers.
* `tandem generate` - one-shot offline generation.
* `tandem operator` - the Kubernetes operator (kopf) for InferenceServices; imports neither
  torch nor the engine (`tandem.operator.cli`).
* `tandem render -f FILE` - what the operator would apply for an InferenceService, as YAML
  (`tandem.operator.dryrun`; no cluster, no torch).
* `tandem bench offline|serve` - runs `bench/offline_throughput.py` or `bench/serve.py`
  (e.g. `tandem bench serve --url tandem=http://host:8000`) from a source checkout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.operator.cli import add_operator_args
from tandem.operator.dryrun import add_render_args
from tandem.protocol.cli_args import busy_message, busy_ports, port_number, positive_int

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig

BENCH_SCRIPTS = {"offline": "offline_throughput.py", "serve": "serve.py"}


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tandem import LLM, SamplingParams
    from tandem.engine.errors import InvalidRequestError
    from tandem.serving.worker import engine_config

    config = engine_config(args)  # both checked before the model loads
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed)
    except InvalidRequestError as exc:  # e.g. --max-tokens -3: a usage error
        flag = f"--{exc.param.replace('_', '-')}" if exc.param else "sampling"
        parser.error(f"argument {flag}: {str(exc).removeprefix(f'{exc.param} ')}")
    llm = LLM(**vars(config))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float, workers: int = 0) -> bool:
    """`url`/ready answers 200 (and, for the router, reports `workers` routable ones)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                if resp.status == 200 and (
                        not workers or json.load(resp).get("ready_workers", 0) >= workers):
                    return True
        except (OSError, ValueError):
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


def _spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent,
                            env={**os.environ, **env} if env else None)


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


@dataclass
class _Deployment:
    """What `tandem serve` starts: (role, base URL, command) per worker, then the router;
    with GPUs, each worker's extra environment (its CUDA_VISIBLE_DEVICES) and start wave
    (workers sharing a GPU start one after another, each profiling its memory alone)."""

    workers: list[tuple[str, str, list[str]]]
    router: list[str]
    envs: list[dict[str, str]]
    waves: list[int]

    def describe(self) -> str:
        counts = Counter(role for role, _, _ in self.workers)
        if set(counts) == {"both"}:
            return f"{counts['both']} worker(s)"
        names = {"both": "aggregated", "prefill": "prefill", "decode": "decode"}
        return " + ".join(f"{counts[r]} {names[r]}" for r in names if counts[r]) + " workers"


def _roles(args: argparse.Namespace) -> list[str]:
    """One role per worker: `--workers` aggregated ones (default 1 without P/D), then
    `--prefill` prefill and `--decode` decode workers (both or neither)."""
    if min(args.workers or 0, args.prefill, args.decode) < 0:
        raise SystemExit("tandem serve: worker counts must be >= 0")
    if (args.prefill > 0) != (args.decode > 0):
        raise SystemExit("tandem serve: --prefill and --decode go together (P/D needs both)")
    both = args.workers if args.workers is not None else (0 if args.prefill else 1)
    roles = ["both"] * both + ["prefill"] * args.prefill + ["decode"] * args.decode
    if not roles:
        raise SystemExit("tandem serve: no workers to start")
    return roles


def _plan(args: argparse.Namespace, passthrough: list[str],
          free_port: Callable[[str], int] | None = None,
          auth_key_file: str | None = None,
          gpus: list[str] | None = None) -> _Deployment:
    """The worker and router command lines, each worker on free HTTP and gRPC ports; with
    `auth_key_file`, every process gets it as `--worker-auth-key-file` and every worker
    `--require-signed-requests` (it serves only the router). `gpus`: the GPUs
    to hand out (None: `visible_gpus()`)."""
    from tandem.serving.gpus import gpu_plan, visible_gpus  # not on the operator's path

    if free_port is None:
        from tandem.serving.ports import free_port
    base = [sys.executable, "-m", "tandem.cli", "--log-level", args.log_level]
    roles = _roles(args)
    envs, waves, gpu_flags = gpu_plan(len(roles), passthrough,
                                      visible_gpus() if gpus is None else gpus)
    if len(roles) > 1 and "--num-threads" not in passthrough:
        # workers on one host share its cores: split them instead of oversubscribing
        from tandem.engine.cpu_tuning import usable_cores

        passthrough = [*passthrough, "--num-threads", str(max(1, usable_cores() // len(roles)))]
    auth = ["--worker-auth-key-file", auth_key_file] if auth_key_file else []
    signed_only = ["--require-signed-requests"] if auth_key_file else []  # the router's only
    workers = []
    for role, extra in zip(roles, gpu_flags, strict=True):
        port = free_port(args.host)
        workers.append((role, f"http://{args.host}:{port}", [
            *base, "worker", "--host", args.host, "--port", str(port),
            "--grpc-port", str(free_port(args.host)), "--role", role, *auth, *signed_only,
            *passthrough,
            *extra]))
    router = [*base, "router", "--host", args.host, "--port", str(args.port),
              "--workers", ",".join(url for _, url, _ in workers), *auth,
              *_tls_flags(passthrough)]
    if args.pd_threshold is not None:
        router += ["--pd-threshold", str(args.pd_threshold)]
    if args.pd_max_prefill_queue is not None:
        router += ["--pd-max-prefill-queue", str(args.pd_max_prefill_queue)]
    if args.pd_max_local_prefill is not None:
        router += ["--pd-max-local-prefill", str(args.pd_max_local_prefill)]
    return _Deployment(workers, router, envs, waves)


TLS_FLAGS = ("--grpc-tls-dir", "--grpc-tls-server-name")


def _tls_flags(passthrough: list[str]) -> list[str]:
    """The gRPC TLS flags among the workers' arguments: the router needs the same ones to
    reach the workers' gRPC (KV events, load)."""
    out = []
    for i, arg in enumerate(passthrough):
        if arg in TLS_FLAGS and i + 1 < len(passthrough):
            out += [arg, passthrough[i + 1]]
        elif arg.split("=", 1)[0] in TLS_FLAGS and "=" in arg:
            out.append(arg)
    return out


def _serve(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Start the local deployment (`_plan`: workers on free ports behind the router on
    `--port`) as child processes, and supervise them until Ctrl-C."""
    url = f"http://{args.host}:{args.port}"
    served = _check_worker_flags(passthrough).model_name
    busy = busy_ports(args.host, [("--port", args.port)])
    if busy:  # before any worker loads the model
        print(busy_message("tandem serve", busy), file=sys.stderr)
        return 1
    key_file = _worker_auth_key_file()
    try:
        deployment = _plan(args, passthrough, auth_key_file=key_file)
    except ValueError as exc:  # e.g. fewer GPUs than --tensor-parallel-size
        os.unlink(key_file)
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        os.unlink(key_file)
        raise
    worker_urls = [wurl for _, wurl, _ in deployment.workers]
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        print(f"starting {deployment.describe()} behind a router on {url} "
              "(the first start prepares the model) ...", flush=True)
        late = _start_workers(deployment, procs)
        if late is not None:
            if not stopping:
                print(f"the worker at {late} did not become ready", file=sys.stderr)
            return 1
        procs.append(_spawn(deployment.router))
        for wurl, proc in zip(worker_urls, procs, strict=False):
            if not _wait_ready(wurl, proc, timeout=600):
                if not stopping:
                    print(f"the worker at {wurl} did not become ready", file=sys.stderr)
                return 1
        if not _wait_ready(url, procs[-1], timeout=60, workers=len(worker_urls)):
            if not stopping:
                print("the router did not become ready", file=sys.stderr)
            return 1
        roles = ", ".join(f"{wurl} ({role})" for role, wurl, _ in deployment.workers)
        print(f"\nTandem is serving {served} at {url}\nworkers: {roles}\n\n"
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
        os.unlink(key_file)


def _check_worker_flags(passthrough: list[str]) -> EngineConfig:
    """Before anything starts: the flags every worker gets (engine and server flags, e.g.
    `--quantization int4 --kv-cache-dtype fp8`) parse as `tandem worker` parses them and make
    a valid EngineConfig (returned); else exit 2 with argparse's or the ConfigError's
    message."""
    from tandem.engine.errors import ConfigError
    from tandem.serving.worker import add_engine_args, add_server_args, engine_config

    p = argparse.ArgumentParser(prog="tandem serve (worker flags)")
    add_engine_args(p)
    add_server_args(p)
    try:
        return engine_config(p.parse_args(passthrough), serving=True)
    except ConfigError as exc:
        p.error(str(exc))


def _start_workers(deployment: _Deployment, procs: list[subprocess.Popen]) -> str | None:
    """Spawn the workers (appended to `procs`) wave by wave: a wave starts once every worker
    before it is ready, so GPU-sharing workers size their memory one at a time. Returns the
    URL of a worker that did not become ready, else None."""
    waves, envs = deployment.waves, deployment.envs
    for i, (_, _, cmd) in enumerate(deployment.workers):
        if i and waves[i] != waves[i - 1]:
            for (_, url, _), proc in zip(deployment.workers[:i], procs, strict=False):
                if not _wait_ready(url, proc, timeout=600):
                    return url
        procs.append(_spawn(cmd, envs[i]))
    return None


def _worker_auth_key_file() -> str:
    """A fresh random key for this run's router and workers (they sign and check requests
    with it), in a file only this user can read; the caller removes it."""
    import secrets
    import tempfile

    fd, path = tempfile.mkstemp(prefix="tandem-worker-auth-")  # mode 0600
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path


def _command(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (before parsing: `operator` skips the engine's
    imports, which the other subcommands' arguments need; so does `render`)."""
    args = iter(argv)
    for a in args:
        if a == "--log-level":
            next(args, None)
        elif not a.startswith("-"):
            return a
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    engine = _command(argv) not in ("operator", "render")
    if engine:
        from tandem.router.main import add_router_args
        from tandem.serving.worker import add_engine_args, add_server_args
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the embedded default deployment")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000, help="the router's port")
    serve.add_argument("--workers", type=int, default=None,
                       help="aggregated workers (default 1, or 0 with --prefill/--decode)")
    serve.add_argument("--prefill", type=int, default=0, metavar="N",
                       help="P/D: prefill workers (with --decode)")
    serve.add_argument("--decode", type=int, default=0, metavar="M",
                       help="P/D: decode workers (with --prefill)")
    serve.add_argument("--pd-threshold", type=int, default=None, metavar="TOKENS",
                       help="the router's P/D threshold in uncached prompt tokens (default 16)")
    serve.add_argument("--pd-max-prefill-queue", type=int, default=None, metavar="REQUESTS",
                       help="the router serves aggregated when every prefill worker already "
                            "has this many requests (default: no bound)")
    serve.add_argument("--pd-max-local-prefill", type=int, default=None, metavar="TOKENS",
                       help="...except prompts lacking more than this many tokens, which "
                            "queue for a prefill worker (default 1024; 0: no cap)")

    router = sub.add_parser("router", help="run the KV-cache-aware router")
    worker = sub.add_parser("worker", help="run one worker process")
    gen = sub.add_parser("generate", help="generate completions offline")
    if engine:
        add_router_args(router)
        add_engine_args(worker)
        add_server_args(worker)
        add_engine_args(gen)
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--max-tokens", type=positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")

    bench = sub.add_parser("bench", help="benchmarks (from a source checkout)")
    bench.add_argument("kind", choices=sorted(BENCH_SCRIPTS))
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    op = sub.add_parser("operator", help="run the Kubernetes operator for InferenceServices")
    add_operator_args(op)

    render = sub.add_parser("render", help="print what the operator would apply for an "
                                           "InferenceService (YAML, apply order)")
    add_render_args(render)

    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args, extra)  # unknown options go to the worker (engine args)
    if args.command in ("worker", "generate"):
        from tandem.engine.errors import ConfigError
        from tandem.serving.worker import run

        own = worker if args.command == "worker" else gen  # its usage line in errors
        try:
            return run(args) if args.command == "worker" else _generate(args, own)
        except ConfigError as exc:  # a bad engine flag: a usage error, not a traceback
            own.error(str(exc))
    if args.command == "router":
        from tandem.router.main import run as run_router

        return run_router(args)
    if args.command == "operator":
        from tandem.operator.cli import run as run_operator

        return run_operator(args)
    if args.command == "render":
        from tandem.operator.dryrun import run as run_render

        return run_render(args)
    script = Path.cwd() / "bench" / BENCH_SCRIPTS[args.kind]
    if not script.exists():
        parser.error(f"{script} not found: run from a Tandem source checkout")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
