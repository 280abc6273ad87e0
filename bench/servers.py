"""Start and stop the OpenAI-compatible servers that `bench/serve.py` compares.

Each server runs as its own process group (so a server's own children go with it), logs to
``bench/.cache/logs/serve-<name>.log``, and counts as up once ``GET /v1/models`` answers 200.

* ``tandem``: ``python -m tandem.cli worker`` from the project venv, with its defaults.
* ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` from ``.venv-vllm`` (made by
  ``bench/setup_vllm.sh``) on the exported HF copy of the same model, float32, with the same
  CPU settings as the offline runner (``bench/runners/vllm_runner.py``):
  ``VLLM_CPU_KVCACHE_SPACE=4``, ``VLLM_CPU_OMP_THREADS_BIND`` = every allowed CPU, and
  ``LD_PRELOAD`` of tcmalloc + the venv's ``libiomp5`` when present.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.serving.ports import free_port

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
LOG_DIR = BENCH_DIR / ".cache" / "logs"
VLLM_VENV = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))
HF_MODEL = BENCH_DIR / ".cache" / "smollm2-hf"
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


@dataclass
class ServerSpec:
    name: str
    argv: list[str]  # the command, with "{port}" where the port goes
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 900.0  # vLLM compiles its model on every start


def tandem_spec(extra: list[str] | None = None) -> ServerSpec:
    return ServerSpec("tandem", [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING",
                                 "worker", "--port", "{port}", *(extra or [])],
                      env={"PYTHONPATH": str(REPO / "src")})


_AUTH_KEY: list[tuple[str, bytes]] = []


def worker_auth_key() -> tuple[str, bytes]:
    """(path, key): one random worker-auth key per bench run, in a 0600 file under LOG_DIR,
    for `--worker-auth-key-file` on the Tandem routers and workers a bench starts (and for
    signing requests a bench sends a decode worker directly)."""
    if not _AUTH_KEY:
        import secrets

        LOG_DIR.mkdir(parents=True, exist_ok=True)
        path = LOG_DIR / "worker-auth.key"
        key = secrets.token_bytes(32)
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_bytes(key)
        _AUTH_KEY.append((str(path), key))
    return _AUTH_KEY[0]


def vllm_router_exe() -> str | None:
    """`vllm-router` from its own venv (bench/setup_vllm.sh), else from PATH."""
    venv = REPO / ".venv-vllm-router" / "bin" / "vllm-router"
    return str(venv) if venv.exists() else shutil.which("vllm-router")


def vllm_available() -> bool:
    return (VLLM_VENV / "bin" / "python").exists() and HF_MODEL.exists()


def vllm_spec(extra: list[str] | None = None) -> ServerSpec:
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    preload = [p for p in TCMALLOC if os.path.exists(p)][:1]
    iomp = VLLM_VENV / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpus),
           "TOKENIZERS_PARALLELISM": "false"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return ServerSpec("vllm", [str(VLLM_VENV / "bin" / "python"), "-m",
                               "vllm.entrypoints.openai.api_server", "--model", str(HF_MODEL),
                               "--served-model-name", "smollm2", "--dtype", "float32",
                               "--port", "{port}", "--uvicorn-log-level", "warning",
                               *(extra or [])], env=env)


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was up")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not up after {timeout_s:.0f}s")


@contextmanager
def launched(spec: ServerSpec) -> Iterator[str]:
    """Run `spec` on a free local port; yield its base URL; stop the whole group after."""
    port = free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"serve-{spec.name}.log"
    argv = [a.replace("{port}", str(port)) for a in spec.argv]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **spec.env}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t = time.monotonic()
        wait_up(url, proc, spec.start_timeout_s)
        print(f"[{spec.name}] up at {url} after {time.monotonic() - t:.0f}s (log {log_path})",
              file=sys.stderr, flush=True)
        yield url
    finally:
        stop_group(proc, timeout_s=60)
        # vLLM's engine-core child may outlive its parent by a moment; wait for the group.
        for _ in range(100):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


def stop_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the process group `proc` leads (started with `start_new_session=True`);
    SIGKILL it if `proc` has not exited after `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
