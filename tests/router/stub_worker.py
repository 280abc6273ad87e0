"""A Tandem-shaped stub worker on a real port (`Served`, uvicorn in a thread) for router
process tests: `/ready` as a worker answers it (503 while `loading`, naming its model as a
loading Tandem worker does), `/v1/completions` (JSON or SSE) with exact `usage`, and a slow
stream on request: `slow_stream(chunks, delay)`'s X-Request-Id (the router passes a
client's id through; a field the body does not declare it refuses); `finished_streams` and
`aborted_streams` count the streams that ended and those the client cut short. `StubKV`:
its gRPC side (KV events with media, load reports)."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from concurrent import futures

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tests.router.test_router_app import Served

COMPLETION_TOKENS = 5  # per sequence, in every answer's usage
_SLOW = "stub-stream:"


def slow_stream(chunks: int, delay: float = 0.0) -> dict[str, str]:
    """Headers asking a stub for a stream of `chunks` events, `delay` seconds apart."""
    return {"X-Request-Id": f"{_SLOW}{chunks}:{delay}"}


def stream_shape(request: Request, chunks: int = 3) -> tuple[int, float]:
    """(chunks, delay) a request asks for with `slow_stream`, else (`chunks`, 0)."""
    rid = request.headers.get("x-request-id", "")
    if not rid.startswith(_SLOW):
        return chunks, 0.0
    n, delay = rid[len(_SLOW):].split(":")
    return int(n), float(delay)


class StubWorker:
    def __init__(self, port: int, model: str = "stub-model", max_model_len: int = 400,
                 loading: bool = False) -> None:
        self.port, self.model, self.max_model_len = port, model, max_model_len
        self.url = f"http://127.0.0.1:{port}"
        self.loading = loading
        self.bodies: list[dict] = []
        self.finished_streams = 0
        self.aborted_streams = 0  # streams cut short by the client (connection closed)
        self.served = Served(self.app(), lean=False, port=port)

    def stop(self) -> None:
        self.served.stop()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ready")
        async def ready() -> JSONResponse:
            body = {"status": "loading" if self.loading else "ready", "role": "both",
                    "model": self.model}
            if self.loading:
                return JSONResponse(body, status_code=503)
            return JSONResponse({**body, "block_size": 16,
                                 "max_model_len": self.max_model_len})

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def completions(request: Request):  # noqa: ANN202
            body = await request.json()
            self.bodies.append(body)
            prompt = body["prompt"]
            n = body.get("n", 1)
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 1,
                     "completion_tokens": COMPLETION_TOKENS * n}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            if not body.get("stream"):
                return {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                        "choices": [{"index": i, "text": "abcde", "finish_reason": "length"}
                                    for i in range(n)], "usage": usage}
            chunks, delay = stream_shape(request)
            want_usage = (body.get("stream_options") or {}).get("include_usage")

            async def events():  # noqa: ANN202
                try:
                    for i in range(chunks):
                        await asyncio.sleep(delay)
                        yield "data: " + json.dumps({
                            "id": "cmpl-1", "object": "text_completion",
                            "choices": [{"index": 0, "text": f"t{i}",
                                         "finish_reason": None}]}) + "\n\n"
                    if want_usage:
                        yield "data: " + json.dumps({"id": "cmpl-1", "choices": [],
                                                     "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                except (asyncio.CancelledError, GeneratorExit):  # the client went away
                    self.aborted_streams += 1
                    raise
                self.finished_streams += 1

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


class StubKV(worker_pb2_grpc.WorkerServicer):
    """A stub worker's gRPC side on a real port (a thread-pool server): `SubscribeKVEvents`
    sends a snapshot of what the stub holds now (device, host-only and disk-only block
    lists: the initial ones, changed by every event since) and then whatever `send` queues
    (`stored` / `removed` with a medium, `cleared`), numbered in order, to every subscriber
    (each stream its own queue, so a resubscribing router misses nothing, as with a real
    worker); `GetLoad` answers `load` (a `worker_pb2.Load`, the measured tier and peer
    costs included)."""

    def __init__(self, load: worker_pb2.Load | None = None, block_size: int = 16,
                 device: list[bytes] | None = None, host: list[bytes] | None = None,
                 disk: list[bytes] | None = None) -> None:
        self.load = load or worker_pb2.Load()
        self.block_size = block_size
        # medium -> the blocks held there, in order (dicts as ordered sets)
        self._held = {"device": dict.fromkeys(device or []), "host": dict.fromkeys(host or []),
                      "disk": dict.fromkeys(disk or [])}
        self._subscribers: list[queue.Queue[worker_pb2.KVEvent]] = []
        self._seq = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)

    def send(self, kind: str, hashes: list[bytes] = (), medium: str = "") -> None:
        with self._lock:
            self._seq += 1
            ev = worker_pb2.KVEvent(seq=self._seq)
            held = self._held[medium or "device"]
            if kind == "stored":
                ev.stored.CopyFrom(worker_pb2.BlockStored(block_hashes=hashes, medium=medium,
                                                          block_size=self.block_size))
                held.update(dict.fromkeys(hashes))
            elif kind == "removed":
                ev.removed.CopyFrom(worker_pb2.BlockRemoved(block_hashes=hashes, medium=medium))
                for h in hashes:
                    held.pop(h, None)
            else:
                ev.cleared.CopyFrom(worker_pb2.AllBlocksCleared())
                for tier in self._held.values():
                    tier.clear()
            for q in self._subscribers:
                q.put(ev)

    def SubscribeKVEvents(self, request, context):  # noqa: N802, ANN001, ANN201
        mine: queue.Queue[worker_pb2.KVEvent] = queue.Queue()
        with self._lock:  # the snapshot and the events after it, with no gap
            seq = self._seq
            device, host, disk = (list(self._held[m]) for m in ("device", "host", "disk"))
            self._subscribers.append(mine)
        try:
            yield worker_pb2.KVEventBatch(block_size=self.block_size, snapshot=worker_pb2.Snapshot(
                seq=seq, instance_id="stub", block_hashes=device, host_block_hashes=host,
                disk_block_hashes=disk))
            while context.is_active():
                try:
                    ev = mine.get(timeout=0.05)
                except queue.Empty:
                    continue
                yield worker_pb2.KVEventBatch(events=[ev])
        finally:
            with self._lock:
                self._subscribers.remove(mine)

    def GetLoad(self, request, context):  # noqa: N802, ANN001, ANN201
        return self.load
