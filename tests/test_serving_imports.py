"""The serving path runs on `pip install -e .` alone: none of the test extras is needed.

Every process of `tandem serve` (router and worker) and `tandem generate` run here with the
test-only packages made unimportable, as they are in a venv that `make serve` built: a
`sitecustomize` on PYTHONPATH puts None in `sys.modules` for each, so `import X` raises
ModuleNotFoundError and `importlib.util.find_spec("X")` answers None in every child
process. Optional probes (torch's own `find_spec("triton")`, say) see a missing package.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tandem.serving.ports import free_port
from tests.engine.utils import make_tiny_model_dir

# the `test` extra's packages (import names) and the `operator` extra's kopf: serving
# needs none of them; ray is the `ray` extra's, needed only by --distributed-executor-backend
# ray
ABSENT = ("triton", "ray", "transformers", "accelerate", "pytest", "_pytest", "xdist",
          "hypothesis", "openai", "matplotlib", "grpc_tools", "kmock", "cryptography",
          "kubernetes_validate", "openapi_schema_validator", "celpy", "kopf")
SITECUSTOMIZE = f"""import sys
for name in {ABSENT!r}:
    sys.modules[name] = None
"""


@pytest.fixture(scope="module")
def lean_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("lean-site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lean-model") / "tiny"
    make_tiny_model_dir(path, "llama", seed=4)
    return str(path)


def test_the_blocker_really_hides_the_test_extras(lean_env) -> None:
    code = ("import importlib.util as u, sys\n"
            "assert all(u.find_spec(n) is None for n in sys.argv[1:])\n"
            "try:\n    import transformers\nexcept ModuleNotFoundError:\n    print('absent')\n")
    out = subprocess.run([sys.executable, "-c", code, *ABSENT], env=lean_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "absent\n", out.stderr


def test_generate_needs_no_test_extra(lean_env, tiny) -> None:
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--model", tiny,
                          "--max-tokens", "3", "Hello"],
                         env=lean_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("### Hello\n"), out.stdout


def test_the_ray_backend_without_ray_names_the_extra(lean_env, tiny) -> None:
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--model", tiny,
                          "--max-tokens", "3", "--distributed-executor-backend", "ray", "Hi"],
                         env=lean_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == (
        "tandem generate: error: distributed_executor_backend 'ray' needs Ray: "
        "pip install 'tandem[ray]'")


def test_serve_router_and_worker_need_no_test_extra(lean_env, tiny) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--port", str(port), "--model", tiny,
         "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=lean_env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("Press Ctrl-C" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        text = "".join(lines) + rest
        assert proc.returncode == 0, text
        assert "ModuleNotFoundError" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
