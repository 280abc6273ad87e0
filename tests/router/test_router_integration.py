"""Real workers (with gRPC KV events) behind a real router process, over real sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.bundled import BUNDLED_NAME, find_bundled_gguf
from tandem.protocol.tokenizer import Tokenizer
from tandem.router import prompt as prompts
from tests.serving.helpers import free_port, signing_channel, start_worker, worker_key_file

pytestmark = pytest.mark.slow
SYSTEMS = [
    "You are a meticulous assistant for a shipping company. " * 12,
    "You are a cheerful tutor who explains mathematics with small steps. " * 12,
    "You are a terse code reviewer. Answer in one sentence, no greetings. " * 12,
]


def _metric(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class RouterProcess:
    def __init__(self, tmp_path, workers: list[str], *args: str, auth: bool = True) -> None:
        """A router process; with `auth` (unless `args` name one) it signs with the test
        workers' key."""
        self.port = free_port()
        auth_flag = "--worker-auth-key-file"
        extra = [auth_flag, worker_key_file(tmp_path)] if auth and auth_flag not in args else []
        extra.append("--debug-headers")  # the tests read x-tandem-worker
        if "--api-keys" in args:
            extra.append("--no-metrics-auth")  # ... and /metrics without a key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"router-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "router", "--port", str(self.port),
                 "--workers", ",".join(workers), "--seed", "0", *extra, *args],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_events(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if _metric(self.url, "tandem_router_worker_kv_events_connected") >= n:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log()
            time.sleep(0.2)
        raise TimeoutError(self.log())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    workers = []
    try:
        for _ in range(3):
            workers.append(start_worker(tmp, "--grpc-port", str(free_port()),
                                        "--num-kv-blocks", "160", wait_ready=False))
        for w in workers:
            from tests.serving.helpers import wait_for

            wait_for(w, "/ready", 200, timeout=240)
        router = RouterProcess(tmp, [w.url for w in workers])
        router.wait_events(3)
        yield router, workers
        router.stop()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.stop()


def _chat(router_url: str, system: str, user: str, **extra) -> httpx.Response:
    return httpx.post(router_url + "/v1/chat/completions", timeout=120, json={
        "model": BUNDLED_NAME, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra})


def test_each_prefix_group_sticks_to_the_replica_that_holds_it(cluster):
    router, workers = cluster
    hits_before = sum(_metric(w.url, "vllm:prefix_cache_hits_total") for w in workers)
    placement: dict[int, set[str]] = {}
    for round_ in range(4):
        for g, system in enumerate(SYSTEMS):
            r = _chat(router.url, system, f"Question {round_} for group {g}?")
            assert r.status_code == 200, r.text
            placement.setdefault(g, set()).add(r.headers["x-tandem-worker"])
    assert all(len(v) == 1 for v in placement.values()), placement
    assert len(set().union(*placement.values())) >= 2  # cold groups spread by load
    hits = sum(_metric(w.url, "vllm:prefix_cache_hits_total") for w in workers) - hits_before
    assert hits >= 3 * 3 * 100  # 3 groups x 3 warm rounds x >100 shared prompt tokens
    assert _metric(router.url, "tandem_router_decisions_total", 'reason="prefix_hit"') >= 9


def test_router_hashes_equal_the_workers_block_hashes(cluster):
    router, workers = cluster
    body = {"model": BUNDLED_NAME, "messages": [
        {"role": "system", "content": "Hash agreement check. " * 20},
        {"role": "user", "content": "Ünïcödé and emoji 🚀 too"}], "cache_salt": "tenant-x"}
    r = httpx.post(router.url + "/v1/chat/completions", timeout=120,
                   json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    worker = next(w for w in workers if w.url == r.headers["x-tandem-worker"])
    ready = httpx.get(worker.url + "/ready", timeout=5).json()
    parsed = prompts.parse("chat", body, Tokenizer.load(find_bundled_gguf()))
    want = prompts.block_hashes(parsed, BUNDLED_NAME, ready["block_size"])
    assert len(want) >= 5
    with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as ch:
        stream = worker_pb2_grpc.WorkerStub(signing_channel(ch)).SubscribeKVEvents(
            worker_pb2.SubscribeKVEventsRequest())
        held = set(next(stream).snapshot.block_hashes)
        stream.cancel()
    assert set(want) <= held
    unsalted = prompts.block_hashes(prompts.parse("chat", {**body, "cache_salt": None},
                                                  Tokenizer.load(find_bundled_gguf())),
                                    BUNDLED_NAME, ready["block_size"])
    assert not set(unsalted) & set(want)  # the salt gives a disjoint hash space


def test_unknown_model_and_bad_body_are_answered_by_the_router(cluster):
    router, _ = cluster
    r = httpx.post(router.url + "/v1/completions", timeout=10,
                   json={"model": "gpt-17", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(router.url + "/v1/completions", timeout=10, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [BUNDLED_NAME]
    # the context length the workers report on /ready (every worker here has the same one)
    worker = httpx.get(cluster[1][0].url + "/ready", timeout=10).json()
    assert models["data"][0]["max_model_len"] == worker["max_model_len"] > 0


def test_two_router_replicas_agree_on_routing(cluster, redis_url, tmp_path):
    """Active-active: a second replica (this one also mirroring the index into Redis) hears
    the same KV events, so a group's requests land on one worker whichever replica takes
    them; a third replica started afterwards agrees from its first request."""
    router_a, workers = cluster
    router_b = RouterProcess(tmp_path, [w.url for w in workers], "--index", redis_url)
    router_c = None
    try:
        router_b.wait_events(3)
        systems = [f"Replica agreement group {g}: you answer about topic {g}. " * 14
                   for g in range(3)]
        placement: dict[int, set[str]] = {}
        for round_ in range(4):
            for g, system in enumerate(systems):
                via = (router_a, router_b)[(round_ + g) % 2]
                held = [_metric(x.url, "tandem_router_worker_indexed_blocks")
                        for x in (router_a, router_b)]
                r = _chat(via.url, system, f"Round {round_}?")
                assert r.status_code == 200, r.text
                placement.setdefault(g, set()).add(r.headers["x-tandem-worker"])
                # the worker's BlockStored reaches both replicas (a new group's blocks first)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    a, b = (_metric(x.url, "tandem_router_worker_indexed_blocks") - h
                            for x, h in zip((router_a, router_b), held, strict=True))
                    if a == b and (round_ > 0 or a > 0):
                        break
                    time.sleep(0.02)
        assert all(len(v) == 1 for v in placement.values()), placement
        router_c = RouterProcess(tmp_path, [w.url for w in workers], "--index", redis_url)
        router_c.wait_events(3)
        for g, system in enumerate(systems):
            r = _chat(router_c.url, system, "A new replica's first question")
            assert r.status_code == 200, r.text
            assert {r.headers["x-tandem-worker"]} == placement[g]
        assert _metric(router_c.url, "tandem_router_index_store_lookups_total",
                       'result="ok"') >= 3
    finally:
        router_b.stop()
        if router_c is not None:
            router_c.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_aborts_the_request_on_the_worker(cluster, stream):
    """Through the router, a client gone mid-request frees the worker's blocks within a
    second, streamed or not."""
    from tests.serving.helpers import metric, wait_idle

    router, workers = cluster
    body = json.dumps({"model": BUNDLED_NAME, "prompt": "Count slowly:", "max_tokens": 2000,
                       "ignore_eos": True, "temperature": 0, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 60
    while sum(metric(w.url, "vllm:num_requests_running") for w in workers) < 1:
        assert time.monotonic() < deadline, router.log()
        time.sleep(0.05)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    for w in workers:
        wait_idle(w.url, within=1.0)


def test_a_worker_killed_mid_stream_is_migrated_and_traffic_moves(cluster):
    """kill -9 of the worker serving a stream: the router resumes it on a survivor (token
    replay), so the client's stream ends normally with an undisturbed run's text."""
    router, workers = cluster
    body = {"model": BUNDLED_NAME, "prompt": "Count slowly:", "max_tokens": 120,
            "ignore_eos": True, "temperature": 0, "stream": True}
    events: list[str] = []
    t0 = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        victim = next(w for w in workers if w.url == r.headers["x-tandem-worker"])
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    victim.proc.send_signal(signal.SIGKILL)
    assert time.monotonic() - t0 < 60  # no hang
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    want = httpx.post(router.url + "/v1/completions", json={**body, "stream": False},
                      timeout=120)
    assert want.status_code == 200 and want.headers["x-tandem-worker"] != victim.url
    assert text == want.json()["choices"][0]["text"]
    assert _metric(router.url, "tandem_router_migrations_total") >= 1
    victim.proc.wait(timeout=10)
    # every group still gets answered, by the survivors only
    for g, system in enumerate(SYSTEMS):
        r = _chat(router.url, system, f"After the crash, group {g}")
        assert r.status_code == 200, r.text
        assert r.headers["x-tandem-worker"] != victim.url
