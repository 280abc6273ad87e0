"""Asynchronous grammar compilation with a bounded LRU cache.

`GrammarCompiler.submit(spec)` returns a Future of the `CompiledGrammar`, compiled on a small
thread pool (both libraries release the GIL while compiling, so the engine thread keeps
stepping). Results are cached by `(backend name, spec.key())`: a cached spec's Future is
already done, and concurrent submits of one key share one compile. A spec that fails
(validation or compilation) gives a Future whose exception is the StructuredOutputsError; the
failure is cached too (compiling is deterministic). At most `max_pending` distinct specs
compile or wait at once; past that `submit` raises `CompileQueueFull` (an overload, not a
client error).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from tandem.engine.structured.base import CompiledGrammar, GrammarBackend
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
DEFAULT_MAX_PENDING = 1024


class CompileQueueFull(RuntimeError):
    """Too many distinct grammars are compiling or queued; retry later (a 503)."""


class GrammarCompiler:
    """Compiles specs for one backend on `max_workers` threads; LRU of `cache_size` results
    (successes and failures); thread-safe."""

    def __init__(self, backend: GrammarBackend, max_workers: int = 2,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_workers < 1 or cache_size < 1 or max_pending < 1:
            raise ValueError("max_workers, cache_size and max_pending must be positive")
        self.backend = backend
        self.cache_size, self.max_pending = cache_size, max_pending
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="tandem-grammar")
        self._lock = threading.Lock()
        self._done: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._pending: dict[str, Future[CompiledGrammar]] = {}
        self.compiles = 0  # compiles started (cache misses)
        self.hits = 0  # submits answered from the cache or by a compile already running

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """The Future of `spec`'s compiled grammar (done at once on a cache hit). Raises
        CompileQueueFull when max_pending specs are already compiling or queued."""
        key = spec.key()
        with self._lock:
            fut = self._done.get(key)
            if fut is not None:
                self._done.move_to_end(key)
                self.hits += 1
                return fut
            fut = self._pending.get(key)
            if fut is not None:
                self.hits += 1
                return fut
            if len(self._pending) >= self.max_pending:
                raise CompileQueueFull(
                    f"{len(self._pending)} grammars are already compiling; retry later")
            self.compiles += 1
            fut = self._pool.submit(self._compile, spec)
            self._pending[key] = fut
        fut.add_done_callback(lambda f, key=key: self._finish(key, f))
        return fut

    def compile_now(self, spec: StructuredOutputs,
                    timeout: float | None = None) -> CompiledGrammar:
        """Compile (or fetch from the cache) and wait: StructuredOutputsError if it fails."""
        return self.submit(spec).result(timeout)

    def cached(self, spec: StructuredOutputs) -> CompiledGrammar | None:
        """The compiled grammar if it is cached and compiled successfully, else None."""
        with self._lock:
            fut = self._done.get(spec.key())
        if fut is None or fut.exception() is not None:
            return None
        return fut.result()

    def __len__(self) -> int:
        """Cached results."""
        with self._lock:
            return len(self._done)

    def shutdown(self) -> None:
        """Stop the threads (queued compiles are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            out = self.backend.compile(spec)
        except StructuredOutputsError:
            raise
        except Exception as exc:  # a backend bug must still reach the client as a 400
            log.exception("grammar backend %s failed on a %s constraint", self.backend.name,
                          spec.kind)
            raise StructuredOutputsError(
                f"cannot compile the {spec.kind} constraint: {exc}") from exc
        log.debug("compiled a %s grammar in %.1f ms", spec.kind,
                  (time.perf_counter() - start) * 1e3)
        return out

    def _finish(self, key: str, fut: Future[CompiledGrammar]) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if fut.cancelled():
                return
            self._done[key] = fut
            self._done.move_to_end(key)
            while len(self._done) > self.cache_size:
                self._done.popitem(last=False)
