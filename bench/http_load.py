"""Open-loop Poisson load over raw keep-alive HTTP/1.1 connections, in a process of its own.

    .venv/bin/python bench/http_load.py --url http://127.0.0.1:8000 \\
        --path /v1/chat/completions --bodies bodies.json --rate 500 --duration 5 \\
        [--warmup 1] [--seed 0] [--connections 64]

Built to cost as little client CPU per request as possible, so that on a small machine the
client does not crowd out the servers it measures: no HTTP library, no task per request.
Each connection is an `asyncio.Protocol` (uvloop when installed) that writes one pre-encoded
request and parses the answer's status line and ``Content-Length`` (or its chunked framing,
as a streamed answer through a router comes back); a pool of idle
connections is opened before the run and grows only when every connection is busy, up to
``--max-connections``; past that, due requests wait in the client and their latency counts
from when they were due. A connection idle for ``KEEPALIVE_EXPIRY_S`` is closed rather than
reused (as HTTP clients' keep-alive expiry does): a server closes idle connections after its
keep-alive timeout (the router's: 5 s), and a request written just as that close arrives
would fail with a reset that says nothing about the server.

Arrivals: exponential gaps with mean ``1/rate`` from ``random.Random(seed)`` (the same seed
gives the same schedule), over ``warmup + duration`` seconds; requests scheduled in the
warm-up are sent but not recorded. ``--bodies`` is a JSON list of request bodies (strings),
used in turn. Latency is the client's send -> last byte of the response; ``lag`` is how late
the send was against its schedule (the client's own delay).

Protocol with a parent process on stdout: the line ``MEASURE`` when the first recorded
request goes out, then one JSON line with the results (latencies in seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import sys
import time
from collections import Counter, deque
from urllib.parse import urlsplit

perf = time.perf_counter
KEEPALIVE_EXPIRY_S = 4.0  # under the router's 5 s keep-alive timeout (module doc)


class Conn(asyncio.Protocol):
    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.idx = -1  # the request in flight on this connection, -1 when idle
        self.need = -1  # bytes of the whole response, once its head is parsed
        self.chunk_at = -1  # chunked: where the next chunk's size line starts (-1: not chunked)
        self.status = 0
        self.closing = False
        self.released = False  # counted out of the client's open connections
        self.idle_at = perf()  # when it last went idle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, idx: int, payload: bytes) -> None:
        self.idx = idx
        self.client.t_send[idx] = perf()
        self.transport.write(payload)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.idx < 0:
            return
        buf = self.buf
        buf += data
        if self.need < 0 and self.chunk_at < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            try:
                self.status = int(head[9:12])
            except ValueError:
                self._fail("bad status line")
                return
            self.closing = b"\r\nconnection: close" in head
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                self.need = end + 4 + int(head[i + 17:j if j >= 0 else len(head)])
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.chunk_at = end + 4
            else:
                self._fail("no content-length")
                return
        if self.chunk_at >= 0:
            self._chunks()
        if self.need >= 0 and len(buf) >= self.need:
            now = perf()
            idx, status = self.idx, self.status
            del buf[:self.need]
            self.need, self.idx = -1, -1
            self.client.finish(idx, status, now, self)

    def _chunks(self) -> None:
        """Walk the chunks that have arrived; at the last one (size 0, then no trailers or
        some), `need` is the whole response's length."""
        buf, at = self.buf, self.chunk_at
        while True:
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                break
            try:
                size = int(bytes(buf[at:eol]).split(b";", 1)[0], 16)
            except ValueError:
                self._fail("bad chunk size")
                return
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)  # the empty line after any trailers
                if end >= 0:
                    self.chunk_at, self.need = -1, end + 4
                return
            if len(buf) < eol + 2 + size + 2:
                break
            at = eol + 2 + size + 2
        self.chunk_at = at

    def _fail(self, why: str) -> None:
        idx, self.idx = self.idx, -1
        self.need = self.chunk_at = -1
        self.client.fail(idx, why, self)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.idx >= 0:
            idx, self.idx = self.idx, -1
            self.client.fail(idx, f"connection lost ({exc or 'closed by peer'})", self)
        self.client.release(self)
        self.transport = None


