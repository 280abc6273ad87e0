"""Output guardrails on the gateway path: one 2xx answer through its `OutputFilter`
(`guardrails.output`), as the endpoint picker returns the response body to Envoy
(FULL_DUPLEX_STREAMED: the client gets only the body chunks the picker sends back, and the
picker may answer the response headers late, after it has read body chunks).

* An SSE stream passes event by event (`OutputFilter.feed`, `finish` at its end). A `stop`
  sends the text before the match, the error event (code `guardrail`) and `data: [DONE]` as
  the last body chunk, `end_of_stream` set, while the worker is still streaming: the client's
  response is then complete, Envoy ends the HTTP stream and resets the upstream request,
  which aborts it on the worker (its KV freed). Whatever Envoy sends after is not answered.
* A whole (JSON) answer is held, its response headers answer with it, up to `limit` bytes,
  and rewritten at its end (`OutputFilter.body`): the headers, then the body. Stopped, it
  becomes an immediate response instead: 400 with the OpenAI error (code `guardrail`), which
  Envoy can still send since the worker's headers never left it. Over `limit` it fails
  closed: an immediate 502 (code `guardrail`), the worker's answer not relayed unscanned.
* A gateway that does not send the response headers (header mode SKIP) has already sent
  them on: the answer is guarded all the same (SSE when the request asked for a stream),
  and an immediate response then makes Envoy reset the client's stream (the status can no
  longer change).

`done` (the audit) runs once, when the answer is over however it ends (`close`: cut short).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tandem.protocol.web import error_body
from tandem.router.extproc import encode
from tandem.router.guardrails.output import OutputFilter, stop_error


@dataclass
class AnswerGuard:
    """One answer's output guardrails (module doc). `feed` a body chunk, `end` with its last
    (`trailers`: trailers follow, so no chunk ends the stream); each returns the answers to
    send. `ended`: nothing more is relayed (a stop, or an immediate response: `immediate`
    is then its status, and the ext_proc stream is over)."""

    filter: OutputFilter
    sse: bool
    limit: int
    done: Callable[[], None]
    # a whole answer's headers answer, held (None: the gateway did not send its headers)
    headers: pb.ProcessingResponse | None = None
    held: bytearray = field(default_factory=bytearray)
    whole: bytes = b""  # a whole answer as the worker sent it, once read (for its usage)
    ended: bool = False
    immediate: int | None = None
    audited: bool = False

    def feed(self, data: bytes) -> list[pb.ProcessingResponse]:
        if self.ended:
            return []
        if not self.sse:
            return self._hold(data)
        out = self.filter.feed(data)
        if self.filter.cut:
            self.ended = True
            self.close()
            return _bodies(out, True)
        return _bodies(out, False)

    def end(self, data: bytes, trailers: bool = False) -> list[pb.ProcessingResponse]:
        if self.ended:
            return []
        if not self.sse:
            return self._whole(data, trailers)
        out = self.filter.feed(data)
        if not self.filter.cut:
            out += self.filter.finish()
        self.ended = self.filter.cut
        self.close()
        return _bodies(out, not trailers)

    def close(self) -> None:
        """The answer is over: audit it (once)."""
        if not self.audited:
            self.audited = True
            self.done()

    def _hold(self, data: bytes) -> list[pb.ProcessingResponse]:
        self.held += data
        if len(self.held) <= self.limit:
            return []
        self.held = bytearray()
        return self._immediate(502, error_body(
            502, f"the answer is over {self.limit} bytes, more than the output guardrails "
            "read whole", None, "server_error", "guardrail"))

    def _whole(self, data: bytes, trailers: bool) -> list[pb.ProcessingResponse]:
        over = self._hold(data)
        if over:
            return over
        raw, self.held = bytes(self.held), bytearray()
        self.whole = raw
        body = self.filter.body(raw)
        if self.filter.stopped is not None:
            return self._immediate(400, stop_error(self.filter.stopped))
        self.close()
        return [*([self.headers] if self.headers is not None else []),
                *encode.body_responses(raw if body is None else body, request=False,
                                       end_of_stream=not trailers)]

    def _immediate(self, status: int, doc: dict) -> list[pb.ProcessingResponse]:
        self.ended, self.immediate = True, status
        self.close()
        return [encode.error_doc(status, doc)]


def _bodies(out: bytes, eos: bool) -> list[pb.ProcessingResponse]:
    if not out and not eos:
        return []
    return encode.body_responses(out, request=False, end_of_stream=eos)
