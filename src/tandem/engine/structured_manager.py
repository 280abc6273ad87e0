"""Structured outputs inside the engine (vLLM v1's `StructuredOutputManager`).

A request whose `SamplingParams.structured_outputs` is set gets a `RequestGrammar` per
sample at admission: its grammar is submitted to the `GrammarCompiler` (a thread pool with
an LRU cache, `engine/structured`), once per user request, and the scheduler passes the
request over (its other requests run) until `poll`, at every step boundary, finds the
compile done and gives each sample its own matcher. A grammar that cannot be compiled
finishes that request alone with an error whose message starts with
`COMPILE_ERROR_PREFIX`; `check` compiles synchronously (off the engine thread) for callers
that want the error as an `InvalidRequestError` before the request is queued.

Each step, rank 0's model runner collects the matchers of its sampling rows (and, for a
speculative request, one row per draft position: the drafts are accepted one by one into
the matcher, a row filled after each, then rolled back) and `BitmaskFiller.start` fills the
step's bitmask on its own thread while the forward runs (it starts right before the
forward's launch: on CUDA it overlaps the queued kernels, on the CPU torch's kernels, which
release the GIL); the runner waits for it after the forward and applies it to the logits
on their device before sampling or verification (rank 0 alone samples, so with tensor
parallelism only rank 0 masks). After the step
the engine thread advances each matcher with the request's committed tokens (`accept`); a
matcher that terminates (it accepted a stop token) ends the request ("stop").

With `SamplingParams.reasoning_end_token_ids` (a reasoning model's end tag) the grammar
applies only after those ids appear in the output, as vLLM's reasoning-aware structured
outputs: until then the sample's tokens are neither masked nor fed to its matcher, and the
token completing the tag is the last one free. (The caller leaves the field unset when the
prompt already closed the thinking.)
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.errors import InvalidRequestError, QueueFullError
from tandem.protocol.structured_outputs import StructuredOutputs, StructuredOutputsError

if TYPE_CHECKING:
    import torch

    from tandem.engine.request import Request
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.scheduler import ScheduledRequest
    from tandem.engine.structured import CompiledGrammar, GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)
COMPILE_ERROR_PREFIX = "invalid structured outputs: "


class GrammarRejectedError(RuntimeError):
    """A committed token is one the request's grammar does not allow (a bug: the bitmask
    should have excluded it)."""


@dataclass(eq=False)
class RequestGrammar:
    """One sample's grammar: its compile future, then (once compiled) its own matcher,
    which has accepted exactly the sample's output tokens between steps. `done_at`: the
    number of output tokens when the grammar terminated (None while it may go on)."""

    spec: StructuredOutputs
    future: concurrent.futures.Future
    matcher: GrammarMatcher | None = None
    done_at: int | None = None
    # False while the sample still reasons (`SamplingParams.reasoning_end_token_ids` not
    # yet seen): its tokens are neither masked nor fed to the matcher
    active: bool = True

    @property
    def ready(self) -> bool:
        return self.matcher is not None


def waiting_for_grammar(req: Request) -> bool:
    """The scheduler's test: `req` has a grammar still compiling (it is not scheduled)."""
    grammar = req.grammar
    return grammar is not None and grammar.matcher is None


