"""Request migration: a stream whose worker breaks mid-way goes on on another worker.

A routed completions or chat stream (with a worker auth key, so the router can sign) asks
its worker for the output token ids of every event (`protocol.migration`). The router
relays the stream event by event, stripping those comments and keeping what the client
has: the response `id` and `created`, the characters of generated text sent and the token
ids. When the stream breaks (the connection resets or ends without `data: [DONE]`, or an
error event says the worker stopped: code `worker_draining`, or a 500/502/503 server
error, or the stream goes silent while the worker stops answering its probes: a frozen
worker, `FROZEN_SILENT_S`), the router sends the same body to another worker (the routing
stages pick it, excluding every worker tried; a disaggregated request resumes aggregated)
with the resume header: that worker prefills prompt + tokens and continues the stream
(token replay). The client sees one stream: same id, no second role chunk, no text lost or
repeated, usage counting every token. Greedy and seeded requests continue token for token.

Bounded: at most `max_migrations` new workers per request (each try counts). A stream that
cannot be migrated (the bound, no other worker, its worker sent no token ids: n > 1, echo,
prompt logprobs, a tool or reasoning parser; more than `MAX_RESUME_TOKENS` tokens) ends
with the error event as before, then `data: [DONE]`.

Bounded memory whatever the worker sends: at most `MAX_EVENT_BYTES` of an unfinished event
are held (a longer event, e.g. an echoed long prompt's logprobs, is passed on unparsed, and
its stream is no longer replayable), and at most `MAX_RESUME_TOKENS` token ids of
`MAX_ID_BYTES` digits a token are kept (more: the stream cannot be resumed, and none are kept).
Each decision is counted:
`tandem_router_migrations_total{result,reason}` (result: resumed, limit, no_worker,
not_replayable, failed; finished: the client had the whole output and its finish reason,
only `[DONE]` was missing, so the stream just ends; retried: a non-streamed request sent
again (`proxy`); reason: connection, stalled, draining, error).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tandem.protocol.migration import (
    MAX_RESUME_TOKENS,
    RESUME_HEADER,
    TOKENS_COMMENT,
    TOKENS_HEADER,
    Resume,
    signed_target,
)
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey
from tandem.protocol.web import DRAINING_CODE, error_body
from tandem.router.pd import Route
from tandem.router.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamStalled,
)
from tandem.router.workers import Worker

logger = logging.getLogger(__name__)
MIGRATABLE_CODES = frozenset({DRAINING_CODE, 500, 502, 503})  # error events that migrate
_DONE = b"data: [DONE]"
_COMMENT = TOKENS_COMMENT.encode()
_FINISHED = re.compile(rb'"finish_reason":\s*"')  # a choice with a finish reason
MAX_EVENT_BYTES = 1 << 20  # of an unfinished event held; a longer one passes unparsed
MAX_ID_BYTES = 10  # digits of a uint32 token id, or of sent_chars
FROZEN_SILENT_S = 5.0  # a stream this silent whose worker stopped answering probes: frozen


@dataclass
class Migration:
    """A request's migration settings: `max_migrations` (0: off) and the metric hook
    `on_result(result, reason)`."""

    max_migrations: int = 3
    on_result: Callable[[str, str], None] = lambda result, reason: None


@dataclass
class StreamState:
    """What the client has of one stream (module doc)."""

    response_id: str | None = None
    created: int | None = None
    sent_raw: bytes = b"0"  # the last token comment's sent_chars, as sent
    id_chunks: list[bytes] = field(default_factory=list)  # its "<id>,<id>" parts, as sent
    id_count: int = 0  # token ids in `id_chunks`
    replayable: bool = True  # every data event so far came with its token ids
    finished: bool = False  # a finish reason was relayed (n == 1: the output is complete)
    done: bool = False  # `data: [DONE]` relayed

    @property
    def sent_chars(self) -> int:
        return int(self.sent_raw)

    @property
    def token_ids(self) -> list[int]:
        """The output token ids sent so far (parsed now: per event, only bytes are kept)."""
        return [int(t) for chunk in self.id_chunks for t in chunk.split(b",")]

    def resume(self) -> Resume | None:
        """What the next worker continues (ValueError for malformed token comments)."""
        if self.response_id is None or self.created is None:
            return None  # nothing of the response reached the client: send it afresh
        ids = self.token_ids
        if any(not 0 <= t < 1 << 32 for t in ids) or self.sent_chars < 0:
            raise ValueError("token ids outside uint32, or negative sent_chars")
        return Resume(self.response_id, self.created, self.sent_chars, ids)


@dataclass
class Events:
    """A worker's stream cut into SSE events, holding at most MAX_EVENT_BYTES of an
    unfinished one; an event longer than that, however it arrives, is passed on unparsed
    (module doc)."""

    buffer: bytearray = field(default_factory=bytearray)
    overlong: bool = False  # inside an event longer than MAX_EVENT_BYTES: passed on as is

    def feed(self, chunk: bytes) -> list[tuple[bytes, bool]]:
        """`chunk`'s complete events, in order: (an event without its blank line, True), or
        (a part of an overlong event, with its blank line if it ends it, False) to pass on
        unparsed."""
        buf = self.buffer
        start = max(len(buf) - 1, 0)  # the event end may straddle the chunks
        buf += chunk
        out = []
        while (end := buf.find(b"\n\n", start)) >= 0:
            out.append((bytes(buf[:end + 2]), False) if self.overlong or end > MAX_EVENT_BYTES
                       else (bytes(buf[:end]), True))
            del buf[:end + 2]
            self.overlong, start = False, 0
        if len(buf) > MAX_EVENT_BYTES:  # keep the last byte: it may start the blank line
            self.overlong = True
            out.append((bytes(buf[:-1]), False))
            del buf[:-1]
        return out


def take_event(event: bytes, state: StreamState) -> tuple[bytes, dict | None]:
    """The event as the client gets it (token comments stripped, blank line added) and its
    error object, if it is an error event; `state` follows it."""
    tokens = False
    if event.startswith(_COMMENT):  # the worker's shape: the comment, then one data line
        comment, _, rest = event.partition(b"\n")
        tokens = _note_tokens(comment, state)
        lines = [rest]
    else:
        lines = event.split(b"\n")
    kept = []
    data = b""
    for line in lines:
        if line.startswith(_COMMENT):
            tokens = _note_tokens(line, state) or tokens
            continue
        if line.startswith(b"data:"):
            data = line[5:].strip()
        kept.append(line)
    out = b"\n".join(kept) + b"\n\n"
    if data == b"[DONE]":
        state.done = True
    elif data.startswith(b'{"error"'):
        try:
            return out, json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            return out, {}
    elif data:
        if not tokens:
            state.replayable = False
        if _FINISHED.search(data):
            state.finished = True
        if state.response_id is None:
            try:
                body = json.loads(data)
                state.response_id, state.created = str(body["id"]), int(body["created"])
            except (ValueError, KeyError, TypeError):
                state.replayable = False
    return out, None


def _note_tokens(comment: bytes, state: StreamState) -> bool:
    """Keep a token comment's ids (parsed only if the stream is resumed; at most
    MAX_RESUME_TOKENS of MAX_ID_BYTES digits a token, else the stream is not replayable)."""
    if not state.replayable:
        return True  # never resumed: nothing to keep
    sent, _, ids = comment[len(_COMMENT):].partition(b" ")
    count = ids.count(b",") + 1 if ids else 0
    state.id_count += count
    if (state.id_count > MAX_RESUME_TOKENS or len(sent) > MAX_ID_BYTES
            or len(ids) >= max(count, 1) * (MAX_ID_BYTES + 1)):
        state.replayable = False
        state.id_chunks.clear()
        return True
    state.sent_raw = sent
    if ids:
        state.id_chunks.append(ids)
    return True


def _frozen(worker: Worker) -> Callable[[float], bool]:
    """The stall check for a stream on `worker`: silent for `FROZEN_SILENT_S` while its
    probes get no answer at all (`Worker.unreachable_since`: a frozen, partitioned or
    swapped-out worker, whose connection may stay open for the read timeout). A draining,
    loading or merely slow worker answers its probes and is never cut."""
    def stalled(silent_s: float) -> bool:
        return silent_s >= FROZEN_SILENT_S and worker.unreachable_since is not None
    return stalled


def _error_event(message: str) -> bytes:
    return f"data: {json.dumps(error_body(502, message))}\n\n".encode()


@dataclass
class Leg:
    """One worker's part of a stream."""

    resp: UpstreamResponse
    worker: Worker
    release: Callable[[], None]


