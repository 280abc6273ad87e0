"""`tandem serve`: a local deployment as separate processes, planned and supervised.

`plan` turns the parsed `tandem serve` arguments into command lines: `--workers N`
aggregated workers (or `--prefill N` prefill and `--decode M` decode workers for P/D), each
on free HTTP and gRPC ports, behind the router on `--port`. Every process shares a fresh
random worker-auth key (a 0600 temp file, removed at exit); every worker serves only
requests the router signed. `serve` starts them, prints the URL and a curl example, and on
Ctrl-C stops every process it started.

The router gets the worker's tokenizer for every name the model is served under
(`router_tokenizers`), so it hashes prompts exactly as the workers do. A Hugging Face
repository id (`tandem serve ORG/NAME`) is resolved once, here, before anything starts
(downloaded into the hub cache, or found there offline); the workers then read that cache
with `HF_HUB_OFFLINE=1`, and the router's tokenizer is the same snapshot's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.protocol.cli_args import busy_message, busy_ports

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig

# the flags of `tandem worker` that `tandem serve` sets for each worker itself
MANAGED_WORKER_FLAGS = ("--host", "--port", "--grpc-port", "--role", "--worker-auth-key-file",
                        "--require-signed-requests", "--api-key")
# the flags of `tandem router` that `tandem serve` does not take: worker discovery in a
# cluster, and the random policy's seed (for a router run alone)
ROUTER_ONLY_FLAGS = ("--seed", "--discovery", "--namespace", "--label-selector",
                     "--inference-service", "--worker-port-name")
# ...and those it sets itself, then all of them
MANAGED_ROUTER_FLAGS = ("--host", "--port", "--workers", "--worker-auth-key-file",
                        "--tokenizer", "--grpc-tls-dir", "--grpc-tls-server-name",
                        *ROUTER_ONLY_FLAGS)
TLS_FLAGS = ("--grpc-tls-dir", "--grpc-tls-server-name")
API_KEY_TENANT = "default"  # the tenant of `tandem serve --api-key` keys
# on Ctrl-C every child gets SIGTERM, then SIGKILL once this has passed: at least
# STOP_GRACE_S, and the workers' --drain-timeout plus STOP_SLACK_S (their cut requests'
# answers, uvicorn's stop, the engine's shutdown)
STOP_GRACE_S = 40.0
STOP_SLACK_S = 15.0


@dataclass
class Deployment:
    """What `tandem serve` starts: (role, base URL, command) per worker, then the router;
    with GPUs, each worker's extra environment (its CUDA_VISIBLE_DEVICES) and start wave
    (workers sharing a GPU start one after another, each profiling its memory alone)."""

    workers: list[tuple[str, str, list[str]]]
    router: list[str]
    envs: list[dict[str, str]]
    waves: list[int]
    stop_grace_s: float = STOP_GRACE_S  # SIGTERM -> SIGKILL on stop (`stop_grace`)

    def describe(self) -> str:
        counts = Counter(role for role, _, _ in self.workers)
        if set(counts) == {"both"}:
            return f"{counts['both']} worker(s)"
        names = {"both": "aggregated", "prefill": "prefill", "decode": "decode"}
        return " + ".join(f"{counts[r]} {names[r]}" for r in names if counts[r]) + " workers"


def roles(args: argparse.Namespace) -> list[str]:
    """One role per worker: `--workers` aggregated ones (default 1 without P/D), then
    `--prefill` prefill and `--decode` decode workers (both or neither). ValueError, in
    argparse's words (the CLI's usage error), for a negative count, `--prefill` without
    `--decode` or the reverse, or no worker at all."""
    for flag, count in (("--workers", args.workers), ("--prefill", args.prefill),
                        ("--decode", args.decode)):
        if count is not None and count < 0:
            raise ValueError(f"argument {flag}: must be >= 0, not {count}")
    if (args.prefill > 0) != (args.decode > 0):
        raise ValueError("argument --prefill/--decode: P/D needs both (each at least 1)")
    both = args.workers if args.workers is not None else (0 if args.prefill else 1)
    out = ["both"] * both + ["prefill"] * args.prefill + ["decode"] * args.decode
    if not out:
        raise ValueError("argument --workers: no workers to start (0 without --prefill and "
                         "--decode)")
    return out


def plan(args: argparse.Namespace, passthrough: list[str],
         free_port: Callable[[str], int] | None = None,
         auth_key_file: str | None = None,
         gpus: list[str] | None = None,
         router_flags: Sequence[str] = ()) -> Deployment:
    """The worker and router command lines, each worker on free HTTP and gRPC ports.
    `passthrough`: the flags every worker gets; `router_flags`: the router's (it also gets
    the workers' gRPC TLS flags). With `auth_key_file`, every process gets it as
    `--worker-auth-key-file` and every worker `--require-signed-requests` (it serves only
    the router). `gpus`: the GPUs to hand out (None: `visible_gpus()`)."""
    from tandem.serving.gpus import gpu_plan, visible_gpus

    if free_port is None:
        from tandem.serving.ports import free_port
    base = [sys.executable, "-m", "tandem.cli", "--log-level", args.log_level]
    wanted = roles(args)
    envs, waves, gpu_flags = gpu_plan(len(wanted), passthrough,
                                      visible_gpus() if gpus is None else gpus)
    if len(wanted) > 1 and "--num-threads" not in passthrough:
        # workers on one host share its cores: split them instead of oversubscribing
        from tandem.engine.cpu_tuning import usable_cores

        passthrough = [*passthrough, "--num-threads", str(max(1, usable_cores() // len(wanted)))]
    passthrough = with_default_tool_parsing(passthrough)
    auth = ["--worker-auth-key-file", auth_key_file] if auth_key_file else []
    signed_only = ["--require-signed-requests"] if auth_key_file else []  # the router's only
    workers = []
    for i, (role, extra) in enumerate(zip(wanted, gpu_flags, strict=True)):
        port = free_port(args.host)
        workers.append((role, f"http://{args.host}:{port}", [
            *base, "worker", "--host", args.host, "--port", str(port),
            "--grpc-port", str(free_port(args.host)), "--role", role, *auth, *signed_only,
            *passthrough, *extra, *own_disk_tier(passthrough, i, len(wanted))]))
    router = [*base, "router", "--host", args.host, "--port", str(args.port),
              "--workers", ",".join(url for _, url, _ in workers), *auth,
              *tls_flags(passthrough), *router_flags]
    return Deployment(workers, router, envs, waves, stop_grace(passthrough))


def last_flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value argparse takes for the flag `names` spell (`--x v` or `--x=v`; the last
    one given wins), or None."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, text = arg.partition("=")
        if name in names:
            value = text if eq else (argv[i + 1] if i + 1 < len(argv) else value)
    return value


def stop_grace(passthrough: Sequence[str]) -> float:
    """Seconds from SIGTERM to SIGKILL when `tandem serve` stops: the workers' drain
    (`--drain-timeout` or its alias `--shutdown-timeout` in `passthrough`, default 30) plus
    STOP_SLACK_S, at least STOP_GRACE_S (a value the worker would refuse is left to it)."""
    drain = 30.0
    with contextlib.suppress(ValueError, TypeError):  # the worker refuses it itself
        drain = float(last_flag_value(passthrough, "--drain-timeout", "--shutdown-timeout"))
    return max(STOP_GRACE_S, drain + STOP_SLACK_S) if math.isfinite(drain) else STOP_GRACE_S


def own_disk_tier(passthrough: list[str], index: int, count: int) -> list[str]:
    """With several workers, each its own directory under `--kv-offload-disk-path`
    (`worker-INDEX`): a disk tier's index is one process's (the last flag wins)."""
    path = last_flag_value(passthrough, "--kv-offload-disk-path")
    if path is None or count < 2:
        return []
    return ["--kv-offload-disk-path", os.path.join(path, f"worker-{index}")]


def with_default_tool_parsing(passthrough: list[str]) -> list[str]:
    """The embedded default (the bundled model, no `--model`) answers `tools` with
    `tool_choice: auto`, the openai client's default, as well as forced calls: its workers
    get `--enable-auto-tool-choice --tool-call-parser hermes` unless either flag is given.
    A model given by name keeps vLLM's rule (auto tool choice only when asked)."""
    from tandem.protocol import engine_flags as flags

    given = {a.split("=", 1)[0] for a in passthrough}
    if flags.MODEL in given or given & {flags.TOOL_CALL_PARSER, flags.ENABLE_AUTO_TOOL_CHOICE}:
        return passthrough
    return [*passthrough, flags.ENABLE_AUTO_TOOL_CHOICE, flags.TOOL_CALL_PARSER, "hermes"]


