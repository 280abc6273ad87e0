"""An ext_proc client built from Envoy's published protos (`xds-protos`) that plays Envoy as
the Gateway API Inference Extension's chart configures it (request header mode SEND, request
and response bodies FULL_DUPLEX_STREAMED): it streams a request's headers and body to the
endpoint picker, applies the pick's header mutation, forwards the body the picker returned to
the picked worker over real HTTP, and streams the worker's response headers and body back
through the picker, collecting what the client would get. Also a router with the picker
served on a free port, over stub workers."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from tandem.protocol.web import APIError
from tandem.router.app import RouterServerSettings, build_app
from tandem.router.core import Router, RouterSettings
from tandem.router.extproc.settings import ExtProcSettings
from tandem.router.flowcontrol.base import REASON_HEADER, FlowControl, FlowRequest, FlowTicket
from tandem.router.monitor import MonitorSettings
from tests.router.test_router_app import Served

DEST = "x-gateway-destination-endpoint"


def _headers(items: dict[str, str], eos: bool) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]),
        end_of_stream=eos)


def _metadata(namespace: str, key: str, value: str | list[str]) -> base_pb2.Metadata:
    inner = struct_pb2.Struct()
    if isinstance(value, list):
        inner.fields[key].list_value.extend(value)
    else:
        inner.fields[key].string_value = value
    return base_pb2.Metadata(filter_metadata={namespace: inner})


@dataclass
class Exchange:
    """One request as the client saw it, and what the picker said on the way."""

    immediate: pb.ImmediateResponse | None = None
    pick: pb.ProcessingResponse | None = None  # the request-headers answer
    endpoints: list[str] = field(default_factory=list)
    metadata_endpoints: list[str] = field(default_factory=list)
    set_headers: dict[str, str] = field(default_factory=dict)
    set_both: bool = False  # some set header carried `value` and `raw_value`
    removed: list[str] = field(default_factory=list)
    forwarded_body: bytes = b""
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    # headers the picker set on the response (raw_value), as the client gets them
    response_set: dict[str, str] = field(default_factory=dict)
    body_chunks: list[bytes] = field(default_factory=list)  # as the client received them
    served_by: str | None = None
    sent_at: list[float] = field(default_factory=list)  # response chunks into the picker
    received_at: list[float] = field(default_factory=list)  # ... and out of it
    trailing: object = None  # what followed the last answer (None: the stream ended)

    @property
    def body(self) -> bytes:
        return b"".join(self.body_chunks)


class Stream:
    """One ext_proc stream: `send` a message, `recv` the next answer (in order, with the time
    it arrived); a thread reads the answers as the picker sends them."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.out: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()
        self.call = stub.Process(self._requests(), timeout=60)
        threading.Thread(target=self._pump, daemon=True).start()

    def _requests(self) -> Iterator[pb.ProcessingRequest]:
        while (msg := self.out.get()) is not None:
            yield msg

    def _pump(self) -> None:
        try:
            for answer in self.call:
                self.answers.put((time.monotonic(), answer))
        except grpc.RpcError as exc:
            self.answers.put((time.monotonic(), exc))
        self.answers.put((time.monotonic(), None))

    def send(self, msg: pb.ProcessingRequest) -> None:
        self.out.put(msg)

    def recv(self, timeout: float = 20.0) -> pb.ProcessingResponse | None:
        """The next answer (None: the picker ended the stream)."""
        at, answer = self.answers.get(timeout=timeout)
        if isinstance(answer, Exception):
            raise answer
        self.last_at = at
        return answer

    def close(self) -> None:
        self.out.put(None)


