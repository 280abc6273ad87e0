"""HTTP/1.1 wire pieces of the lean server (`protocol.http_server`): its limits and stats,
status lines, body framing, the parsed-request record, and the answer a draining server
gives by itself."""

from __future__ import annotations

import http
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from tandem.protocol.web import error_body

MAX_URL_BYTES = 8 << 10


@dataclass
class ServerLimits:
    max_headers: int = 100
    max_header_bytes: int = 64 << 10
    keep_alive_s: float = 5.0
    graceful_s: float = 5.0  # the drain: in-flight requests' time to finish after a stop
    send_timeout_s: float = 30.0  # a write waiting this long for the client to read: cut
    max_connections: int = 4096  # concurrent connections; more are closed at accept


@dataclass
class ServerStats:
    """What the server holds now (and its peak write buffer): for tests and debugging."""

    connections: int
    write_buffered: int  # bytes in the connections' transports, not yet sent
    pending_requests: int  # parsed, waiting behind the request in progress
    pending_bytes: int  # their bytes, plus input read but not yet parsed
    peak_write_buffered: int  # the most one connection's transport held after a write
    refused: int  # connections closed at accept (`max_connections`)


def status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


STATUS_LINES = {s.value: status_line(s.value) for s in http.HTTPStatus}


def frame(data: bytes, chunked: bool) -> bytes:
    """One piece of a response body as it goes on the wire."""
    return b"%x\r\n%b\r\n" % (len(data), data) if chunked else data


class Reject(Exception):
    """A request refused while parsing: answered `status`, then the connection closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SendTimeout(Exception):
    """The client took no bytes for `send_timeout_s`; the connection is aborted."""


class ParsedRequest:
    """One request as parsed (or a `reject` to answer in its place)."""

    __slots__ = ("method", "url", "headers", "parts", "size", "nbytes", "version",
                 "keep_alive", "reject")

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes] = []
        self.size = 0  # header bytes while parsing them, then body bytes
        self.nbytes = 0  # URL + headers + body, once parsed (pipelining bound)
        self.version = "1.1"
        self.keep_alive = True
        self.reject: Reject | None = None


DRAIN_READY_PATH = b"/ready"  # answered 503 by the server itself while it drains
DRAIN_OPEN_PATHS = (b"/health", b"/metrics")  # still served by the app while it drains


def draining_answer(path: bytes) -> Response:
    """What a draining server answers a new request for `path` (module doc of
    `http_server`)."""
    if path == DRAIN_READY_PATH:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse(error_body(503, "the server is shutting down; retry on another "
                                        "replica", type_="server_error"),
                        status_code=503, headers={"Retry-After": "1"})
