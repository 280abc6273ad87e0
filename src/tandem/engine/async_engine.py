"""asyncio front of the engine: one thread owns and steps the engine, coroutines stream.

Only the engine thread touches the `LLMEngine`. Coroutines hand it commands (add, abort)
through a thread-safe inbox that it drains between steps, so an HTTP event loop never
waits for a running step. `generate()` yields a `RequestOutput` per step that changed the
request; closing or cancelling the consumer (a disconnected HTTP client) aborts the request
and frees its blocks at the next step boundary. `snapshot` holds the engine's stats as of
the last step or the last commands taken in (whichever came later), for metrics and load
reports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.kv_events_hub import KVEventHub, Subscription
from tandem.engine.llm_engine import EngineStats, LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    keep_blocks: bool
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    done: concurrent.futures.Future  # result: prompt token ids; or the validation error


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.snapshot: EngineStats = engine.stats()
        # KV events (when the engine records them) are drained every step and fanned out
        self.kv_hub = KVEventHub() if engine.config.enable_kv_events else None
        self.dead: BaseException | None = None  # set if the loop itself ever crashes
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    @classmethod
    def from_args(cls, model: str | None = None, **engine_args: Any) -> AsyncLLMEngine:
        return cls.from_config(EngineConfig(model=model, **engine_args))

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - recorded for /ready, then re-raised
            self.dead = exc
            logger.exception("engine loop crashed")
            raise

    def _drain_inbox(self) -> bool:
        """Run every queued command; True if there was any."""
        drained = False
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if isinstance(cmd, _Add):
                if cmd.done.cancelled():
                    continue
                try:
                    ids = self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                                  priority=cmd.priority,
                                                  cache_salt=cmd.cache_salt,
                                                  keep_blocks=cmd.keep_blocks)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    _settle(cmd.done, error=exc)
                    continue
                self._streams[cmd.request_id] = (cmd.loop, cmd.outputs)
                if not _settle(cmd.done, ids):  # the caller left meanwhile: take it back
                    self._streams.pop(cmd.request_id, None)
                    self.engine.abort_request(cmd.request_id)
            elif isinstance(cmd, _Abort):
                self._streams.pop(cmd.request_id, None)
                self.engine.abort_request(cmd.request_id)
            else:  # a call runs even if its caller stopped waiting (it may hold resources)
                try:
                    result = cmd.fn(self.engine)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    _settle(cmd.done, error=exc)
                else:
                    _settle(cmd.done, result)

    def _loop(self) -> None:
        while not self._stopped:
            if self._drain_inbox():
                # what arrived counts in the load at once, not after the coming step (a
                # long prefill step would otherwise hide it from routers for its length)
                self.snapshot = self.engine.stats()
            busy = self.engine.has_unfinished_requests()
            outputs = self.engine.step() if busy else []
            self.snapshot = self.engine.stats()
            if self.kv_hub is not None:
                self.kv_hub.publish(self.engine.take_kv_events())
            if outputs:
                self._deliver(outputs)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs to their event loops: one thread-safe wakeup per loop per
        step (not per request), so streaming many requests costs the HTTP loop one callback."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            loop, q = entry
            batches.setdefault(loop, []).append((q, out))
            if out.finished:
                self._streams.pop(out.request_id, None)
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop is closed: its requests have no reader left
                logger.debug("dropped %d outputs for a closed event loop", len(batch))

    def _send(self, cmd: _Add | _Abort | _Call) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    # -- coroutine side ------------------------------------------------------------------------
    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                  priority: int = 0, cache_salt: str | None = None,
                  keep_blocks: bool = False) -> tuple[list[int], asyncio.Queue]:
        """Queue a request; returns (prompt token ids, its output queue).

        Raises what `LLMEngine.add_request` raises (`InvalidRequestError`, `QueueFullError`).
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(request_id, prompt, params, priority, cache_salt, keep_blocks, loop,
                        outputs, done))
        try:
            ids = await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            if not done.cancel():  # already added: take it back out
                self.abort(request_id)
            raise
        return ids, outputs

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Validation errors raise before the first yield."""
        _, outputs = await self.add(prompt, params, request_id, priority=priority,
                                    cache_salt=cache_salt)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps and return its result. Once
        sent, `fn` runs even if the caller is cancelled while waiting (a release or unpin
        is never lost); its result is then dropped."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return await asyncio.wrap_future(done)

    async def subscribe_kv_events(self) -> tuple[int, Subscription]:
        """A KV-event subscription whose snapshot is consistent with its event sequence."""
        if self.kv_hub is None:
            raise RuntimeError("the engine was started without enable_kv_events")
        hub, loop = self.kv_hub, asyncio.get_running_loop()
        return await self.call(lambda eng: hub.subscribe(eng.kv.pool.cached_hashes(), loop))

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (safe from any thread)."""
        self._send(_Abort(request_id))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)


def _settle(done: concurrent.futures.Future, result: Any = None,
            error: BaseException | None = None) -> bool:
    """Complete a caller's future; False if the caller cancelled it (never raises: a
    cancelled caller must not kill the engine thread)."""
    try:
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)
    except concurrent.futures.InvalidStateError:
        return False
    return True


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in batch:
        q.put_nowait(out)
