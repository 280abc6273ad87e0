"""The engine runs where `gguf` and `platformdirs` are not installed (the GPU check's image):
`gguf` is imported only when a GGUF file is loaded, and Tandem's cache directory falls back to
`$XDG_CACHE_HOME/tandem` or `~/.cache/tandem` without `platformdirs`.

The subprocess runs with both made unimportable by a `sitecustomize` on PYTHONPATH that puts
None in `sys.modules` for each (as tests/test_serving_imports.py does for the test extras).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.protocol import bundled
from tests.engine.utils import make_tiny_model_dir

ABSENT = ("gguf", "platformdirs")
SCRIPT = """
import json, sys
from tandem import LLM, SamplingParams
from tandem.engine.errors import ConfigError
from tandem.engine.native import _cache_dir, load_native
import tandem.serving.worker  # the worker's import closure too

model, gguf = sys.argv[1:]
llm = LLM(model, dtype="float32", num_kv_blocks=64)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))
try:
    LLM(gguf)
    error = None
except ConfigError as exc:
    error = str(exc)
absent = [n for n in ("gguf", "platformdirs") if sys.modules.get(n, 0) is None]
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "error": error, "absent": absent,
                  "native": load_native() is not None, "cache": str(_cache_dir())}))
"""


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("bare-site")
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_CACHE_DIR", "XDG_CACHE_HOME")}
    return {**env, "PYTHONPATH": path}


def test_an_hf_model_generates_without_gguf_and_platformdirs(bare_env, tmp_path):
    model = tmp_path / "tiny"
    make_tiny_model_dir(model, "llama", seed=6, tokenizer="trained")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")  # never read: the import fails first
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(fake)], env=bare_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["absent"] == list(ABSENT)
    # the same tokens as here, where both packages are installed
    ref = LLM(str(model), dtype="float32", num_kv_blocks=64).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert got["tokens"] == ref[0].outputs[0].token_ids
    assert got["error"] == (f"{fake}: loading a GGUF file needs the gguf package "
                            "(pip install gguf)")
    # the native CPU kernels load from the fallback cache (platformdirs' answer on Linux)
    assert got["native"] is True
    assert got["cache"] == str(Path.home() / ".cache" / "tandem" / "kernels")


def test_the_cache_dir_without_platformdirs(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "platformdirs", None)
    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert bundled.cache_dir() == Path.home() / ".cache" / "tandem"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert bundled.cache_dir() == tmp_path / "tandem"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG spec says
    assert bundled.cache_dir() == Path.home() / ".cache" / "tandem"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "mine"))
    assert bundled.cache_dir() == tmp_path / "mine"


def test_the_cache_dir_with_platformdirs(monkeypatch):
    from platformdirs import user_cache_dir

    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    assert bundled.cache_dir() == Path(user_cache_dir("tandem"))