class Client:
    def __init__(self, host: str, port: int, n: int, max_connections: int) -> None:
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.open_connections = 0
        self.idle: list[Conn] = []
        self.queued: deque[tuple[int, bytes]] = deque()  # due, but every connection busy
        self.t_send: list[float] = [0.0] * n
        self.t_done: list[float] = [0.0] * n
        self.status: list[int] = [0] * n
        self.errors: Counter[str] = Counter()
        self.outstanding = 0
        self.max_in_flight = 0
        self.new_connections = 0
        self.drained = asyncio.Event()
        self.drained.set()

    async def connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        self.open_connections += 1
        try:
            _, conn = await loop.create_connection(lambda: Conn(self), self.host, self.port)
        except BaseException:
            self.open_connections -= 1
            raise
        return conn  # type: ignore[return-value]

    async def open(self, n: int) -> None:
        self.idle += await asyncio.gather(*(self.connect() for _ in range(n)))

    def submit(self, idx: int, payload: bytes) -> None:
        self.outstanding += 1
        self.max_in_flight = max(self.max_in_flight, self.outstanding)
        self.drained.clear()
        now = perf()
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None and not conn.closing:
                if now - conn.idle_at <= KEEPALIVE_EXPIRY_S:
                    conn.send(idx, payload)
                    return
                conn.closing = True  # expired (module doc)
                conn.transport.close()
                self.release(conn)
        if self.open_connections >= self.max_connections:
            self.t_send[idx] = perf()  # latency counts from when it was due
            self.queued.append((idx, payload))
            return
        self.new_connections += 1
        asyncio.get_running_loop().create_task(self._connect_and_send(idx, payload))

    async def _connect_and_send(self, idx: int, payload: bytes, keep_due: bool = False) -> None:
        if not keep_due:
            self.t_send[idx] = perf()  # connecting counts: the request was due now
        try:
            conn = await self.connect()
        except OSError as exc:
            self.fail(idx, f"connect: {exc}", None)
            return
        t = self.t_send[idx]
        conn.send(idx, payload)
        self.t_send[idx] = t

    def finish(self, idx: int, status: int, now: float, conn: Conn) -> None:
        self.t_done[idx] = now
        self.status[idx] = status
        if not conn.closing:
            if self.queued:
                nxt, payload = self.queued.popleft()
                t = self.t_send[nxt]
                conn.send(nxt, payload)
                self.t_send[nxt] = t
            else:
                conn.idle_at = now
                self.idle.append(conn)
        else:
            self.release(conn)
        self._settle()

    def fail(self, idx: int, why: str, conn: Conn | None) -> None:
        if conn is not None:
            self.release(conn)
        self.status[idx] = -1
        self.errors[why] += 1
        self._settle()

    def release(self, conn: Conn) -> None:
        """`conn` is gone: count it out once, and open replacements for waiting requests."""
        if conn.released:
            return
        conn.released = True
        self.open_connections -= 1
        loop = asyncio.get_running_loop()
        while self.queued and self.open_connections < self.max_connections:
            idx, payload = self.queued.popleft()
            self.new_connections += 1
            loop.create_task(self._connect_and_send(idx, payload, keep_due=True))

    def _settle(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.drained.set()


def arrivals(rate: float, total_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    out, t = [], 0.0
    while t < total_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_bytes(host: str, port: int, path: str, body: str) -> bytes:
    raw = body.encode()
    return (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
            ).encode() + raw


async def run(args: argparse.Namespace) -> dict:
    u = urlsplit(args.url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    bodies = json.loads(open(args.bodies).read())  # noqa: SIM115 - read once
    payloads = [request_bytes(host, port, args.path, b) for b in bodies]
    offsets = arrivals(args.rate, args.warmup + args.duration, args.seed)
    n = len(offsets)
    client = Client(host, port, n, max(args.max_connections, args.connections))
    await client.open(args.connections)
    lag = [0.0] * n
    first_measured = next((i for i, off in enumerate(offsets) if off >= args.warmup), n)
    sleep = asyncio.sleep
    t0 = perf() + 0.02
    cpu0 = wall0 = 0.0
    for idx, off in enumerate(offsets):
        target = t0 + off
        delay = target - perf()
        if delay > 0:
            await sleep(delay)
        if idx == first_measured:
            sys.stdout.write("MEASURE\n")
            sys.stdout.flush()
            cpu0, wall0 = time.process_time(), perf()
        lag[idx] = perf() - target
        client.submit(idx, payloads[(args.body_offset + idx) % len(payloads)])
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(client.drained.wait(), args.timeout)
    wall1, cpu1 = perf(), time.process_time()
    measured = range(first_measured, n)
    lat, unanswered, bad = [], 0, Counter()
    for i in measured:
        s = client.status[i]
        if s == 200:
            lat.append(client.t_done[i] - client.t_send[i])
        elif s == 0:
            unanswered += 1
        elif s > 0:
            bad[f"HTTP {s}"] += 1
    errors = dict(client.errors)
    errors.update(bad)
    if unanswered:
        errors[f"no answer within {args.timeout:g}s"] = unanswered
    window = max(wall1 - wall0, 1e-9)
    last_done = max((client.t_done[i] for i in measured if client.status[i] == 200),
                    default=wall0)
    return {"url": args.url, "path": args.path, "rate": args.rate, "duration_s": args.duration,
            "warmup_s": args.warmup, "seed": args.seed, "sent": len(measured),
            "ok": len(lat), "errors": errors,
            "achieved_rate": len(lat) / max(last_done - wall0, 1e-9),
            "window_s": window, "client_cpu_s": cpu1 - cpu0,
            "max_in_flight": client.max_in_flight, "connections": args.connections,
            "queued_at_end": len(client.queued),
            "new_connections": client.new_connections,
            "lag_s": sorted(lag[first_measured:]), "latency_s": lat}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--path", default="/v1/chat/completions")
    ap.add_argument("--bodies", required=True, help="JSON list of request bodies")
    ap.add_argument("--body-offset", type=int, default=0,
                    help="request i sends bodies[(offset + i) % len(bodies)]")
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--max-connections", type=int, default=512,
                    help="beyond this, due requests wait in the client (their wait counts)")
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(args))
    else:
        result = uvloop.run(run(args))
    write_all(sys.stdout.fileno(), (json.dumps(result) + "\n").encode())
    return 0


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`, blocking or not (the event loop may have left it
    non-blocking), through partial writes: a >64 KiB result line was cut short under load."""
    sys.stdout.flush()
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        view = view[n:]


if __name__ == "__main__":
    sys.exit(main())