class Envoy:
    """Plays Envoy against an endpoint picker at `target` (plaintext, or over TLS with
    `credentials`)."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.channel = (grpc.insecure_channel(target) if credentials is None
                        else grpc.secure_channel(target, credentials))
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def request(self, path: str, body: bytes, headers: dict[str, str] | None = None,
                method: str = "POST", chunk: int = 7, subset: list[str] | str | None = None,
                serve: int = 0, report_served: bool = True) -> Exchange:
        """Send one request through the picker and, when it picks, to the endpoint at
        `serve` in its list (0: the pick; another index plays a gateway retry), reporting
        that endpoint as served."""
        s = Stream(self.stub)
        ex = Exchange()
        hdrs = {":method": method, ":path": path, ":authority": "gateway",
                "content-type": "application/json", **(headers or {})}
        meta = (_metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset",
                          subset) if subset is not None else None)
        first = pb.ProcessingRequest(request_headers=_headers(hdrs, eos=not body))
        if meta is not None:
            first.metadata_context.CopyFrom(meta)
        s.send(first)
        for i in range(0, len(body), chunk):
            s.send(pb.ProcessingRequest(request_body=pb.HttpBody(
                body=body[i:i + chunk], end_of_stream=i + chunk >= len(body))))
        try:
            answer = s.recv()
            if answer.WhichOneof("response") == "immediate_response":
                ex.immediate = answer.immediate_response
                return ex
            assert answer.WhichOneof("response") == "request_headers", answer
            self._read_pick(ex, answer)
            if body:
                while True:  # the body the upstream gets: only what the picker returns
                    part = s.recv()
                    assert part.WhichOneof("response") == "request_body", part
                    streamed = part.request_body.response.body_mutation.streamed_response
                    ex.forwarded_body += streamed.body
                    if streamed.end_of_stream:
                        break
            self._forward(s, ex, path, hdrs, serve, report_served)
            return ex
        finally:
            s.close()

    @staticmethod
    def _read_pick(ex: Exchange, answer: pb.ProcessingResponse) -> None:
        ex.pick = answer
        mutation = answer.request_headers.response.header_mutation
        for opt in mutation.set_headers:
            ex.set_both |= bool(opt.header.value) and bool(opt.header.raw_value)
            ex.set_headers[opt.header.key.lower()] = opt.header.raw_value.decode()
        ex.removed = list(mutation.remove_headers)
        ex.endpoints = ex.set_headers[DEST].split(",")
        lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
        ex.metadata_endpoints = lb.fields[DEST].string_value.split(",")

    def _forward(self, s: Stream, ex: Exchange, path: str, hdrs: dict[str, str], serve: int,
                 report_served: bool) -> None:
        target = ex.endpoints[serve]
        sent = {k: v for k, v in hdrs.items()
                if not k.startswith(":") and k not in ex.removed}
        sent.update({k: v for k, v in ex.set_headers.items() if k != DEST})
        with httpx.Client(timeout=30) as http, http.stream(
                hdrs[":method"], f"http://{target}{path}", content=ex.forwarded_body,
                headers=sent) as resp:
            ex.status = resp.status_code
            msg = pb.ProcessingRequest(response_headers=_headers(
                {":status": str(resp.status_code), **dict(resp.headers)}, eos=False))
            if report_served:
                ex.served_by = target
                msg.metadata_context.CopyFrom(_metadata(
                    "envoy.lb", "x-gateway-destination-endpoint-served", target))
            s.send(msg)
            answer = s.recv()
            assert answer.WhichOneof("response") == "response_headers", answer
            for opt in answer.response_headers.response.header_mutation.set_headers:
                ex.set_both |= bool(opt.header.value) and bool(opt.header.raw_value)
                ex.response_set[opt.header.key.lower()] = opt.header.raw_value.decode()
            ex.response_headers = {k.lower(): v for k, v in resp.headers.items()}
            for piece in resp.iter_raw():
                s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece)))
                ex.sent_at.append(time.monotonic())
        s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
        while True:
            answer = s.recv()
            assert answer is not None and answer.WhichOneof("response") == "response_body", \
                answer
            streamed = answer.response_body.response.body_mutation.streamed_response
            if streamed.body:
                ex.body_chunks.append(streamed.body)
                ex.received_at.append(s.last_at)
            if streamed.end_of_stream:
                break
        s.close()  # as Envoy: the exchange is over
        ex.trailing = s.recv()  # None: the picker ended its side cleanly


class EppRouter:
    """A router app (lean server, a thread) with the endpoint picker on a free port, over
    `workers` (base URLs); `ra` its RouterApp."""

    def __init__(self, workers: list[str], ext: ExtProcSettings | None = None,
                 **settings) -> None:
        ext = ext or ExtProcSettings(port=0, host="127.0.0.1")
        self.app = build_app(Router(RouterSettings(seed=0), lambda m: None),
                             RouterServerSettings(
                                 worker_urls=workers, ext_proc=ext,
                                 monitor=MonitorSettings(probe_interval_s=0.1), **settings))
        self.ra = self.app.state.router_app
        self.served = Served(self.app)
        deadline = time.monotonic() + 10
        while self.ra.epp is None or not self.ra.epp.port:
            assert time.monotonic() < deadline, "the endpoint picker did not start"
            time.sleep(0.02)
        self.port = self.ra.epp.port
        self.target = f"127.0.0.1:{self.port}"
        self.envoy = Envoy(self.target)

    def wait_routable(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while sum(1 for w in list(self.ra.router.workers.values()) if w.ready) < n:
            assert time.monotonic() < deadline, "workers did not become ready"
            time.sleep(0.05)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.ra.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def stop(self) -> None:
        self.envoy.close()
        self.served.stop()


class Recorded(FlowTicket):
    def __init__(self, log: list) -> None:
        self.log = log

    def release(self, used_tokens: int | None = None) -> None:
        self.log.append(used_tokens)


class FlowDouble(FlowControl):
    """Admits, or sheds with flow control's 429, and records what it saw."""

    def __init__(self, shed: bool) -> None:
        self.shed, self.seen, self.released = shed, [], []

    async def acquire(self, req: FlowRequest) -> FlowTicket:
        self.seen.append(req)
        if self.shed:
            raise APIError(429, "band 3 is full; retry later",
                           headers={"Retry-After": "2", REASON_HEADER: "band-full"})
        return Recorded(self.released)

    def kick(self) -> None:
        pass

    async def close(self) -> None:
        pass
