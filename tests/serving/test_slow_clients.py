"""A client cannot hold a worker's engine, KV cache or memory longer than the server allows:
a stream whose reader stops is aborted (by `request_timeout_s`, which covers the sends, or
by `stream_send_timeout_s`) and its connection closed, a closed connection frees its
requests at once, and the tokenizer pool's queue is bounded (429 + Retry-After). Real
sockets against the worker app under uvicorn, with a tiny random model."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving.api_server import ServerSettings, build_app
from tandem.serving.sse import TAIL_GRACE_S
from tests.engine.utils import make_tiny_model_dir

from .helpers import metric

NAME = "tiny"
# n=4 long samples with logprobs: a few KiB of SSE per engine step
STREAM = {"model": NAME, "prompt": "a stalled reader", "n": 4, "max_tokens": 3000,
          "ignore_eos": True, "logprobs": 5, "stream": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-slow")
    make_tiny_model_dir(path, "llama", seed=21, max_position_embeddings=4096)
    return str(path)


def _serve(model_dir: str, **settings) -> Iterator[str]:
    """The worker app with `settings` under uvicorn on a real port, in a thread."""
    def load() -> AsyncLLMEngine:
        return AsyncLLMEngine.from_args(model_dir, served_model_name=NAME, block_size=16,
                                        kv_cache_memory=32 << 20)

    app = build_app(ServerSettings(served_model_name=NAME, max_n=4, **settings), load)
    # a fixed 16 KiB send buffer (accepted sockets inherit it): loopback's autotuning would
    # otherwise let the kernel take megabytes before a stopped reader blocks a send
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the worker never got ready"
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def deadline_server(model_dir) -> Iterator[str]:
    """--request-timeout 2 s; the send timeout (30 s) never fires first."""
    yield from _serve(model_dir, request_timeout_s=2.0)


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[str]:
    """A stream whose sends block for 1 s is stalled; two tokenizer jobs at most."""
    yield from _serve(model_dir, stream_send_timeout_s=1.0, tokenizer_threads=2,
                      max_pending_tokenize=2)


def _open_stream(url: str, body: dict) -> socket.socket:
    """A streaming completion on a socket with a 4 KiB receive buffer that reads nothing."""
    port = int(url.rsplit(":", 1)[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: worker\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def _running(url: str) -> float:
    return metric(url, "vllm:num_requests_running")


def _wait_running(url: str, want: float, within: float) -> float:
    """Seconds until the worker runs `want` requests (fails after `within`)."""
    t0 = time.monotonic()
    while _running(url) != want:
        assert time.monotonic() - t0 < within, f"{_running(url)} running, not {want}"
        time.sleep(0.02)
    return time.monotonic() - t0


def _read_to_eof(sock: socket.socket, within: float) -> bytes:
    """Everything the server sent, once it closed the connection (fails after `within`)."""
    sock.settimeout(within)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


def test_a_stalled_reader_is_aborted_at_the_request_deadline(deadline_server):
    url = deadline_server
    t0 = time.monotonic()
    sock = _open_stream(url, STREAM)
    try:
        _wait_running(url, 4, within=2.0)
        time.sleep(0.5)  # the reader is stalled by now: its buffers are full
        assert _running(url) == 4
        # the deadline covers the blocked sends: all 4 samples aborted, their KV freed
        _wait_running(url, 0, within=2.0 + 1.5 - (time.monotonic() - t0))
        assert metric(url, "vllm:kv_cache_usage_perc") == 0.0
        # the closing chunks cannot be handed over (TAIL_GRACE_S): the connection is closed,
        # so the client reads what was buffered, then EOF
        time.sleep(TAIL_GRACE_S + 0.3)
        data = _read_to_eof(sock, within=5)
        assert data.startswith(b"HTTP/1.1 200 OK") and b"data: " in data
        assert not data.endswith(b"0\r\n\r\n")  # cut, not a completed chunked response
    finally:
        sock.close()
    r = httpx.post(url + "/v1/completions", timeout=30,
                   json={"model": NAME, "prompt": "still serving", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_stalled_reader_is_aborted_after_the_send_timeout(server):
    url = server
    sock = _open_stream(url, STREAM)
    try:
        _wait_running(url, 4, within=2.0)
        # buffers fill within well under a second, then sends block 1 s: aborted
        waited = _wait_running(url, 0, within=3.0)
        assert metric(url, "vllm:kv_cache_usage_perc") == 0.0
        assert waited < 3.0
        data = _read_to_eof(sock, within=5)
        assert not data.endswith(b"0\r\n\r\n")
    finally:
        sock.close()


def test_closing_a_stalled_connection_frees_its_requests_at_once(server):
    url = server
    sock = _open_stream(url, {**STREAM, "max_tokens": 3000})
    _wait_running(url, 4, within=2.0)
    time.sleep(0.3)  # stalled (the send timeout, 1 s, has not passed)
    assert _running(url) == 4
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # unread data: a reset, as a client that gives up
    waited = _wait_running(url, 0, within=0.5)
    assert waited < 0.5
    assert metric(url, "vllm:kv_cache_usage_perc") == 0.0


def test_closing_a_connection_before_the_first_token_frees_its_requests(server):
    """Disconnect noticed while waiting for the engine, not only at a send."""
    url = server
    sock = _open_stream(url, {**STREAM, "n": 2, "max_tokens": 3000, "logprobs": None})
    _wait_running(url, 2, within=2.0)
    sock.close()  # read side too: a FIN, nothing unread yet maybe
    _wait_running(url, 0, within=0.5)


def test_a_full_tokenizer_queue_answers_429_with_retry_after(server, monkeypatch):
    url = server
    release, entered = threading.Event(), threading.Semaphore(0)
    real_encode = Tokenizer.encode

    def encode(self, text, *args, **kwargs):
        if text == "block":
            entered.release()
            assert release.wait(30)
        return real_encode(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    pool = ThreadPoolExecutor(2)
    try:
        blocked = [pool.submit(httpx.post, url + "/tokenize", json={"prompt": "block"},
                               timeout=30) for _ in range(2)]
        for _ in range(2):  # both jobs hold the pool's two slots (max_pending_tokenize=2)
            assert entered.acquire(timeout=10)
        full = httpx.post(url + "/v1/completions", timeout=5,
                          json={"model": NAME, "prompt": "one more", "max_tokens": 2})
        assert full.status_code == 429
        assert full.headers["retry-after"] == "1"
        err = full.json()["error"]
        assert err["code"] == 429 and "tokenized" in err["message"]
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 429
        release.set()
        assert [f.result().status_code for f in blocked] == [200, 200]
        ok = httpx.post(url + "/v1/completions", timeout=30,
                        json={"model": NAME, "prompt": "one more", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        release.set()
        pool.shutdown()
