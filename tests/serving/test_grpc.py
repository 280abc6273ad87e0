"""The worker's gRPC service: KV-event snapshot + live stream, and load, on a real port;
only signed calls are served by a worker with a key, the stream carries hashes but never
the prompt's token ids, and the number of streams is bounded."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import httpx
import pytest

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.block_hash import HashKeys, hash_block_chain
from tandem.protocol.signing import GET_LOAD_RPC, SIGNATURE_HEADER, SUBSCRIBE_RPC, rpc_body, sign

from .helpers import WORKER_KEY, free_port, signing_channel, start_worker

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
MAX_SUBSCRIBERS = 3


@pytest.fixture(scope="module")
def grpc_worker(tmp_path_factory):
    port = free_port()
    w = start_worker(tmp_path_factory.mktemp("grpc"), "--grpc-port", str(port),
                     "--max-kv-event-subscribers", str(MAX_SUBSCRIBERS))
    raw = grpc.insecure_channel(f"127.0.0.1:{port}")
    w.raw_channel = raw  # unsigned calls, raw bytes
    yield w, worker_pb2_grpc.WorkerStub(signing_channel(raw))  # as the router calls
    raw.close()
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


def _rejected(w, reason: str) -> float:
    text = httpx.get(w.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("tandem_worker_auth_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_unsigned_forged_and_replayed_calls_are_refused(grpc_worker):
    """A worker with a key serves GetLoad and SubscribeKVEvents only to callers holding it,
    each signature once: PERMISSION_DENIED otherwise, counted by reason."""
    w, _ = grpc_worker
    raw = worker_pb2_grpc.WorkerStub(w.raw_channel)
    load_req, sub_req = worker_pb2.GetLoadRequest(), worker_pb2.SubscribeKVEventsRequest()
    good = sign(WORKER_KEY, rpc_body(load_req), GET_LOAD_RPC)
    forged = {
        "missing": None,
        "malformed": "t=1,v1=" + "0" * 64,  # the old format, without a nonce
        "bad": sign(b"x" * 32, rpc_body(load_req), GET_LOAD_RPC),  # wrong key
        "bad ": sign(WORKER_KEY, rpc_body(load_req), SUBSCRIBE_RPC),  # another method
        "stale": sign(WORKER_KEY, rpc_body(load_req), GET_LOAD_RPC, now=time.time() - 600),
    }
    before = {r.strip(): _rejected(w, r.strip()) for r in (*forged, "replayed")}
    assert raw.GetLoad(load_req, metadata=((SIGNATURE_HEADER, good),), timeout=10).model == MODEL
    for name, signature in {**forged, "replayed": good}.items():
        metadata = None if signature is None else ((SIGNATURE_HEADER, signature),)
        with pytest.raises(grpc.RpcError) as info:
            raw.GetLoad(load_req, metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert name.strip() in info.value.details() or name == "missing", info.value.details()
        assert "GetLoad calls must come from the router holding the key" in \
            info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # the stream: refused before any message
        next(iter(raw.SubscribeKVEvents(sub_req, timeout=10)))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    after = {r: _rejected(w, r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "missing": 2, "malformed": 1, "bad": 2, "stale": 1, "replayed": 1}


def _packed(ids: list[int]) -> bytes:
    """`ids` as a packed repeated uint32 field's payload (what token_ids carried)."""
    out = bytearray()
    for v in ids:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def test_the_event_stream_carries_no_token_ids(grpc_worker):
    """The stream a subscriber reads, as raw bytes off the socket: the stored blocks'
    hashes are there, the prompt's token ids are not (nor is the field in the schema)."""
    w, _ = grpc_worker
    assert "token_ids" not in worker_pb2.BlockStored.DESCRIPTOR.fields_by_name
    req = worker_pb2.SubscribeKVEventsRequest()
    call = signing_channel(w.raw_channel).unary_stream(
        "/tandem.v1.Worker/SubscribeKVEvents",
        request_serializer=worker_pb2.SubscribeKVEventsRequest.SerializeToString,
        response_deserializer=None)(req)  # raw bytes
    frames: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [frames.put(m) for m in _quiet(call)], daemon=True).start()
    frames.get(timeout=30)  # the snapshot
    prompt = list(range(20_000, 20_048))  # 3 full blocks of 16, 3-byte varints each
    r = httpx.post(w.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    want = hash_block_chain(prompt, 16, HashKeys(MODEL, "", ""))
    wire = b""
    deadline = time.monotonic() + 30
    while not all(h in wire for h in want):
        assert time.monotonic() < deadline, "the stored blocks' events never came"
        wire += frames.get(timeout=30)
    call.cancel()
    for b in range(3):  # no block's token ids, in any encoding a proto field would use
        block = prompt[b * 16:(b + 1) * 16]
        assert _packed(block) not in wire
        assert _packed(block[:4]) not in wire


def _quiet(call):  # noqa: ANN001, ANN202
    try:
        yield from call
    except grpc.RpcError:
        return


def test_kv_event_subscribers_are_bounded_and_freed(grpc_worker):
    """At most --max-kv-event-subscribers streams: one more is RESOURCE_EXHAUSTED, and a
    cancelled stream frees its slot."""
    _, stub = grpc_worker

    def open_stream():  # noqa: ANN202 - (call, first message or the error)
        call = stub.SubscribeKVEvents(worker_pb2.SubscribeKVEventsRequest(), timeout=60)
        try:
            return call, next(iter(call))
        except grpc.RpcError as exc:
            return call, exc

    deadline = time.monotonic() + 10  # streams other tests cancelled may still be closing
    while True:
        streams = [open_stream() for _ in range(MAX_SUBSCRIBERS)]
        if all(isinstance(m, worker_pb2.KVEventBatch) for _, m in streams):
            break
        for call, _ in streams:
            call.cancel()
        assert time.monotonic() < deadline, [m for _, m in streams]
        time.sleep(0.2)
    extra, got = open_stream()
    assert isinstance(got, grpc.RpcError), got
    assert got.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{MAX_SUBSCRIBERS} subscribers" in got.details()
    streams[0][0].cancel()
    deadline = time.monotonic() + 10
    while isinstance(got := open_stream()[1], grpc.RpcError):  # its slot comes back
        assert got.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() < deadline, "a cancelled stream kept its slot"
        time.sleep(0.1)
    assert got.HasField("snapshot")
    for call, _ in streams:
        call.cancel()


def test_kv_block_bytes_is_zero_for_an_engine_whose_pages_do_not_travel():
    """`kv_block_bytes` (read once when the engine loads): a layout's bytes per block of every
    layer; 0 where the engine has no page connector (a hybrid model's KV groups)."""
    from types import SimpleNamespace

    from tandem.engine.errors import ConfigError
    from tandem.serving.grpc_server import kv_block_bytes

    class Hybrid:
        @property
        def kv_connector(self):
            raise ConfigError("a KV connector cannot load into a hybrid model's KV groups")

    layout = SimpleNamespace(num_layers=3, block_layer_bytes=4096)
    plain = SimpleNamespace(kv_connector=SimpleNamespace(layout=lambda model: layout))
    assert kv_block_bytes(plain, "m") == 3 * 4096  # type: ignore[arg-type]
    assert kv_block_bytes(Hybrid(), "m") == 0  # type: ignore[arg-type]
