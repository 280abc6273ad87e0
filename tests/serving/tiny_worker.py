"""A worker app serving a tiny random model on a real port (the openai client's and the
router's tests of the chat, structured-output and Responses APIs)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from fastapi import FastAPI

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.serving.api_server import ServerSettings, build_app
from tests.router.test_router_app import Served

TINY_BLOCK = 4  # the block size of a tiny_worker's engine


def tiny_worker(path: str | Path, settings: ServerSettings) -> tuple[Served, FastAPI]:
    """The model at `path` (`make_tiny_model_dir`) served as `settings.served_model_name`
    (TINY_BLOCK-token blocks, a 32 MiB KV pool) on uvicorn, once its `/ready` answers 200."""
    def load() -> AsyncLLMEngine:
        return AsyncLLMEngine.from_args(str(path), served_model_name=settings.served_model_name,
                                        block_size=TINY_BLOCK, kv_cache_memory=32 << 20)

    app = build_app(settings, load)
    server = Served(app, lean=False)
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return server, app
