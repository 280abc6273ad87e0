"""Shared fixtures: the real bundled model is loaded once per session (tests marked `slow`)."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

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
    """The bundled model's GGUF. Only a CUDA machine may lack it (the GPU check's image: only
    the working tree travels), and skips there; elsewhere its absence is an error."""
    from tandem.engine.model.loader import bundled_model_path
    from tandem.protocol.bundled import find_bundled_gguf

    if find_bundled_gguf() is None and _cuda_present():
        pytest.skip("the bundled model is not installed (the GPU image); the tiny-model "
                    "variants of these checks run instead")
    return bundled_model_path()


_GGUF_READERS: dict[tuple, object] = {}
_GGUF_METADATA: dict[str, dict] = {}
_GGUF_NAME_MAPS: dict[tuple, object] = {}


@contextlib.contextmanager
def memoized_gguf() -> Iterator[None]:
    """transformers' GGUF path, unchanged but without its repeats: within this block one
    `gguf.GGUFReader` per file (its metadata parse, ~5 s for SmolLM2's vocab, ran once per
    `load_gguf_checkpoint` call, three per model load), one tensor-name map per (arch,
    layers) (built once per tensor, ~18 s a model) and one metadata-only parse per file.
    Everything is read-only and the same pure functions compute it: the references stay
    transformers' own. Caches live for the session."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as mgu

    real_reader, real_map, real_load = gguf.GGUFReader, gguf.get_tensor_name_map, \
        mgu.load_gguf_checkpoint

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = real_reader(path, *args, **kwargs)
        return _GGUF_READERS[key]

    def load(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return real_load(path, return_tensors, *args, **kwargs)
        if str(path) not in _GGUF_METADATA:
            _GGUF_METADATA[str(path)] = real_load(path)
        return copy.deepcopy(_GGUF_METADATA[str(path)])  # callers pop from what they get

    def name_map(*args):
        if args not in _GGUF_NAME_MAPS:
            _GGUF_NAME_MAPS[args] = real_map(*args)
        return _GGUF_NAME_MAPS[args]

    gguf.GGUFReader, gguf.get_tensor_name_map, mgu.load_gguf_checkpoint = reader, name_map, load
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, mgu.load_gguf_checkpoint = \
            real_reader, real_map, real_load


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_gguf):
    """transformers' tokenizer from the bundled GGUF (its own conversion)."""
    from transformers import AutoTokenizer

    with memoized_gguf():
        return AutoTokenizer.from_pretrained(str(bundled_gguf.parent),
                                             gguf_file=bundled_gguf.name)


@pytest.fixture(scope="session")
def hf_reference(bundled_gguf, hf_tokenizer):
    """transformers' own load of the same GGUF (it dequantizes and un-permutes itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    with memoized_gguf():
        model = AutoModelForCausalLM.from_pretrained(str(bundled_gguf.parent),
                                                     dtype=torch.float32,
                                                     gguf_file=bundled_gguf.name).eval()
    return model, hf_tokenizer


@pytest.fixture(scope="session")
def real_llm(bundled_gguf):
    from tandem import LLM

    return LLM(dtype="float32", kv_cache_memory=1 << 30, max_num_batched_tokens=512)


def start_redis(directory, password: str | None = None) -> tuple[subprocess.Popen, str, int]:
    """A real redis-server on a free port (`.ci/run` installs Debian's), answering PING:
    (process, URL, port); with `password`, it requires it and the URL carries it."""
    import redis

    from tests.serving.helpers import free_port

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


@pytest.fixture(scope="module", autouse=True)
def _give_back_freed_memory() -> Iterator[None]:
    """After each test module, hand the heap its fixtures freed back to the OS (glibc
    `malloc_trim`, a few ms). An engine built in this process raises glibc's trim and mmap
    thresholds (`cpu_tuning.tune_malloc`, right for a long-lived worker), after which nothing
    freed is returned: without this a pytest worker grew to 9 GiB over a run."""
    yield
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Collect garbage before the terminal summary: a coroutine a test's event loop left
    behind (a Redis client's) is finalized now, not in the middle of the summary's imports,
    where CPython 3.11's AST compiler fails on it ("AST constructor recursion depth
    mismatch")."""
    import gc

    gc.collect()
