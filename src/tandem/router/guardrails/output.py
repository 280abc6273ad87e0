"""Output guardrails on an answer: `OutputFilter` rewrites what the client receives, streamed
(SSE, `feed` / `finish`) or whole (`body`).

Streams are read event by event. Each text stream of the answer gets its own
`scan.TextScanner`: a completion choice's `text`; a chat choice's `content`,
`reasoning_content` and each tool call's `arguments`; a Responses API output item's
`*.delta` text. A choice's `finish_reason` flushes its scanners, the held-back text going
out in that event (a Responses `*.done` event: in one more delta event just before it);
whole texts in an event (`*.done`, `response.completed`, the answer when not streamed) are
scanned as a whole. An event left with nothing to say (its text all held back) is dropped.

Cost: events are read and written by orjson. When one read from the worker carries several
events (a burst, or a router that fell behind), each but the last only adds its text to its
scanner and is dropped, so the burst is scanned once; plain chat events of a burst (one
choice, content only) are read through the stream's `plain.Template`, without parsing. An
event with no choices (the usage chunk) passes as it came.

A `stop` match ends the answer: a stream gets the text before the match, then an error event
(an OpenAI error whose `code` is `guardrail`, naming the guardrail) and `data: [DONE]`, and
`cut` is set so that the caller closes the worker's stream, which aborts the request there
and frees its KV; an answer not streamed becomes that error (400). One SSE event larger than
`MAX_EVENT_BYTES` (never one a worker sends) ends the stream the same way, failed closed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from tandem.protocol.web import error_body
from tandem.router.guardrails.patterns import Prefilter
from tandem.router.guardrails.plain import Template, template_of
from tandem.router.guardrails.scan import Hit, OutputRule, TextScanner, scan_all

MAX_EVENT_BYTES = 8 << 20  # one SSE event of the answer, read whole to be filtered

# Responses API delta events whose `delta` is text (scanned per item and content index), and
# the done event that ends each
DELTAS = {"response.output_text.delta": "response.output_text.done",
          "response.reasoning_text.delta": "response.reasoning_text.done",
          "response.function_call_arguments.delta": "response.function_call_arguments.done"}
DELTA_OF = {done: delta for delta, done in DELTAS.items()}
DONE_TEXT = {"response.output_text.done": "text", "response.reasoning_text.done": "text",
             "response.function_call_arguments.done": "arguments"}
# keys whose string values are text the model wrote (scanned whole in any other event)
TEXT_KEYS = frozenset({"text", "content", "reasoning_content", "arguments", "refusal",
                       "output_text"})


# delta keys of a plain text chunk (the common case: one text delta, nothing else to keep)
PLAIN_DELTA = frozenset({"content", "role"})
OTHER_CHOICE_KEYS = frozenset({"index", "text", "finish_reason", "logprobs"})


def decode(payload: bytes) -> tuple[Any, bool]:
    """An event's JSON: (the document, whether orjson read it). orjson reads every event a
    worker sends, ~10x faster than the stdlib; what it refuses (NaN, integers over 64 bits)
    the stdlib reads, and writes back (`encode`), so nothing is changed by the round trip.
    ValueError: not JSON."""
    try:
        return orjson.loads(payload), True
    except orjson.JSONDecodeError:
        return json.loads(payload), False


def encode(doc: Any, fast: bool) -> bytes:
    """`doc` as compact JSON, by the library that read it (`decode`)."""
    if fast:
        try:
            return orjson.dumps(doc)
        except TypeError:  # orjson.JSONEncodeError: nothing `decode` can return
            pass
    return json.dumps(doc, separators=(",", ":")).encode()


def stop_message(hit: Hit) -> str:
    return f'the answer was stopped by guardrail "{hit.rule.name}"'


def stop_error(hit: Hit) -> dict[str, Any]:
    """The OpenAI error a stopped answer ends with."""
    return error_body(400, stop_message(hit), None, "invalid_request_error", "guardrail")


@dataclass
class Acted:
    """What one guardrail did to an answer, for its audit line: its strongest verdict (stop >
    redact > flag), the kinds it matched, its first match."""

    verdict: str
    labels: set[str]
    match: str


RANK = {"flag": 0, "redact": 1, "stop": 2}


@dataclass
class OutputFilter:
    """One answer's output guardrails (module doc). `acted`: per guardrail that matched,
    what it did (`Acted`); `stopped`: the stop match, if any; `error`: the error event a
    stream ended with (a stop, or an event over `MAX_EVENT_BYTES`: failed closed), whose
    caller closes the worker's stream; `seconds`: the time spent filtering, in all;
    `prefilter`: the rules' `patterns.Prefilter` (optional)."""

    kind: str  # "completions", "chat" or "responses"
    rules: list[OutputRule]
    prefilter: Prefilter | None = None
    scanners: dict[tuple, TextScanner] = field(default_factory=dict)
    acted: dict[str, Acted] = field(default_factory=dict)
    stopped: Hit | None = None
    error: dict[str, Any] | None = None
    tail: bytes = b""
    done: bool = False  # the end was sent (an error, or [DONE] passed)
    seconds: float = 0.0
    template: Template | None = None  # the stream's plain events (`plain`), once seen
    template_tries: int = 0

    @property
    def cut(self) -> bool:
        """The answer was ended early (a stop or an oversized event): close its stream."""
        return self.error is not None

    # -- streams -------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """The SSE bytes to relay for `chunk` (whole events only)."""
        if self.error is not None:
            return b""
        t0 = time.perf_counter()
        try:
            data = self.tail + chunk if self.tail else chunk
            end = data.rfind(b"\n\n")
            if end < 0:
                self.tail = data
                if len(data) > MAX_EVENT_BYTES:  # unread, so not relayed: fail closed
                    self.tail = b""
                    self.error = error_body(502, f"an event of the answer is over "
                                            f"{MAX_EVENT_BYTES} bytes, more than the output "
                                            "guardrails read", None, "server_error",
                                            "guardrail")
                    return self._stop_events()
                return b""
            self.tail = data[end + 2:]
            out = []
            events = data[:end].split(b"\n\n")
            last, i = len(events) - 1, 0
            while i <= last:
                t = self.template  # a run of plain events in a burst: held, dropped
                if t is not None and i < last and (run := t.run(events, i, last)) is not None:
                    self.scanners[t.key].add(run[0])
                    i = run[1]
                    continue
                out.append(self._event(events[i], i < last))
                if self.error is not None:
                    break
                i += 1
            return b"".join(out)
        finally:
            self.seconds += time.perf_counter() - t0

    def finish(self) -> bytes:
        """The stream ended: its unterminated tail, and any text still held (a stream that
        ended without a finish reason)."""
        if self.error is not None or self.done:
            return b""
        t0 = time.perf_counter()
        out = self._event(self.tail) if self.tail.strip() else b""
        self.tail = b""
        out += self._flush_all()
        self.seconds += time.perf_counter() - t0
        return out

    def _event(self, raw: bytes, more: bool = False) -> bytes:
        """One event as the client gets it; `more`: other events of the same chunk follow."""
        if raw.startswith(b"data:") and b"\n" not in raw:  # the common case: one data line
            lines, at = [raw], 0
        else:
            lines = raw.split(b"\n")
            data_at = [i for i, line in enumerate(lines) if line.startswith(b"data:")]
            if len(data_at) != 1:  # comments, keep-alives: nothing the model wrote
                return raw + b"\n\n" if raw.strip() else b""
            at = data_at[0]
        payload = lines[at][5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return self._flush_all() + raw + b"\n\n"
        try:
            doc, fast = decode(payload)
        except ValueError:
            return raw + b"\n\n"
        if not isinstance(doc, dict) or "error" in doc:
            return raw + b"\n\n"
        before = b""
        if self.kind == "responses":
            keep, before = self._responses_event(doc)
        elif self.kind == "chat" and len(lines) == 1 and (
                plain := self._plain(doc, more, raw)) is not None:
            keep = plain  # most events: one plain text delta
        elif doc.get("choices") == []:  # the usage chunk: no text, passed as it came
            return raw + b"\n\n"
        else:
            keep = self._chunk(doc)
        out = before + (self._render(lines, at, doc, fast) if keep else b"")
        return out + self._stop_events() if self.error is not None else out

    @staticmethod
    def _render(lines: list[bytes], at: int, doc: dict, fast: bool) -> bytes:
        data = b"data: " + encode(doc, fast)
        if len(lines) == 1:
            return data + b"\n\n"
        lines = list(lines)
        lines[at] = data
        return b"\n".join(lines) + b"\n\n"

    def _stop_events(self) -> bytes:
        assert self.error is not None
        self.done = True
        err = self.error
        if self.kind == "responses":
            detail = err["error"]
            doc = {"type": "error", "code": "guardrail", "message": detail["message"],
                   "param": None}
            event = f"event: error\ndata: {json.dumps(doc)}\n\n"
        else:
            event = f"data: {json.dumps(err)}\n\n"
        return (event + "data: [DONE]\n\n").encode()

    def _scanner(self, key: tuple) -> TextScanner:
        s = self.scanners.get(key)
        if s is None:
            s = self.scanners[key] = TextScanner(self.rules, self.prefilter)
        return s

    def _pass(self, key: tuple, text: str, flush: bool) -> str:
        s = self.scanners.get(key) or self._scanner(key)
        if flush:  # one scan of all it holds (the same text as `feed`, then `flush`)
            s.add(text)
            out = s.flush()
        else:
            out = s.feed(text)
        if s.hits or s.stopped is not None:
            self._collect(s)
        return out

    def _collect(self, s: TextScanner) -> None:
        """Fold `s`'s new hits into `acted` (bounded by the guardrails, not the answer)."""
        for hit in s.hits:
            verdict = "stop" if hit is s.stopped else hit.rule.action
            a = self.acted.get(hit.rule.name)
            if a is None:
                a = self.acted[hit.rule.name] = Acted(verdict, set(), hit.text)
            elif RANK[verdict] > RANK[a.verdict]:
                a.verdict = verdict
            if hit.label:
                a.labels.add(hit.label)
        s.hits.clear()
        if s.stopped is not None and self.stopped is None:
            self.stopped = s.stopped
            self.error = stop_error(s.stopped)

    def _chunk(self, doc: dict) -> bool:
        """A completions / chat chunk rewritten in place; False: it has nothing left."""
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices:
            return True
        keep = False
        for c in choices:
            if not isinstance(c, dict):
                continue
            i, end = c.get("index", 0), c.get("finish_reason") is not None
            if self.kind == "completions":
                text = c.get("text") if isinstance(c.get("text"), str) else ""
                c["text"] = self._pass((i, "text"), text, end)
                keep |= bool(c["text"]) or end or not c.keys() <= OTHER_CHOICE_KEYS
            else:
                keep |= self._delta(c, i, end)
            if self.stopped is not None:
                c["finish_reason"] = c.get("finish_reason") or "content_filter"
                return True
        return keep or bool(doc.get("usage"))

    def _plain(self, doc: dict, more: bool, raw: bytes) -> bool | None:
        """`_chunk` for a chat chunk whose one choice carries only content (and its role), or
        ends a choice that has held nothing but content: the general path's result, or None
        for any other event. With `more` (events of the same chunk follow: a worker's
        burst, or a router behind) the text joins its scanner's held text unscanned, to be
        scanned once with what follows (the choice's next event or its end): one scan per
        chunk, not one per event. The first plain event without a role or usage gives the
        stream's `template`, which reads the next ones' text without parsing them
        (`plain`)."""
        choices = doc.get("choices")
        if type(choices) is not list or len(choices) != 1:
            return None
        c = choices[0]
        if type(c) is not dict:
            return None
        delta = c.get("delta")
        if not isinstance(delta, dict) or not delta.keys() <= PLAIN_DELTA:
            return None
        end = c.get("finish_reason") is not None
        text = delta.get("content")
        if not isinstance(text, str) and not (end and "content" not in delta):
            return None
        key = (c.get("index", 0), "content")
        if end and any(k[0] == key[0] and k != key for k in self.scanners):
            return None  # its reasoning or tool calls hold text too: the general path
        s = self.scanners.get(key) or self._scanner(key)
        if end:  # one scan of all it holds
            s.add(text or "")
            out = s.flush()
            if out or "content" in delta:
                delta["content"] = out
        elif more:
            if (self.template is None and self.template_tries < 2 and "role" not in delta
                    and not doc.get("usage")):
                self.template_tries += 1
                self.template = template_of(raw, doc, text, key)
            s.add(text)
            delta["content"] = ""
            return "role" in delta or bool(doc.get("usage"))
        else:
            out = delta["content"] = s.feed(text)
        if s.hits or s.stopped is not None:
            self._collect(s)
            if self.stopped is not None:
                c["finish_reason"] = c.get("finish_reason") or "content_filter"
                return True
        return end or bool(out) or "role" in delta or bool(doc.get("usage"))

    def _delta(self, c: dict, i: int, end: bool) -> bool:
        delta = c.get("delta")
        if not isinstance(delta, dict):
            delta = c["delta"] = {}
        keep = end or bool(set(delta) - {"content", "reasoning_content", "tool_calls"})
        for key in ("reasoning_content", "content"):
            v = delta.get(key)
            if isinstance(v, str) or (end and (i, key) in self.scanners):
                out = self._pass((i, key), v if isinstance(v, str) else "", end)
                if out or key in delta:
                    delta[key] = out if out or key == "content" else None
                keep |= bool(out)
                if self.stopped is not None:
                    return True
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            keep |= bool(set(call) - {"index", "function"}) if isinstance(call, dict) else False
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn["arguments"] = self._pass((i, "tool", call.get("index", 0)),
                                             fn["arguments"], end)
                keep |= bool(fn["arguments"]) or bool(set(fn) - {"arguments"})
                if self.stopped is not None:
                    return True
        if end:  # held-back arguments of calls this chunk does not name
            named = {call.get("index", 0) for call in calls or () if isinstance(call, dict)}
            extra = []
            for key in [k for k in self.scanners if k[0] == i and k[1] == "tool"
                        and k[2] not in named]:
                rest = self._pass(key, "", True)
                if rest:
                    extra.append({"index": key[2], "function": {"arguments": rest}})
            if extra:
                delta["tool_calls"] = [*(calls or []), *extra]
        return keep

    def _responses_event(self, doc: dict) -> tuple[bool, bytes]:
        """A Responses API event rewritten in place: (keep it, events to send before it: a
        delta with the text its item's scanner still held, ahead of the item's done
        event)."""
        kind = doc.get("type")
        if kind in DELTAS and isinstance(doc.get("delta"), str):
            key = (doc.get("item_id"), doc.get("content_index", 0), kind)
            doc["delta"] = self._pass(key, doc["delta"], False)
            return bool(doc["delta"]) or self.error is not None, b""
        before = b""
        if kind in DONE_TEXT:
            delta_kind = DELTA_OF[kind]
            key = (doc.get("item_id"), doc.get("content_index", 0), delta_kind)
            s = self.scanners.pop(key, None)
            rest = s.flush() if s is not None else ""
            if s is not None:
                self._collect(s)
            if rest:
                delta = {"type": delta_kind, **{k: doc[k] for k in (
                    "sequence_number", "item_id", "output_index", "content_index")
                    if k in doc}, "delta": rest}
                before = (f"event: {delta_kind}\ndata: "
                          f"{json.dumps(delta, separators=(',', ':'))}\n\n").encode()
        if self.error is None:
            self._walk(doc)
        return True, before

    def _walk(self, node: Any) -> None:
        """Whole texts under `TEXT_KEYS`, scanned as a whole (hits: the audit's)."""
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str) and k in TEXT_KEYS and v:
                    out, s = scan_all(self.rules, v, self.prefilter)
                    node[k] = out
                    self._collect(s)
                elif isinstance(v, (dict, list)):
                    self._walk(v)
        elif isinstance(node, list):
            for v in node:
                self._walk(v)

    def _flush_all(self) -> bytes:
        """Text still held by any scanner, as one last chunk (a stream that ended without a
        finish reason for it)."""
        pending = {k: s for k, s in self.scanners.items() if s.held and s.stopped is None}
        if not pending or self.kind == "responses":
            return b""
        choices: dict[Any, dict] = {}
        for key, s in pending.items():
            text = s.flush()
            self._collect(s)
            if not text:
                continue
            c = choices.setdefault(key[0], {"index": key[0]})
            if self.kind == "completions":
                c["text"] = text
            elif key[1] == "tool":
                c.setdefault("delta", {}).setdefault("tool_calls", []).append(
                    {"index": key[2], "function": {"arguments": text}})
            else:
                c.setdefault("delta", {})[key[1]] = text
        if not choices:
            return b""
        obj = "text_completion" if self.kind == "completions" else "chat.completion.chunk"
        doc = {"object": obj, "choices": list(choices.values())}
        return f"data: {json.dumps(doc)}\n\n".encode()

    # -- whole answers -------------------------------------------------------------------
    def body(self, raw: bytes) -> bytes | None:
        """A JSON answer rewritten (None: it is not one; `stopped` set: it must not go)."""
        t0 = time.perf_counter()
        try:
            return self._body(raw)
        finally:
            self.seconds += time.perf_counter() - t0

    def _body(self, raw: bytes) -> bytes | None:
        try:
            doc = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(doc, dict) or "error" in doc:
            return None
        self._walk(doc)
        return json.dumps(doc).encode()
