"""One ext_proc stream (one HTTP request through the gateway), as the gateway sends it with
request header mode SEND and both bodies FULL_DUPLEX_STREAMED; answers go back in order.

1. Request headers: kept (nothing is answered yet). A path the router does not serve is 404
   and a method other than POST on an OpenAI path 405 at once; a bodyless `GET /v1/models`
   is answered by the router itself (the models of every InferenceService behind it).
2. Request body chunks: buffered up to the router's `max_body_bytes` (beyond it: 413). At
   its end the request is decided (`picker.decide`, the tenant's policy and the input
   guardrails included); the answer is the request-headers message naming the endpoints,
   then the (possibly rewritten) body streamed back. A stop is an immediate response (the
   stage's status and OpenAI error body, its `code` kept: `guardrail` for a refusal; 429
   from flow control with its `Retry-After` and `x-tandem-flow-reason`) and the stream ends.
3. Response headers: the served endpoint is read back (`picker.served`), the answer's status
   feeds that worker's circuit breaker (`picker.judge`: 5xx a failure, as on the HTTP front
   door) and the headers pass on unchanged. Response body chunks pass on in order (SSE
   events whole, so the usage chunk the router asked for alone is dropped), their usage
   read; at the end of the body (or of the stream, however it ends) the rate-limit charge
   is settled and the flow ticket released, once, with the tokens used (a stream's usage
   chunk, asked for with flow control on too; cut short: `flowcontrol.front.stream_used`);
   a stored Responses API answer's id is remembered with the worker that served it
   (`responses.track`'s bookkeeping).
4. Output guardrails (`Body.output`, a 2xx answer; `output.AnswerGuard`): body chunks pass
   through the filter after the usage reader, an SSE stream event by event (a stop ends the
   body with the error event and `[DONE]`, Envoy then resets the worker's request; what
   follows is not answered); a whole answer is held with its response headers answer and
   rewritten at its end, or replaced by an immediate 400 (stopped) or 502 (over
   `MAX_USAGE_BYTES`). The audit runs once per answer.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tandem.protocol.web import APIError
from tandem.router import responses, stages, usage
from tandem.router.extproc import encode
from tandem.router.extproc.output import AnswerGuard
from tandem.router.extproc.picker import (
    KINDS,
    STRIPPED,
    Pick,
    abandon,
    decide,
    judge,
    served,
)
from tandem.router.extproc.settings import ExtProcSettings
from tandem.router.flowcontrol.base import REASON_HEADER
from tandem.router.flowcontrol.front import stream_used, ticket_cost
from tandem.router.scorers.session import SESSION_HEADER

if TYPE_CHECKING:
    from tandem.router.routes import RouterApp

logger = logging.getLogger("tandem.router.extproc")
MAX_USAGE_BYTES = 8 << 20  # a JSON answer is read for its usage up to this size


class _Headers:
    """What `RouterApp.models` reads of a request: its headers."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


