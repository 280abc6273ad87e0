"""asyncio front of the engine: one thread owns and steps the engine, coroutines stream.

Only the engine thread touches the `LLMEngine`. Coroutines hand it commands (add, abort)
through a thread-safe inbox that it drains between steps, so an HTTP event loop never
waits for a running step. The thread sleeps while there is nothing it can schedule (no
requests, or only requests waiting for blocks that pins hold) until a command arrives;
it never spins. `add_many` admits several prompts in one command, so they all join the
same step. Each request's outputs wait for its coroutine in an `OutputStream`, which holds
at most one pending output: while the reader is behind, newer outputs merge into it (delta
outputs are appended, a cumulative one replaces the older), so a slow reader costs
O(what it has not read), never a queue of copies. `generate()` yields a `RequestOutput` per
step that changed the request (or the merge of several); closing or cancelling the
consumer (a disconnected HTTP client) aborts the request and frees its blocks at the next
step boundary. `snapshot` holds the engine's stats as of the last step or the last commands
taken in (whichever came later), for metrics and load reports. Callers outside the engine use
the typed coroutines and views of `async_api.EngineAPI` (pins, pages, LoRA, the engine's
state), never the `LLMEngine` itself; `_call` is the engine package's own escape hatch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.async_api import EngineAPI
from tandem.engine.config import EngineConfig
from tandem.engine.errors import EngineDeadError
from tandem.engine.kv_events_hub import KVEventHub, Subscription
from tandem.engine.llm_engine import EngineStats, LLMEngine
from tandem.engine.outputs import DeltaAccumulator, RequestOutput, output_size
from tandem.engine.request import ResumeState, TokenizedPrompt
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)
IDLE_WAKE_S = 1.0  # an idle engine thread also wakes this often (a safety net, not a poll)
LEASE_WAKE_S = 0.25  # ... and this often while page leases may expire


@dataclass(frozen=True)
class AddRequest:
    """One request for `AsyncLLMEngine.add_many`."""

    request_id: str
    prompt: str | list[int] | TokenizedPrompt
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    keep_blocks: bool = False
    lora_name: str | None = None  # a loaded adapter's name; None: the base model
    # outputs carry only what is new since the previous one (`OutputProcessor.use_deltas`)
    delta: bool = False
    resume: ResumeState | None = None  # output already produced elsewhere (token replay)


class OutputStream:
    """One request's outputs, from the engine thread to the coroutine reading them, with at
    most one output pending (as vLLM's `RequestOutputCollector`): one that arrives while
    another waits merges into it. Delta outputs are appended (the pending one is what the
    reader has not read); a cumulative output supersedes the older (whose `delta_*` fields
    it takes over). Read with `get` (a cancelled `get` loses nothing); filled on the
    reader's event loop. `fail(exc)` ends the reading: `get` hands over what is pending
    once, then raises `exc` (the engine request is the reader's to abort)."""

    def __init__(self, delta: bool = False) -> None:
        self.delta = delta
        self._acc = DeltaAccumulator()  # delta outputs
        self._latest: RequestOutput | None = None  # cumulative outputs
        self._ready = asyncio.Event()
        self._failed: BaseException | None = None
        self._flushed = False  # the output pending at `fail` was handed over

    def put(self, out: RequestOutput) -> None:
        if self.delta:
            self._acc.add(out)
        elif self._latest is None:
            self._latest = out
        else:
            older = self._latest
            self._latest = dataclasses.replace(
                out, delta_text=older.delta_text + out.delta_text,
                delta_token_ids=older.delta_token_ids + out.delta_token_ids)
        self._ready.set()

    def empty(self) -> bool:
        return not self._acc and self._latest is None

    def pending_size(self) -> int:
        """`outputs.output_size` of the pending output (0 if none)."""
        if self.delta:
            return self._acc.size
        return 0 if self._latest is None else output_size(self._latest)

    def get_nowait(self) -> RequestOutput:
        """The pending output; `asyncio.QueueEmpty` if there is none."""
        out = self._acc.take() if self.delta else self._latest
        if out is None:
            raise asyncio.QueueEmpty
        self._latest = None
        self._ready.clear()
        return out

    async def get(self) -> RequestOutput:
        while self.empty():
            if self._failed is not None:
                raise self._failed
            await self._ready.wait()
        if self._failed is not None:
            if self._flushed:
                raise self._failed
            self._flushed = True
        return self.get_nowait()

    def fail(self, exc: BaseException) -> None:
        """End the reading with `exc` (on the reader's event loop; the first call counts)."""
        if self._failed is None:
            self._failed = exc
            self._ready.set()


@dataclass
class _Add:
    requests: list[AddRequest]
    loop: asyncio.AbstractEventLoop
    outputs: list[OutputStream]
    done: concurrent.futures.Future  # result: each request's prompt ids; or the first error


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


class AsyncLLMEngine(EngineAPI):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        self._stopped = False
        self.snapshot: EngineStats = engine.stats()
        # KV events (when the engine records them) are drained every step and fanned out
        self.kv_hub = KVEventHub() if engine.config.enable_kv_events else None
        self.dead: BaseException | None = None  # set if the loop itself ever crashes
        if getattr(engine, "async_scheduling", False):  # the output thread delivers
            engine.output_sink = self._deliver
        executor = getattr(engine, "executor", None)
        if executor is not None:  # a rank's death wakes an idle loop at once
            executor.on_dead = self._wake.set
        if engine.config.kv_offload_host_bytes:  # the tiers hear of evictions from the start
            self.kv_connector_name = "offload"
            _ = self.kv_connector
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
        except EngineDeadError as exc:  # a tensor-parallel rank is gone: a clean stop
            self.dead = exc
            logger.error("engine stopped: %s", exc)
            self._fail_everything(exc)
        except BaseException as exc:  # noqa: BLE001 - recorded for /ready, then re-raised
            self.dead = exc
            logger.exception("engine loop crashed")
            self._fail_everything(exc)
            raise

    def _fail_everything(self, exc: BaseException) -> None:
        """After the loop's end: every request gets an error output, every queued command
        an EngineDeadError, so no caller waits forever."""
        try:
            self._deliver(self.engine.fail_all(f"the engine stopped: {exc}"))
        except Exception:  # noqa: BLE001 - the streams below still end
            logger.exception("failing the engine's requests")
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (_Add, _Call)):
                _settle(cmd.done, error=EngineDeadError(str(exc)))

    def executor_dead(self) -> str | None:
        """Why a tensor-parallel rank is gone (None while all run, or with one rank)."""
        executor = getattr(self.engine, "executor", None)
        return None if executor is None else executor.dead

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
                if not cmd.done.cancelled():
                    self._add(cmd)
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

    def _add(self, cmd: _Add) -> None:
        """Add every request of `cmd`, or none: one that fails takes the others back."""
        added: list[str] = []
        ids = []
        try:
            for r in cmd.requests:
                ids.append(self.engine.add_request(r.request_id, r.prompt, r.params,
                                                   priority=r.priority,
                                                   cache_salt=r.cache_salt,
                                                   keep_blocks=r.keep_blocks,
                                                   lora_request=r.lora_name,
                                                   delta=r.delta, resume=r.resume))
                added.append(r.request_id)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            for rid in added:
                self.engine.abort_request(rid)
            _settle(cmd.done, error=exc)
            return
        for rid, q in zip(added, cmd.outputs, strict=True):
            self._streams[rid] = (cmd.loop, q)
        if not _settle(cmd.done, ids):  # the caller left meanwhile: take them back
            for rid in added:
                self._streams.pop(rid, None)
                self.engine.abort_request(rid)

    def _loop(self) -> None:
        while not self._stopped:
            if (why := self.executor_dead()) is not None:
                raise EngineDeadError(why)
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
            if not busy or (self.engine.last_step_idle and not outputs):
                # nothing can run until a command arrives (a new request, an abort, a
                # release of pinned blocks): sleep until one does instead of spinning
                # (page leases end while idle too: a step ends them otherwise)
                leased = self.engine.expire_leases()
                self._wake.wait(timeout=LEASE_WAKE_S if leased else IDLE_WAKE_S)
                self._wake.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs to their event loops: one thread-safe wakeup per loop per
        step (not per request), so streaming many requests costs the HTTP loop one callback."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
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
        if self.dead is not None and isinstance(cmd, (_Add, _Call)):
            _settle(cmd.done, error=EngineDeadError(str(self.dead)))
            return
        self._inbox.put(cmd)
        self._wake.set()

    # -- coroutine side ------------------------------------------------------------------------
    async def add(self, prompt: str | list[int] | TokenizedPrompt, params: SamplingParams,
                  request_id: str, *, priority: int = 0, cache_salt: str | None = None,
                  keep_blocks: bool = False, lora_name: str | None = None
                  ) -> tuple[list[int], OutputStream]:
        """Queue a request; returns (prompt token ids, its output stream).

        Raises what `LLMEngine.add_request` raises (`InvalidRequestError`, `QueueFullError`).
        """
        [(ids, outputs)] = await self.add_many(
            [AddRequest(request_id, prompt, params, priority, cache_salt, keep_blocks,
                        lora_name)])
        return ids, outputs

    async def add_many(self, requests: list[AddRequest]
                       ) -> list[tuple[list[int], OutputStream]]:
        """Queue several requests in one command: all join the same step, or, when one is
        refused, none is added and its error is raised. Returns (prompt token ids, output
        stream) per request, in order."""
        loop = asyncio.get_running_loop()
        queues = [OutputStream(r.delta) for r in requests]
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(list(requests), loop, queues, done))
        try:
            ids = await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            if not done.cancel():  # already added: take them back out
                for r in requests:
                    self.abort(r.request_id)
            raise
        return list(zip(ids, queues, strict=True))

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

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
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
        return await self._call(lambda eng: hub.subscribe(eng.kv.pool.cached_hashes(), loop,
                                                          *_tier_snapshot(eng)))

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (safe from any thread)."""
        self._send(_Abort(request_id))

    @property
    def open_streams(self) -> int:
        """Requests whose outputs a caller is still reading (submitted, not yet ended)."""
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return (self._thread.is_alive() and self.dead is None
                and self.executor_dead() is None)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        tiers = getattr(self.engine, "kv_tiers", None)
        if tiers is not None:  # the offload thread
            tiers.close()
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:  # the tensor-parallel ranks
            stop()


def _tier_snapshot(eng: LLMEngine) -> tuple[list[BlockHash], list[BlockHash]]:
    """The blocks held only in the KV host tier, and only on disk (none without tiers)."""
    tiers = getattr(eng, "kv_tiers", None)
    if tiers is None:
        return [], []
    device = set(eng.kv.pool.cached_hashes())
    host = [h for h in tiers.host_hashes() if h not in device]
    seen = device | set(host)
    return host, [h for h in tiers.disk_hashes() if h not in seen]


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


def _put_all(batch: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream.put(out)