def tls_flags(passthrough: list[str]) -> list[str]:
    """The gRPC TLS flags among the workers' arguments: the router needs the same ones to
    reach the workers' gRPC (KV events, load)."""
    out = []
    for i, arg in enumerate(passthrough):
        if arg in TLS_FLAGS and i + 1 < len(passthrough):
            out += [arg, passthrough[i + 1]]
        elif arg.split("=", 1)[0] in TLS_FLAGS and "=" in arg:
            out.append(arg)
    return out


def router_tokenizers(config: EngineConfig) -> list[str]:
    """`--tokenizer NAME=PATH` for every name the workers serve the model under (and its
    start-up LoRA adapters, which share its tokenizer), PATH being what the workers load
    their tokenizer from; none for the bundled model under its own name (the router maps
    that already)."""
    from tandem.protocol.bundled import BUNDLED_NAME, find_bundled_gguf

    if config.model is None:
        if config.served_model_names == (BUNDLED_NAME,):
            return []
        bundled = find_bundled_gguf()
        if bundled is None:
            return []
        path = str(bundled)
    else:
        path = str(Path(config.tokenizer or config.model).expanduser().resolve())
    names = [*config.served_model_names, *(config.lora_modules or {})]
    return [arg for name in names for arg in ("--tokenizer", f"{name}={path}")]