class ExtProcStream:
    """The state of one stream (module doc); `on_message` answers each message, `finished`
    says the stream is over (an immediate response was sent), `close` settles what is left."""

    def __init__(self, ra: RouterApp, settings: ExtProcSettings) -> None:
        self.ra, self.settings = ra, settings
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.kind: str | None = None
        self.body = bytearray()
        self.pick: Pick | None = None
        self.finished = False
        self.status: int | None = None
        self.reader: usage.StreamUsage | None = None
        self.answer = bytearray()  # a JSON answer, for its usage
        self.served_booked = False
        self.settled = False
        self.scanned = bytearray()  # a stored response's first bytes, for its id
        self.guard: AnswerGuard | None = None  # the answer's output guardrails

    async def on_message(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        which = req.WhichOneof("request")
        if which == "request_headers":
            return await self._request_headers(req)
        if which == "request_body":
            return await self._request_body(req.request_body)
        if which == "request_trailers":  # they end the body: decide now if not yet done
            out = []
            if self.kind is not None and self.pick is None and not self.finished:
                out = await self._decide(trailers=True)
                if self.finished:
                    return out
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if which == "response_headers":
            return self._response_headers(req)
        if which == "response_body":
            return self._response_body(req)
        if which == "response_trailers":
            return self._response_trailers()
        return []

    # -- request -------------------------------------------------------------------------
    async def _request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = encode.headers_of(req.request_headers)
        self.subset = encode.subset_hint(req)
        method = self.headers.get(":method", "")
        path = self.headers.get(":path", "").split("?", 1)[0]
        self.kind = KINDS.get(path)
        if self.kind is None:
            if path == "/v1/models" and method in ("GET", "HEAD"):
                return await self._models()
            return self._stop(APIError(404, f"{method} {path[:200]} is not served here"),
                              "rejected")
        if method != "POST":
            return self._stop(APIError(405, f"{path} takes POST, not {method[:16]}"),
                              "rejected")
        if req.request_headers.end_of_stream:  # no body at all: the stages answer 400
            return await self._decide()
        return []

    async def _models(self) -> list[pb.ProcessingResponse]:
        try:
            listing = await self.ra.models(_Headers(self.headers))  # type: ignore[arg-type]
        except APIError as exc:
            return self._stop(exc, "rejected")
        self._count_immediate(200, "models")
        self.finished = True
        return [encode.immediate(200, json.dumps(listing).encode(),
                                 {"content-type": "application/json"})]

    async def _request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.finished or self.pick is not None:
            return []
        self.body += msg.body
        limit = self.ra.settings.max_body_bytes
        if len(self.body) > limit:
            self.ra.metrics.child(self.ra.metrics.rejected, "413").inc()
            return self._stop(APIError(413, f"request body over {limit} bytes"), "rejected")
        if not msg.end_of_stream:
            return []
        return await self._decide()

    async def _decide(self, trailers: bool = False) -> list[pb.ProcessingResponse]:
        """The pick and the body (its last chunk ends the stream unless `trailers` follow),
        or an immediate response."""
        assert self.kind is not None
        body, self.body = bytes(self.body), bytearray()
        try:
            pick = await decide(self.ra, self.settings, self.kind, self.headers, body,
                                self.subset)
        except APIError as exc:
            outcome = ("shed" if exc.status == 429 and REASON_HEADER in exc.headers
                       else "no_endpoint" if exc.status == 503 else "rejected")
            return self._stop(exc, outcome)
        self.pick = pick
        self.ra.metrics.child(self.ra.metrics.extproc_picks, "routed").inc()
        remove = [h for h in STRIPPED if h in self.headers and h not in pick.headers]
        return [encode.pick_response(pick.endpoints, pick.headers, remove),
                *encode.body_responses(pick.body, request=True, end_of_stream=not trailers)]

    def _stop(self, exc: APIError, outcome: str) -> list[pb.ProcessingResponse]:
        """Answer the client with `exc` and end the stream."""
        self._count_immediate(exc.status, outcome)
        self.finished = True
        logger.info("[%s] answered %d by the endpoint picker: %s",
                    self.headers.get("x-request-id", "-")[:128], exc.status, exc.message)
        return [encode.error_response(exc.status, exc.message, exc.param, exc.headers,
                                      exc.type, exc.code)]

    def _count_immediate(self, status: int, outcome: str) -> None:
        metrics = self.ra.metrics
        metrics.child(metrics.extproc_immediate, str(status)).inc()
        metrics.child(metrics.extproc_picks, outcome).inc()

    # -- response ------------------------------------------------------------------------
    def _response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        headers = encode.headers_of(req.response_headers)
        try:
            self.status = int(headers.get(":status", "0")) or None
        except ValueError:
            self.status = None
        pick, extra = self.pick, {}
        if pick is not None:
            self._book(encode.served_endpoint(req))
            judge(pick, self.status, headers)  # the serving worker's circuit breaker
            if "text/event-stream" in headers.get("content-type", ""):
                self.reader = usage.StreamUsage(pick.routing.req.strip_usage)
            worker = pick.in_flight  # the worker that serves it (None: not one of ours)
            ok = self.status is not None and 200 <= self.status < 300
            if worker is not None and ok:
                extra[SESSION_HEADER] = stages.session_tokens(self.ra).token(worker.id)
            if ok and not req.response_headers.end_of_stream:
                self._guard(pick, self.reader is not None)
        if req.response_headers.end_of_stream:
            self._settle()
        answer = encode.pass_headers(request=False, headers=extra)
        if self.guard is not None and not self.guard.sse:  # held until the body's end
            self.guard.headers = answer
            return []
        return [answer]

    def _guard(self, pick: Pick, sse: bool) -> None:
        """The output guardrails the answer goes through, if any apply (`output`)."""
        f, guard = pick.routing.req.output, self.ra.settings.guardrails
        if f is None or guard is None:
            return
        self.guard = AnswerGuard(f, sse, MAX_USAGE_BYTES,
                                 lambda: guard.output_done(pick.rid, pick.tenant, f))

    def _book(self, ep: str | None) -> None:
        if self.pick is not None and not self.served_booked:
            self.served_booked = True
            served(self.ra, self.pick, ep, self.status)

    def _response_body(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        msg = req.response_body
        if self.guard is not None and self.guard.ended:  # stopped: the rest goes nowhere
            return []
        if self.pick is not None and not self.served_booked:  # headers came without it
            self._book(encode.served_endpoint(req))
        if self.pick is not None and self.status is None and self.guard is None:
            self._guard(self.pick, self.pick.stream)  # headers not seen: guarded all the same
        chunk, eos = msg.body, msg.end_of_stream
        if self.pick is not None and self.pick.track and self.status == 200:
            self._track(chunk)
        if self.reader is not None:
            out = self.reader.feed(chunk)
            if eos:
                out += self.reader.finish()
        else:
            out = chunk
            if len(self.answer) < MAX_USAGE_BYTES and (self.guard is None or self.guard.sse):
                self.answer += chunk  # (a guarded JSON answer is held by the guard: `whole`)
        if self.guard is not None:
            return self._guarded(out, eos)
        if eos:
            self._settle()
        if not out and not eos:
            return []
        return encode.body_responses(out, request=False, end_of_stream=eos)

    def _guarded(self, out: bytes, eos: bool, trailers: bool = False
                 ) -> list[pb.ProcessingResponse]:
        """`out` through the output guardrails (`output`); the answer is settled once it
        is over for the client, a stop or an immediate response included."""
        guard = self.guard
        assert guard is not None
        answers = guard.end(out, trailers) if eos or trailers else guard.feed(out)
        if eos or trailers or guard.ended:
            self._settle()
        if guard.immediate is not None:  # the stream ends here
            metrics = self.ra.metrics
            metrics.child(metrics.extproc_immediate, str(guard.immediate)).inc()
            metrics.child(metrics.rejected, str(guard.immediate)).inc()
            self.finished = True
            logger.info("[%s] answer replaced by %d: output guardrails",
                        self.pick.rid if self.pick else "-", guard.immediate)
        return answers

    def _response_trailers(self) -> list[pb.ProcessingResponse]:
        """The answer ends with trailers: what the guardrails still hold goes first."""
        guard, out = self.guard, []
        if guard is not None:
            if guard.ended:  # stopped before: nothing more is answered
                return []
            out = self._guarded(self.reader.finish() if self.reader is not None else b"",
                                False, trailers=True)
            if self.finished:
                return out
        self._settle()
        return [*out, pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]

    def _track(self, chunk: bytes) -> None:
        """Remember which worker stored this Responses API answer (its id, in the first
        `responses.SCAN_BYTES`), as the HTTP front door does (`responses.track`)."""
        pick = self.pick
        assert pick is not None
        self.scanned += chunk
        found = responses.RESPONSE_ID.search(self.scanned)
        wid = pick.routing.answered
        if found is not None and wid is not None:
            self.ra.locations.record(pick.tenant, found.group(1).decode(), wid)
        if found is not None or len(self.scanned) >= responses.SCAN_BYTES:
            pick.track = False
            self.scanned = bytearray()

    def _settle(self) -> None:
        """The answer is over: settle the charge from its usage, release the ticket."""
        pick = self.pick
        if pick is None or self.settled:
            return
        self.settled = True
        ok = self.status is not None and 200 <= self.status < 300
        total: int | None = None
        bound: int | None = None
        if ok and self.reader is not None:
            total, bound = self.reader.total, self.reader.bound
        elif ok:
            held = self.guard is not None and not self.guard.sse
            total, bound = usage.answer_usage(self.guard.whole if held else bytes(self.answer))
        if pick.bill is not None:
            pick.bill.bill.settle(total, bound) if ok else pick.bill.bill.settle()
        if pick.ticket is not None:
            pick.ticket.release(self._used() if ok and self.reader is not None
                                else total if ok else 0)
        pick.drop()

    def _used(self) -> int | None:
        """The tokens a stream used as far as it was read (`flowcontrol.front.stream_used`)."""
        assert self.pick is not None and self.reader is not None
        req, ticket = self.pick.routing.req, self.pick.ticket
        assert ticket is not None
        return stream_used(self.reader, stages.prompt_tokens(req), ticket_cost(ticket))

    def close(self) -> None:
        """The stream ended (or broke): whatever was not settled is, conservatively; the
        answer's output guardrails audited if not yet."""
        if self.guard is not None:
            self.guard.close()
        pick = self.pick
        if pick is None or self.settled:
            return
        self.settled = True
        if pick.bill is not None:
            if self.reader is not None:  # a stream cut short: what it streamed, bounded
                pick.bill.bill.settle(self.reader.total, self.reader.bound)
            else:
                pick.bill.bill.keep()  # no answer seen: what it used is unknown
        if pick.ticket is not None:  # a stream cut short: what it streamed so far
            pick.ticket.release(self._used() if self.reader is not None else None)
        if not self.served_booked:
            self.served_booked = True
            self.ra.metrics.child(self.ra.metrics.extproc_served, "unreported").inc()
        abandon(pick)  # no answer seen: no breaker outcome
        pick.drop()