class StructuredOutputManager:
    """The engine's grammars: compiles (asynchronously, cached) and each waiting request's
    compile state. Engine thread only, except `check` (any thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int, backend: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend_name = backend
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Request] = {}  # sample id -> request whose grammar compiles

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (a backend reads the whole vocabulary)."""
        with self._lock:  # `check` may come first, off the engine thread
            if self._compiler is None:
                from tandem.engine.structured import (
                    GrammarCompiler,
                    default_backend,
                    get_backend,
                )

                name = self.backend_name or default_backend()
                self._compiler = GrammarCompiler(get_backend(name)(self.tokenizer,
                                                                   self.vocab_size))
                self.backend_name = name
            return self._compiler

    def check(self, spec: StructuredOutputs) -> None:
        """Compile `spec` now (cached: the engine's compile of it is then a cache hit);
        `InvalidRequestError(param="structured_outputs")` when it cannot be compiled,
        `QueueFullError` when too many distinct grammars compile already."""
        from tandem.engine.structured import CompileQueueFull

        try:
            spec.validate()
            self.compiler.compile_now(spec)
        except StructuredOutputsError as exc:
            raise InvalidRequestError(str(exc), param="structured_outputs") from None
        except CompileQueueFull as exc:
            raise QueueFullError(str(exc)) from None

    def add(self, children: Sequence[Request]) -> None:
        """Submit the samples' grammar (one compile for all of them; `QueueFullError` when
        too many distinct grammars compile already)."""
        spec = children[0].sampling_params.structured_outputs
        if spec is None:
            return
        from tandem.engine.structured import CompileQueueFull

        try:
            future = self.compiler.submit(spec)
        except CompileQueueFull as exc:
            raise QueueFullError(str(exc)) from None
        active = not children[0].sampling_params.reasoning_end_token_ids
        for child in children:
            child.grammar = RequestGrammar(spec, future, active=active)
            self._pending[child.request_id] = child

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def forget(self, req: Request) -> None:
        self._pending.pop(req.request_id, None)

    def poll(self) -> list[tuple[Request, str]]:
        """Give every sample whose compile is done its matcher; returns the samples whose
        compile failed, with the error message (the caller fails their requests)."""
        failed = []
        for rid, req in list(self._pending.items()):
            grammar = req.grammar
            if grammar is None or req.is_finished:
                del self._pending[rid]
                continue
            if not grammar.future.done():
                continue
            del self._pending[rid]
            try:
                compiled: CompiledGrammar = grammar.future.result()
                grammar.matcher = compiled.matcher()
                _replay(req)
            except StructuredOutputsError as exc:
                failed.append((req, f"{COMPILE_ERROR_PREFIX}{exc}"))
            except Exception as exc:  # a backend bug fails this request, never the loop
                logger.exception("[%s] grammar compile failed", rid)
                failed.append((req, f"{COMPILE_ERROR_PREFIX}the grammar engine failed "
                                    f"({type(exc).__name__})"))
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a pending compile is done or `timeout` seconds pass (used only when
        nothing else can run)."""
        futures = {r.grammar.future for r in self._pending.values() if r.grammar is not None}
        if futures:
            concurrent.futures.wait(futures, timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)


class StructuredOutputsCore:
    """`EngineCore`'s structured-output part (mixed in): the manager, built on first use,
    the off-thread compile check, and the per-step poll of compiling grammars."""

    _structured: StructuredOutputManager | None
    structured_outputs_backend: str | None
    _out_lock: threading.Lock
    tokenizer: Any
    state: Any

    def _fail(self, parent_ids: dict[str, None], message: str) -> None:
        raise NotImplementedError

    @property
    def structured(self) -> StructuredOutputManager:
        """The engine's grammars, built on first use."""
        if self._structured is None:
            with self._out_lock:  # `check_structured_outputs` may come first, off-thread
                if self._structured is None:
                    self._structured = StructuredOutputManager(
                        self.tokenizer, self.state.vocab_size,
                        self.structured_outputs_backend)
        return self._structured

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile `params`' grammar now, if it has one, so a grammar the engine cannot
        compile is an `InvalidRequestError(param="structured_outputs")` before the request
        is queued (the engine's own compile is then a cache hit). Blocks for the compile:
        servers call it off the engine thread and the event loop, as `process_prompt`."""
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)

    def _poll_grammars(self) -> bool:
        """Matchers for the requests whose grammar compiled since the last step; a compile
        that failed fails its request alone. True while grammars still compile."""
        manager = self._structured
        if manager is None or not manager.has_pending:
            return False
        failed: dict[str, str] = {}
        for req, message in manager.poll():
            failed.setdefault(req.parent_id or req.request_id, message)
        for pid, message in failed.items():
            self._fail({pid: None}, message)
        return manager.has_pending


def constrained(req: Request) -> bool:
    """Whether `req`'s next token is masked by its grammar (compiled, past any reasoning)."""
    grammar = req.grammar
    return grammar is not None and grammar.matcher is not None and grammar.active


def accept_token(req: Request, token: int, n: int | None = None) -> None:
    """Advance `req`'s matcher by its committed output `token` (appended already), the
    `n`-th output token (default: the last); marks `done_at` when the grammar terminates.
    GrammarRejectedError if not allowed."""
    grammar = req.grammar
    if grammar is None or grammar.matcher is None or grammar.done_at is not None:
        return
    if n is None:
        n = req.num_output_tokens
    if not grammar.active:  # still reasoning: the grammar starts after the end tag
        end = req.sampling_params.reasoning_end_token_ids or ()
        grammar.active = req.output_token_ids[max(0, n - len(end)):n] == list(end)
        return
    if not grammar.matcher.accept_tokens([token]):
        raise GrammarRejectedError(
            f"token {token} is not allowed by the request's grammar")
    if grammar.matcher.is_terminated():
        grammar.done_at = n


def _replay(req: Request) -> None:
    """A resumed request's matcher accepts its replayed output tokens (`ResumeState`), as
    `accept_token` did for each on the worker that generated them. A token the grammar
    refuses fails the request (StructuredOutputsError)."""
    for n, token in enumerate(req.output_token_ids[:req.num_replayed], start=1):
        try:
            accept_token(req, token, n)
        except GrammarRejectedError:
            raise StructuredOutputsError(f"replayed token {token} is not allowed by the "
                                         "request's grammar") from None


def valid_drafts(req: Request, drafts: list[int]) -> int:
    """How many of `drafts` (proposed after `req`'s tokens) its grammar allows in a row
    (all of them without a grammar)."""
    grammar = req.grammar
    if grammar is None or grammar.matcher is None or not grammar.active or not drafts:
        return len(drafts)
    if grammar.done_at is not None:
        return 0
    return grammar.matcher.validate_tokens(drafts)


@dataclass
class MaskRows:
    """A step's constrained logits rows: `entries` (matcher, drafts) in order, each filling
    1 + len(drafts) bitmask rows; `rows` the logits row of each bitmask row."""

    entries: list[tuple[GrammarMatcher, list[int]]]
    rows: list[int]


def fill_bitmask(entries: list[tuple[GrammarMatcher, list[int]]],
                 vocab_size: int) -> torch.Tensor:
    """The bitmask of `entries` ([rows, ceil(vocab/32)] int32 on the CPU): per entry, the
    matcher's current row, then one row after each of its drafts accepted in turn (rolled
    back after). After a draft the grammar refuses, the rest of that entry's rows stay
    all-allowed: verification rejects that draft (its row's mask excludes it), so they are
    never used."""
    from tandem.engine.structured import allocate_bitmask

    bitmask = allocate_bitmask(sum(1 + len(d) for _, d in entries), vocab_size)
    row = 0
    for matcher, drafts in entries:
        matcher.fill_bitmask(bitmask, row)
        accepted = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_tokens([token]):
                break
            accepted += 1
            matcher.fill_bitmask(bitmask, row + accepted)
        if accepted:
            matcher.rollback(accepted)
        row += 1 + len(drafts)
    return bitmask


def mask_rows(sample_reqs: list[Request],
              spec: list[tuple[ScheduledRequest, int]]) -> MaskRows | None:
    """A step's logits rows under a grammar (None: none): each constrained sampling row,
    then each constrained verified request's k + 1 rows (one per draft position)."""
    entries: list = []
    rows: list[int] = []
    for i, req in enumerate(sample_reqs):
        if constrained(req):
            entries.append((req.grammar.matcher, []))  # type: ignore[union-attr]
            rows.append(i)
    ns = len(sample_reqs)
    for s, first in spec:
        grammar = s.request.grammar
        if grammar is not None and constrained(s.request):
            entries.append((grammar.matcher, list(s.spec_token_ids)))
            rows.extend(range(ns + first, ns + first + len(s.spec_token_ids) + 1))
    return MaskRows(entries, rows) if entries else None


def mask_logits(logits: torch.Tensor, rows: list[tuple[int, GrammarMatcher]]) -> None:
    """In place: each (row, matcher)'s logits row keeps only what the matcher allows next
    (a proposer's draft logits; the target's go through `BitmaskFiller`)."""
    from tandem.engine.structured import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(len(rows), logits.shape[-1])
    for j, (_, matcher) in enumerate(rows):
        matcher.fill_bitmask(bitmask, j)
    apply_bitmask(logits, bitmask, [i for i, _ in rows])


class BitmaskFiller:
    """Fills a step's bitmask on its own thread while the forward runs (matchers are only
    touched by it between `start` and the `result` the runner waits for)."""

    def __init__(self, vocab_size: int = 0) -> None:
        self.vocab_size = vocab_size  # the logits' width (set before the first `start`)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, mask: MaskRows) -> concurrent.futures.Future:
        if self.vocab_size <= 0:
            raise RuntimeError("BitmaskFiller.vocab_size is not set")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tandem-bitmask")
        return self._pool.submit(fill_bitmask, mask.entries, self.vocab_size)

