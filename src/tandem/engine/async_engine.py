"""asyncio front of the engine: a background thread steps the engine, coroutines stream.

`generate()` yields a `RequestOutput` per step that changed the request; cancelling the
consumer (for example a disconnected HTTP client) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Thread-safe wrapper: all engine calls happen under one lock on the stepping thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    @classmethod
    def from_args(cls, model: str | None = None, **engine_args: Any) -> AsyncLLMEngine:
        return cls.from_config(EngineConfig(model=model, **engine_args))

    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                outputs = self.engine.step() if busy else []
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    loop, queue = entry
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                    if out.finished:
                        self._queues.pop(out.request_id, None)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Errors from validation raise before the first yield."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params, priority=priority,
                                    cache_salt=cache_salt)
            self._queues[request_id] = (loop, queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)
            self.engine.abort_request(request_id)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
