"""Shared fixtures: the real bundled model is loaded once per session (tests marked `slow`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free port for the session (`.ci/run` installs Debian's)."""
    from tests.serving.conftest import free_port

    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (Debian: apt-get install redis-server; .ci/run does)"
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