def check_worker_flags(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration every worker will build from the parsed flags (as
    `tandem worker` does), its model and tokenizer resolved to local paths (a repository id
    downloaded now) and a pre-quantized checkpoint's method named; ConfigError when it is
    invalid, cannot be resolved, or asks another quantization of such a checkpoint."""
    from tandem.engine.llm import resolve_config
    from tandem.engine.quant.checkpoint import with_checkpoint_quantization
    from tandem.serving.tool_parsers.options import chat_parsing
    from tandem.serving.worker import engine_config

    chat_parsing(args)  # --enable-auto-tool-choice without --tool-call-parser: refused now
    return with_checkpoint_quantization(resolve_config(engine_config(args, serving=True)))


def hub_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' extra environment: `HF_HUB_OFFLINE=1` when the model, tokenizer or
    draft model is a repository id (resolved into the cache by `check_worker_flags`: each
    worker finds the same snapshot there without a network call)."""
    from tandem.protocol.hub import looks_local

    names = [n for n in (args.model, getattr(args, "tokenizer", None)) if n]
    spec = getattr(args, "speculative_config", None)
    if spec is not None and spec.method == "draft" and spec.model not in (None, "self"):
        names.append(spec.model)
    return {"HF_HUB_OFFLINE": "1"} if any(not looks_local(n) for n in names) else {}


def serve(args: argparse.Namespace, passthrough: list[str], config: EngineConfig) -> int:
    """Start the local deployment (`plan`: workers on free ports behind the router on
    `--port`) as child processes, and supervise them until Ctrl-C. `args.router_flags`:
    the router's flags as given."""
    url = f"http://{args.host}:{args.port}"
    busy = busy_ports(args.host, [("--port", args.port), _metrics_port(args)])
    if busy:  # before any worker loads the model
        print(busy_message("tandem serve", busy), file=sys.stderr)
        return 1
    temp_files = [worker_auth_key_file()]
    try:
        flags = router_flags(args, config, temp_files)
        deployment = plan(args, passthrough, auth_key_file=temp_files[0], router_flags=flags)
        deployment.envs = [{**hub_env(args), **env} for env in deployment.envs]
    except ValueError as exc:  # e.g. fewer GPUs than --tensor-parallel-size
        _unlink(temp_files)
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        _unlink(temp_files)
        raise
    try:
        return _supervise(deployment, url, config.model_name, keyed="--api-keys" in flags)
    finally:
        _unlink(temp_files)


def _metrics_port(args: argparse.Namespace) -> tuple[str, int | None]:
    """The router's metrics port and where it was set: `--metrics-port`, else the
    `metrics_port` of the `--config` router.yaml (checked before any worker loads too)."""
    port = getattr(args, "metrics_port", None)
    path = getattr(args, "config", None)
    if port is not None or path is None:
        return "--metrics-port", port
    from tandem.router.config import load_config

    return f"metrics_port (in {path})", load_config(path).get("metrics_port")


def router_flags(args: argparse.Namespace, config: EngineConfig,
                 temp_files: list[str]) -> list[str]:
    """The router's flags: those given (`args.router_flags`), the workers' tokenizers
    (`router_tokenizers`) and, with `--api-key`, `--api-keys` naming a keys file made for
    them (appended to `temp_files`, for the caller to remove)."""
    flags = [*getattr(args, "router_flags", []), *router_tokenizers(config)]
    if getattr(args, "api_key", None):
        temp_files.append(api_keys_file(args.api_key))
        flags += ["--api-keys", temp_files[-1]]
    return flags


def _unlink(paths: list[str]) -> None:
    for path in paths:
        os.unlink(path)


def _supervise(deployment: Deployment, url: str, served: str, keyed: bool) -> int:
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
        late = start_workers(deployment, procs, lambda: stopping)
        if late is not None:
            if not stopping:
                print(f"the worker at {late} did not become ready", file=sys.stderr)
            return 1
        procs.append(spawn(deployment.router))
        for wurl, proc in zip(worker_urls, procs, strict=False):
            if not wait_ready(wurl, proc, timeout=600, stopping=lambda: stopping):
                if not stopping:
                    print(f"the worker at {wurl} did not become ready", file=sys.stderr)
                return 1
        if not wait_ready(url, procs[-1], timeout=60, workers=len(worker_urls),
                          stopping=lambda: stopping):
            if not stopping:
                print("the router did not become ready", file=sys.stderr)
            return 1
        roles_ = ", ".join(f"{wurl} ({role})" for role, wurl, _ in deployment.workers)
        auth = " -H \"Authorization: Bearer $API_KEY\"" if keyed else ""
        print(f"\nTandem is serving {served} at {url}\nworkers: {roles_}\n\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
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
        stop_all(procs, deployment.stop_grace_s)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, workers: int = 0,
               stopping: Callable[[], bool] = lambda: False) -> bool:
    """`url`/ready answers 200 (and, for the router, reports `workers` routable ones); False
    once `proc` exits, `stopping()` (Ctrl-C while the model loads) or after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None or stopping():
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


def spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a child in its own session with this environment plus `env`, less the API-key
    variable: `tandem serve` has already given the router its keys (a 0600 file), and the
    workers serve only the router's signed requests."""
    from tandem.serving.worker import API_KEY_ENV

    base = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent,
                            env={**base, **(env or {})})


