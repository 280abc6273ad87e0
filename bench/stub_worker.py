"""A stub Tandem worker for router benchmarks: answers at once, publishes a fixed KV snapshot.

    .venv/bin/python bench/stub_worker.py --port 9001 --grpc-port 9002 \\
        [--hashes-file F] [--random-blocks N] [--delay-ms 0] [--http raw|asgi] \\
        [--stream-text TEXT] [--stream-delta-chars N]

HTTP (one event loop, uvloop when installed):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: a fixed small OpenAI-shaped JSON
  body (or, when the body asks for ``"stream": true``, SSE: the answer's text as content
  events, a usage event and ``data: [DONE]``, all in one Content-Length response), after
  ``--delay-ms`` (default 0: at once). The body is not parsed. ``--stream-text`` sets the
  streamed answer (default ``x``) and ``--stream-delta-chars N`` splits it into events of N
  characters (0: one event), the last with ``finish_reason`` "length".
* ``GET /ready``: what a Tandem worker answers (status, role, model, grpc_port, block_size,
  max_model_len), with the bundled model's served name, so the router tokenizes with the
  bundled tokenizer; ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (empty).

``--http raw`` (default) is a hand-written HTTP/1.1 keep-alive responder on
``asyncio.Protocol``: no framework, no per-request task. ``--http asgi`` serves the same
answers from a bare ASGI callable under uvicorn + httptools, for comparison.

gRPC (grpcio, its own threads): the ``tandem.v1.Worker`` service. ``SubscribeKVEvents``
sends one snapshot (the 32-byte hashes of ``--hashes-file`` followed by ``--random-blocks``
random ones), then stays open without events until the client leaves; ``GetLoad`` answers
zeros.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.bundled import BUNDLED_NAME

BLOCK_SIZE = 16
STREAM_RE = re.compile(rb'"stream"\s*:\s*true')


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + ctype
            + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class Answers:
    """Every response the stub sends, pre-encoded (status line, headers, body)."""

    def __init__(self, model: str, grpc_port: int, max_model_len: int, stream_text: str = "x",
                 stream_delta_chars: int = 0) -> None:
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        completion = {"id": "cmpl-stub", "object": "text_completion", "created": 0,
                      "model": model, "choices": [{"index": 0, "text": "x", "logprobs": None,
                                                   "finish_reason": "length"}],
                      "usage": usage}
        chat = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0,
                "model": model, "choices": [{"index": 0, "message": {
                    "role": "assistant", "content": "x"}, "finish_reason": "length"}],
                "usage": usage}
        chat_chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
                      "model": model, "choices": []}
        completion_chunk = {**completion, "usage": None, "choices": []}
        step = stream_delta_chars or max(len(stream_text), 1)
        pieces = [stream_text[i:i + step] for i in range(0, len(stream_text), step)] or [""]

        def chat_choice(i: int, piece: str) -> dict:
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            return {"index": 0, "delta": delta,
                    "finish_reason": "length" if i == len(pieces) - 1 else None}

        def completion_choice(i: int, piece: str) -> dict:
            return {"index": 0, "text": piece, "logprobs": None,
                    "finish_reason": "length" if i == len(pieces) - 1 else None}

        def sse(chunk: dict, choice) -> bytes:  # noqa: ANN001 - (index, piece) -> choice
            events = [b"data: " + _json({**chunk, "choices": [choice(i, p)]})
                      for i, p in enumerate(pieces)]
            events.append(b"data: " + _json({**chunk, "choices": [], "usage": usage}))
            return b"\n\n".join(events) + b"\n\ndata: [DONE]\n\n"

        sse_type = b"text/event-stream"
        self.post = {
            "/v1/completions": (_response("200 OK", _json(completion)), _response(
                "200 OK", sse(completion_chunk, completion_choice), sse_type)),
            "/v1/chat/completions": (_response("200 OK", _json(chat)), _response(
                "200 OK", sse(chat_chunk, chat_choice), sse_type)),
        }
        self.get = {
            "/ready": _response("200 OK", _json({
                "status": "ready", "role": "both", "model": model, "grpc_port": grpc_port,
                "block_size": BLOCK_SIZE, "max_model_len": max_model_len})),
            "/health": _response("200 OK", _json({"status": "ok"})),
            "/v1/models": _response("200 OK", _json({"object": "list", "data": [{
                "id": model, "object": "model", "owned_by": "tandem",
                "max_model_len": max_model_len}]})),
            "/metrics": _response("200 OK", b"", b"text/plain; version=0.0.4"),
        }
        self.not_found = _response("404 Not Found", _json({"error": {
            "message": "not found", "type": "invalid_request_error", "code": 404}}))
        self.bad_request = _response("400 Bad Request", _json({"error": {
            "message": "bad request", "type": "invalid_request_error", "code": 400}}))

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        target = path.split(b"?", 1)[0].decode("latin-1")
        if method == b"POST":
            pair = self.post.get(target)
            if pair is None:
                return self.not_found
            return pair[1] if STREAM_RE.search(body) else pair[0]
        return self.get.get(target, self.not_found)


# -- HTTP: raw asyncio.Protocol -------------------------------------------------------------
class RawHTTP(asyncio.Protocol):
    """HTTP/1.1 keep-alive (and pipelining) with Content-Length bodies only."""

    answers: Answers
    delay_s: float = 0.0

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end])
            line, _, rest = head.partition(b"\r\n")
            parts = line.split(b" ")
            if len(parts) != 3:
                self._reply(self.answers.bad_request, close=True)
                return
            lower = rest.lower()
            length = 0
            i = lower.find(b"content-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i)
                length = int(lower[i + 15:j if j >= 0 else len(lower)])
            elif b"transfer-encoding: chunked" in lower:
                self._reply(self.answers.bad_request, close=True)  # not needed here
                return
            total = end + 4 + length
            if len(buf) < total:
                return
            body = bytes(buf[end + 4:total])
            del buf[:total]
            close = b"connection: close" in lower
            self._reply(self.answers.answer(parts[0], parts[1], body), close)
            if close:
                return

    def _reply(self, payload: bytes, close: bool) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.delay_s > 0:
            asyncio.get_running_loop().call_later(self.delay_s, self._write, payload, close)
        else:
            self._write(payload, close)

    def _write(self, payload: bytes, close: bool) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(payload)
        if close:
            t.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve_raw(host: str, port: int, answers: Answers, delay_s: float) -> None:
    RawHTTP.answers, RawHTTP.delay_s = answers, delay_s
    loop = asyncio.get_running_loop()
    server = await loop.create_server(RawHTTP, host, port, backlog=1024, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub worker: http://{host}:{port} (raw)", file=sys.stderr, flush=True)
    await stop.wait()
    server.close()


# -- HTTP: bare ASGI under uvicorn -----------------------------------------------------------
def asgi_app(answers: Answers, delay_s: float):  # noqa: ANN201 - an ASGI callable
    def split(raw: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = [tuple(x.strip() for x in h.split(b":", 1)) for h in lines[1:]]
        return status, headers, body  # type: ignore[return-value]

    async def app(scope: dict, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        raw = answers.answer(scope["method"].encode(), scope["path"].encode(), b"".join(chunks))
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        status, headers, body = split(raw)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def serve_asgi(host: str, port: int, answers: Answers, delay_s: float) -> None:
    import uvicorn

    loop = "uvloop" if _has_uvloop() else "asyncio"
    print(f"stub worker: http://{host}:{port} (asgi, uvicorn {loop})", file=sys.stderr,
          flush=True)
    uvicorn.run(asgi_app(answers, delay_s), host=host, port=port, loop=loop, http="httptools",
                log_level="warning", access_log=False, lifespan="on")


# -- gRPC ------------------------------------------------------------------------------------
class StubWorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, model: str, hashes: list[bytes], stop: threading.Event) -> None:
        self.model = model
        self.hashes = hashes
        self.stop = stop

    def SubscribeKVEvents(self, request, context):  # noqa: ANN001, ANN201, N802 - gRPC name
        snap = worker_pb2.Snapshot(seq=0, block_hashes=self.hashes)
        if "instance_id" in worker_pb2.Snapshot.DESCRIPTOR.fields_by_name:
            snap.instance_id = f"stub-{os.getpid()}"
        yield worker_pb2.KVEventBatch(worker_id="stub", model=self.model,
                                      block_size=BLOCK_SIZE, snapshot=snap)
        while context.is_active() and not self.stop.wait(0.5):
            pass  # no events: the snapshot stays true

    def GetLoad(self, request, context):  # noqa: ANN001, ANN201, N802 - gRPC name
        return worker_pb2.Load(worker_id="stub", model=self.model, role="both",
                               block_size=BLOCK_SIZE)


def start_grpc(host: str, port: int, service: StubWorkerService) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=[("grpc.max_send_message_length", 256 << 20)])
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    server.start()
    return server


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def load_hashes(path: str | None, random_blocks: int) -> list[bytes]:
    raw = Path(path).read_bytes() if path else b""
    if len(raw) % 32:
        raise SystemExit(f"{path}: not a multiple of 32 bytes")
    raw += os.urandom(32 * random_blocks)
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--model", default=BUNDLED_NAME)
    ap.add_argument("--max-model-len", type=int, default=65536)
    ap.add_argument("--hashes-file", default=None, help="raw 32-byte block hashes to hold")
    ap.add_argument("--random-blocks", type=int, default=0, help="extra random block hashes")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="synthetic answer delay")
    ap.add_argument("--http", choices=("raw", "asgi"), default="raw")
    ap.add_argument("--stream-text", default="x", help="the streamed answer's text")
    ap.add_argument("--stream-delta-chars", type=int, default=0,
                    help="characters per streamed content event (0: the text in one)")
    args = ap.parse_args(argv)

    stop = threading.Event()
    service = StubWorkerService(args.model, load_hashes(args.hashes_file, args.random_blocks),
                                stop)
    grpc_server = start_grpc(args.host, args.grpc_port, service)
    answers = Answers(args.model, args.grpc_port, args.max_model_len, args.stream_text,
                      args.stream_delta_chars)
    try:
        if args.http == "asgi":
            serve_asgi(args.host, args.port, answers, args.delay_ms / 1e3)
        else:
            if _has_uvloop():
                import uvloop

                uvloop.run(serve_raw(args.host, args.port, answers, args.delay_ms / 1e3))
            else:
                asyncio.run(serve_raw(args.host, args.port, answers, args.delay_ms / 1e3))
    finally:
        stop.set()
        grpc_server.stop(grace=0.5).wait(2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