@dataclass
class Migrator:
    """Relays one stream, migrating it when it breaks (module doc)."""

    http: UpstreamPool
    path: str
    body: bytes
    rid: str
    pick: Callable[[set[str]], Route | None]
    tried: set[str]
    signer: WorkerKey
    migration: Migration
    state: StreamState = field(default_factory=StreamState)
    migrations: int = 0
    resume: Resume | None = None  # what the next worker continues (set on a break)

    async def relay(self, leg: Leg) -> AsyncIterator[bytes]:
        try:
            while True:
                reason, failure = None, b""
                events = Events()
                try:
                    async for chunk in leg.resp.chunks(stalled=_frozen(leg.worker)):
                        for event, whole in events.feed(chunk):
                            if not whole:  # a part of an overlong event (`Events`)
                                self.state.replayable = False
                                yield event
                                continue
                            out, err = take_event(event, self.state)
                            if err is not None and err.get("code") in MIGRATABLE_CODES:
                                reason = ("draining" if err.get("code") == DRAINING_CODE
                                          else "error")
                                failure = out
                                break
                            yield out
                        if reason is not None:
                            break
                    else:
                        if self.state.done:
                            leg.resp.release()
                            return
                        reason = "connection"
                        failure = _error_event("the worker ended the stream early")
                except UpstreamError as exc:
                    leg.worker.breaker.on_failure(time.monotonic())
                    logger.warning("[%s] %s failed mid-stream: %s", self.rid, leg.worker.id, exc)
                    reason = "stalled" if isinstance(exc, UpstreamStalled) else "connection"
                    failure = _error_event(f"the worker failed mid-stream ({type(exc).__name__})")
                leg.resp.close()
                leg.release()
                if self.state.finished and self.state.replayable and not self._wants_usage():
                    # the client has the whole output: only [DONE] was missing
                    self.migration.on_result("finished", reason)
                    yield _DONE + b"\n\n"
                    return
                nxt = await self._resume(reason)
                if nxt is None:
                    yield failure + _DONE + b"\n\n"
                    return
                leg = nxt
        finally:
            leg.resp.close()  # no-op once released; a client gone aborts the worker's request
            leg.release()

    def _wants_usage(self) -> bool:
        """The request asked for a usage chunk (which only a worker can make)."""
        try:
            options = json.loads(self.body).get("stream_options") or {}
            return bool(options.get("include_usage"))
        except (ValueError, AttributeError):
            return True

    async def _resume(self, reason: str) -> Leg | None:
        """The next worker's response to the resumed request, or None (counted)."""
        st, m = self.state, self.migration
        result = None
        try:
            self.resume = st.resume() if st.replayable else None
        except ValueError:
            st.replayable = False
        if not st.replayable:  # more than MAX_RESUME_TOKENS included (`_note_tokens`)
            result = "not_replayable"
        elif self.migrations >= m.max_migrations:
            result = "limit"
        while result is None:
            if self.migrations >= m.max_migrations:
                result = "failed"
                break
            route = self.pick(self.tried)
            if route is None:
                result = "no_worker"
                break
            leg = await self._attempt(route)
            if leg is not None:
                m.on_result("resumed", reason)
                logger.info("[%s] migrated after %d tokens (%s) to %s", self.rid,
                            len(self.resume.token_ids) if self.resume else 0, reason,
                            route.worker.id)
                return leg
        m.on_result(result, reason)
        logger.warning("[%s] not migrated (%s, %s)", self.rid, reason, result)
        return None

    async def _attempt(self, route: Route) -> Leg | None:
        w = route.worker
        self.tried.add(w.id)
        self.migrations += 1
        headers = {"Content-Type": "application/json", "X-Request-Id": self.rid,
                   TOKENS_HEADER: "1"}  # aggregated: the new worker prefills itself
        if self.resume is not None:
            headers[RESUME_HEADER] = self.resume.encode()
        headers[SIGNATURE_HEADER] = self.signer.sign(self.body, signed_target(None, headers))
        w.breaker.on_attempt(time.monotonic())
        w.local_in_flight += 1
        try:
            resp = await self.http.post(w.id, self.path, self.body, headers)
        except UpstreamError as exc:
            w.local_in_flight -= 1
            w.breaker.on_failure(time.monotonic())
            logger.warning("[%s] migration to %s failed: %s", self.rid, w.id, exc)
            return None
        if resp.status != 200:
            resp.close()
            w.local_in_flight -= 1
            if resp.status == 503:
                w.ready = False
            if resp.status >= 500:
                w.breaker.on_failure(time.monotonic())
            logger.warning("[%s] migration to %s answered %d", self.rid, w.id, resp.status)
            return None
        w.breaker.on_success()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                w.local_in_flight -= 1

        return Leg(resp, w, release)
