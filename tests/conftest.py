"""Shared fixtures: the real bundled model is loaded once per session (tests marked `slow`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton kernels run on the CPU only under its interpreter, which @triton.jit reads when a
# kernel module is imported: set it before any test imports one (worker processes the tests
# start inherit it). With a GPU the kernels compile for it instead.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def bundled_gguf():
    from tandem.engine.model.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_reference(bundled_gguf):
    """transformers' own load of the same GGUF (it dequantizes and un-permutes itself)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": bundled_gguf.name}
    model = AutoModelForCausalLM.from_pretrained(str(bundled_gguf.parent), dtype=torch.float32,
                                                 **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(str(bundled_gguf.parent), **kwargs)
    return model, tok


@pytest.fixture(scope="session")
def real_llm():
    from tandem import LLM

    return LLM(dtype="float32", kv_cache_memory=1 << 30, max_num_batched_tokens=512)


def start_redis(directory, password: str | None = None) -> tuple[subprocess.Popen, str, int]:
    """A real redis-server on a free port (`.ci/run` installs Debian's), answering PING:
    (process, URL, port); with `password`, it requires it and the URL carries it."""
    import redis

    from tests.serving.conftest import free_port

    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (Debian: apt-get install redis-server; .ci/run does)"
    port = free_port()
    auth = ["--requirepass", password] if password else []
    proc = subprocess.Popen([exe, "--port", str(port), "--save", "", "--appendonly", "no",
                             *auth, "--dir", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url, port
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server for the session."""
    proc, url, _ = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(timeout=10)
