"""The worker's gRPC service: KV-event snapshot + live stream, and load, on a real port."""

from __future__ import annotations

import queue
import threading

import grpc
import httpx
import pytest

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.block_hash import HashKeys, hash_block_chain

from .conftest import free_port, start_worker

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def grpc_worker(tmp_path_factory):
    port = free_port()
    w = start_worker(tmp_path_factory.mktemp("grpc"), "--grpc-port", str(port))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield w, worker_pb2_grpc.WorkerStub(channel)
    channel.close()
    assert w.stop() == 0, w.log()


def _subscribe(stub) -> tuple[queue.Queue, grpc.Future]:
    """Collect the stream's messages in a queue from a background thread."""
    messages: queue.Queue = queue.Queue()
    call = stub.SubscribeKVEvents(worker_pb2.SubscribeKVEventsRequest())

    def pump() -> None:
        try:
            for msg in call:
                messages.put(msg)
        except grpc.RpcError:
            pass

    threading.Thread(target=pump, daemon=True).start()
    return messages, call


def _stored_hashes(messages: queue.Queue, want: int, timeout: float = 30) -> tuple[
        list[bytes], list[int]]:
    hashes, seqs = [], []
    while len(hashes) < want:
        msg = messages.get(timeout=timeout)
        for ev in msg.events:
            seqs.append(ev.seq)
            if ev.WhichOneof("event") == "stored":
                hashes.extend(ev.stored.block_hashes)
    return hashes, seqs


def test_load_reports_the_kv_geometry(grpc_worker):
    _, stub = grpc_worker
    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert load.model == MODEL and load.role == "both" and load.block_size == 16
    assert load.num_total_blocks > 0 and load.num_free_blocks == load.num_total_blocks
    assert load.num_running == 0 and load.in_flight_tokens == 0


def test_snapshot_then_live_events_match_the_shared_hash_chain(grpc_worker):
    w, stub = grpc_worker
    messages, call = _subscribe(stub)
    first = messages.get(timeout=30)
    assert first.HasField("snapshot") and first.block_size == 16 and first.model == MODEL
    start_seq = first.snapshot.seq

    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16
    r = httpx.post(w.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200
    expected = hash_block_chain(prompt, 16, HashKeys(MODEL, "", ""))
    got, seqs = _stored_hashes(messages, 2)
    assert got[:2] == expected  # the router can compute exactly what the worker holds
    assert seqs == list(range(start_seq + 1, start_seq + 1 + len(seqs)))
    call.cancel()

    # a router that (re)connects converges through the snapshot
    messages2, call2 = _subscribe(stub)
    snap = messages2.get(timeout=30)
    assert set(expected) <= set(snap.snapshot.block_hashes)
    assert snap.snapshot.seq >= seqs[-1]
    call2.cancel()

    salted = httpx.post(w.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    assert salted.status_code == 200
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
