"""Peer pulls through two worker apps (a tiny random model, real gRPC between them): the
worker acts on `x-tandem-kv-peer` only under the router's signature (403 otherwise, before
anything is dialed), a signed request pulls the holder's blocks and answers with the
holder's tokens and its pulled tokens in `cached_tokens`, and the measured pull cost and the
block size appear in /ready and GetLoad."""

from __future__ import annotations

import json
import random
import time

import grpc
import pytest
from fastapi.testclient import TestClient

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey, sign
from tandem.protocol.web import PEER_HEADER, forward_target
from tandem.serving.api_server import ServerSettings, build_app
from tests.engine.utils import make_tiny_model_dir
from tests.serving.helpers import WORKER_KEY, free_port, signing_channel, worker_key_file

MODEL = "tiny-peer"
BS = 4
# 2 layers x (K, V) x 2 KV heads x 4 tokens x head_dim 16 x 4 bytes
BLOCK_BYTES = 2 * 2 * 2 * BS * 16 * 4


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """(holder, receiver) worker apps and their gRPC targets."""
    tmp = tmp_path_factory.mktemp("peer-http")
    make_tiny_model_dir(tmp / "model", "llama", seed=9)
    key = WorkerKey(worker_key_file(tmp))

    def load() -> AsyncLLMEngine:
        return AsyncLLMEngine.from_args(str(tmp / "model"), served_model_name=MODEL,
                                        block_size=BS, kv_cache_memory=16 << 20,
                                        num_threads=1)

    ports = [free_port(), free_port()]
    clients = [TestClient(build_app(ServerSettings(
        served_model_name=MODEL, grpc_port=port, auth_key=key, log_stats_interval_s=None),
        load)) for port in ports]
    for c in clients:
        c.__enter__()
    try:
        for c in clients:
            deadline = time.monotonic() + 120
            while c.get("/ready").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        yield (*clients, f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}")
    finally:
        for c in clients:
            c.__exit__(None, None, None)


def body(prompt: list[int]) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True}).encode()


def metric(client: TestClient, name: str, labels: str = "") -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name) and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_signed_peer_is_pulled_from_and_an_unsigned_one_refused(apps):
    holder, receiver, peer, receiver_grpc = apps
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(20 * BS + 3)]
    warm = holder.post("/v1/completions", content=body(prompt[: 20 * BS] + [11]),
                       headers={"Content-Type": "application/json"})
    assert warm.status_code == 200, warm.text
    raw = body(prompt)
    target = forward_target(None, peer)
    forged = {
        "missing": {PEER_HEADER: peer},
        "bad": {PEER_HEADER: peer, SIGNATURE_HEADER: sign(WORKER_KEY, raw, None)},
    }
    for cause, headers in forged.items():  # no signature, or one not binding the peer
        r = receiver.post("/v1/completions", content=raw,
                          headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["type"] == "permission_error" and err["param"] == SIGNATURE_HEADER
        assert cause in err["message"]
    assert metric(receiver, "tandem_kv_peer_pulls_total") == 0  # nothing was attempted

    prompt_before = metric(holder, "vllm:prompt_tokens_total")
    r = receiver.post("/v1/completions", content=raw, headers={
        "Content-Type": "application/json", PEER_HEADER: peer,
        SIGNATURE_HEADER: sign(WORKER_KEY, raw, target)})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 * BS
    assert metric(receiver, "tandem_kv_peer_pulls_total", 'result="pulled"') == 1
    assert metric(receiver, "tandem_kv_peer_pulled_blocks_total") == 20
    assert metric(holder, "vllm:prompt_tokens_total") == prompt_before  # computed nothing
    # the holder's own answer (test_peer_pull.py compares pulls with cold engines)
    want = holder.post("/v1/completions", json=json.loads(raw)).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]

    ready = receiver.get("/ready").json()
    assert ready["peer_pull_s_per_block"] > 0 and ready["kv_block_bytes"] == BLOCK_BYTES
    assert holder.get("/ready").json()["peer_pull_s_per_block"] == 0  # never pulled
    with grpc.insecure_channel(receiver_grpc) as ch:
        load = worker_pb2_grpc.WorkerStub(signing_channel(ch)).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=10)
    assert load.peer_pull_s_per_block == pytest.approx(ready["peer_pull_s_per_block"])
    assert load.kv_block_bytes == BLOCK_BYTES
    deadline = time.monotonic() + 5  # the holder's lease is acknowledged
    while metric(holder, "tandem_kv_leases_active") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
