"""The router's upstream HTTP/1.1 client against raw asyncio servers on real sockets: framing,
keep-alive reuse, streaming, flow control, timeouts and every way a worker can fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest

from tandem.router.upstream import (
    WATCH_S,
    UpstreamError,
    UpstreamPool,
    UpstreamSettings,
    UpstreamStalled,
    UpstreamTimeout,
)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return lines[0].encode(), headers, body


@contextlib.asynccontextmanager
async def serve(handler):
    """A TCP server on a free loopback port running `handler(reader, writer)`; yields its URL
    and the list of connections it accepted."""
    accepted: list[int] = []

    async def on_client(reader, writer):
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


def run(coro):
    return asyncio.run(coro)


def json_answer(payload: dict, extra: bytes = b"") -> bytes:
    body = json.dumps(payload).encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def test_requests_are_framed_and_connections_reused():
    async def echo_forever(reader, writer):
        while True:
            line, headers, body = await read_request(reader)
            writer.write(json_answer({"line": line.decode(), "headers": headers,
                                      "body": body.decode()}, b"x-extra: 1\r\n"))
            await writer.drain()

    async def main():
        async with serve(echo_forever) as (url, accepted):
            pool = UpstreamPool()
            for i in range(5):
                resp = await pool.post(url, "/v1/completions", f'{{"n": {i}}}'.encode(),
                                       {"Content-Type": "application/json", "X-Request-Id": "r1"})
                assert resp.status == 200
                assert ("x-extra", "1") in resp.headers
                got = json.loads(await resp.read())
                resp.release()
                assert got["line"] == "POST /v1/completions HTTP/1.1"
                assert got["body"] == f'{{"n": {i}}}'
                assert got["headers"]["x-request-id"] == "r1"
                assert got["headers"]["host"] == url.split("//")[1]
            assert pool.opened == 1 and len(accepted) == 1  # one keep-alive connection
            await pool.close()

    run(main())


def test_chunked_streams_arrive_as_they_are_sent():
    async def sse(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            event = f"data: {i}\n\n".encode()
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep-alive: wait for the client to go

    async def main():
        async with serve(sse) as (url, _):
            pool = UpstreamPool()
            resp = await pool.post(url, "/s", b"{}", {})
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            seen = []
            async for chunk in resp.chunks():
                seen.append((chunk, loop.time() - t0))
            resp.release()
            assert b"".join(c for c, _ in seen) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert seen[0][1] < 0.15  # the first event did not wait for the last
            await pool.close()

    run(main())


def test_a_large_body_survives_flow_control_byte_for_byte():
    blob = os.urandom(5 << 20)

    async def big(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(blob)).encode()
                     + b"\r\n\r\n")
        for i in range(0, len(blob), 1 << 16):
            writer.write(blob[i:i + (1 << 16)])
            await writer.drain()
        await reader.read()

    async def main():
        async with serve(big) as (url, _):
            pool = UpstreamPool()
            resp = await pool.post(url, "/big", b"x" * 100_000, {})
            got = bytearray()
            async for chunk in resp.chunks():
                got += chunk
                await asyncio.sleep(0)  # a slow consumer: reading pauses and resumes
            assert bytes(got) == blob
            resp.release()
            await pool.close()

    run(main())


def test_a_body_that_ends_with_the_connection():
    async def http10(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async def main():
        async with serve(http10) as (url, _):
            pool = UpstreamPool()
            resp = await pool.post(url, "/", b"", {})
            assert await resp.read() == b"all of it"
            resp.release()
            assert pool._take_idle(pool._target(url)[:2]) is None  # not kept: it closed
            await pool.close()

    run(main())


def test_failures_raise_upstream_errors():
    async def dies_mid_body(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    async def garbage(reader, writer):
        await read_request(reader)
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def silent(reader, writer):
        await read_request(reader)
        await asyncio.sleep(5)

    async def main():
        pool = UpstreamPool(UpstreamSettings(read_timeout_s=0.3))
        async with serve(dies_mid_body) as (url, _):
            resp = await pool.post(url, "/", b"", {})
            with pytest.raises(UpstreamError, match="connection lost"):
                await resp.read()
            resp.release()  # an unfinished response closes its connection
        async with serve(garbage) as (url, _):
            with pytest.raises(UpstreamError, match="bad HTTP"):
                await pool.post(url, "/", b"", {})
        async with serve(silent) as (url, _):
            with pytest.raises(UpstreamTimeout, match="response headers"):
                await pool.post(url, "/", b"", {})
        async with serve(silent) as (url, _):
            pass  # closed: nothing listens on its port any more
        with pytest.raises(UpstreamError, match="cannot connect"):
            await pool.post(url, "/", b"", {})
        with pytest.raises(UpstreamError, match="unsupported"):
            await pool.post("https://example.invalid", "/", b"", {})
        await pool.close()

    run(main())


def test_a_watched_stream_fails_as_stalled_only_when_the_check_says_so():
    """A worker that sends one chunk and freezes: a `stalled` check that says so after 0.6 s
    of silence ends the read then (not at the read timeout); one that never says so keeps
    reading, through silences longer than WATCH_S, to the end or the read timeout."""
    async def freezes(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(3 * WATCH_S)
        writer.write(b"3\r\ndef\r\n")  # alive again, slowly, then done
        await writer.drain()
        await asyncio.sleep(3 * WATCH_S)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def main():
        pool = UpstreamPool(UpstreamSettings(read_timeout_s=30))
        async with serve(freezes) as (url, _):
            resp = await pool.post(url, "/", b"", {})
            seen: list[float] = []
            got = []
            loop = asyncio.get_running_loop()
            t0 = loop.time()

            def stalled(silent: float) -> bool:
                seen.append(silent)
                return silent >= 0.6

            with pytest.raises(UpstreamStalled, match="no response bytes for"):
                async for chunk in resp.chunks(stalled=stalled):
                    got.append(chunk)
            assert got == [b"abc"] and 0.6 <= loop.time() - t0 < 1.5
            assert seen and max(seen) >= 0.6
            resp.close()

            resp = await pool.post(url, "/", b"", {})  # a fresh connection
            body = b"".join([c async for c in resp.chunks(stalled=lambda s: False)])
            assert body == b"abcdef"
            resp.release()
        pool = UpstreamPool(UpstreamSettings(read_timeout_s=0.8))
        async with serve(freezes) as (url, _):
            resp = await pool.post(url, "/", b"", {})
            with pytest.raises(UpstreamTimeout, match="within 0.8 s"):
                async for _ in resp.chunks(stalled=lambda s: False):
                    pass
            resp.close()
        await pool.close()

    run(main())


def test_closing_a_stream_early_disconnects_the_worker():
    async def main():
        disconnected = asyncio.Event()

        async def endless(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            try:
                while not reader.at_eof():  # EOF: the client closed its side
                    writer.write(b"5\r\nhello\r\n")
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.01):
                            await reader.read(1)
            finally:
                disconnected.set()

        async with serve(endless) as (url, _):
            pool = UpstreamPool()
            resp = await pool.post(url, "/", b"", {})
            async for _ in resp.chunks():
                break
            resp.close()
            async with asyncio.timeout(2):
                await disconnected.wait()
            await pool.close()

    run(main())


def test_stale_idle_connections_are_not_reused():
    async def echo_forever(reader, writer):
        while True:
            await read_request(reader)
            writer.write(json_answer({}))
            await writer.drain()

    async def main():
        async with serve(echo_forever) as (url, accepted):
            pool = UpstreamPool(UpstreamSettings(max_idle_s=0.1))
            for pause in (0.0, 0.3):
                await asyncio.sleep(pause)
                resp = await pool.post(url, "/", b"", {})
                await resp.read()
                resp.release()
            assert pool.opened == 2 and len(accepted) == 2
            await pool.close()

    run(main())


def test_connections_counts_those_in_use_and_idle_and_forgets_closed_ones():
    async def answer_once(reader, writer):  # then the worker goes (a kill closes the socket)
        await read_request(reader)
        await asyncio.sleep(0.2)
        writer.write(json_answer({}))
        await writer.drain()

    async def main():
        async with serve(answer_once) as (url, _):
            pool = UpstreamPool()
            assert pool.connections() == (0, 0)
            asks = [asyncio.ensure_future(pool.post(url, "/", b"", {})) for _ in range(2)]
            await asyncio.sleep(0.1)
            assert pool.connections() == (2, 0)  # both waiting for their answers
            for ask in asks:
                resp = await ask
                await resp.read()
                resp.release()
            await asyncio.sleep(0.1)  # the server has closed both idle connections
            assert not pool._open  # forgotten when lost, whether or not anyone counts them
            assert pool.connections() == (0, 0)  # never negative: closed idle ones drop out
            await pool.close()

    run(main())