def stop_all(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process group (workers drain), then SIGKILL what outlives `grace_s`."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def start_workers(deployment: Deployment, procs: list[subprocess.Popen],
                  stopping: Callable[[], bool] = lambda: False) -> str | None:
    """Spawn the workers (appended to `procs`) wave by wave: a wave starts once every worker
    before it is ready, so GPU-sharing workers size their memory one at a time. Returns the
    URL of a worker that did not become ready (or was waited for when `stopping()`), else
    None."""
    waves, envs = deployment.waves, deployment.envs
    for i, (_, _, cmd) in enumerate(deployment.workers):
        if i and waves[i] != waves[i - 1]:
            for (_, url, _), proc in zip(deployment.workers[:i], procs, strict=False):
                if not wait_ready(url, proc, timeout=600, stopping=stopping):
                    return url
        procs.append(spawn(cmd, envs[i]))
    return None


def _private_file(prefix: str, data: bytes) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(prefix=prefix)  # mode 0600
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def worker_auth_key_file() -> str:
    """A fresh random key for this run's router and workers (they sign and check requests
    with it), in a file only this user can read; the caller removes it."""
    import secrets

    return _private_file("tandem-worker-auth-", secrets.token_bytes(32))


def api_keys_file(keys: Sequence[str]) -> str:
    """The router's `--api-keys` file for `tandem serve --api-key KEY...`: every key of
    tenant `API_KEY_TENANT`, in a file only this user can read; the caller removes it."""
    text = "".join(f"{key} {API_KEY_TENANT}\n" for key in keys)
    return _private_file("tandem-api-keys-", text.encode())


def api_key(text: str) -> str:
    """argparse type of `tandem serve --api-key`: a key the router's keys file can hold."""
    from tandem.router.auth import MAX_KEY_LEN

    if not text or len(text) > MAX_KEY_LEN or "#" in text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(
            f"an API key is 1-{MAX_KEY_LEN} characters without spaces or '#'")
    return text
