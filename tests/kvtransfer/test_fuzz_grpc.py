"""Fuzzing every gRPC method a worker serves (`tandem.v1.Worker`: SubscribeKVEvents, GetLoad;
`tandem.v1.KVTransfer`: Prefill, ReleasePages) on a real worker (a tiny random model, the
router's key): hypothesis-generated messages (every field from the .proto descriptor, in or out
of range) and mutated wire bytes, each call unsigned, signed, or with a forged or mangled
signature. Every call ends within its deadline with a proper status (never UNKNOWN, grpc's
answer to a handler that raised); an unsigned or forged call is PERMISSION_DENIED; bytes that
do not parse are INVALID_ARGUMENT; and afterwards the worker holds nothing and serves."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey, rpc_body, sign
from tandem.serving.api_server import ServerSettings
from tests.engine.utils import make_tiny_model_dir
from tests.serving.helpers import (
    WORKER_KEY,
    free_port,
    signing_channel,
    wait_idle,
    worker_key_file,
)
from tests.serving.tiny_worker import TINY_BLOCK, tiny_worker

MODEL = "fuzz-grpc"
EXAMPLES = 60  # per method
DEADLINE_S = 10.0
# method -> (request type, response type, server streaming)
METHODS = {
    "/tandem.v1.Worker/SubscribeKVEvents": (worker_pb2.SubscribeKVEventsRequest,
                                            worker_pb2.KVEventBatch, True),
    "/tandem.v1.Worker/GetLoad": (worker_pb2.GetLoadRequest, worker_pb2.Load, False),
    "/tandem.v1.KVTransfer/Prefill": (worker_pb2.PrefillRequest, worker_pb2.PageChunk, True),
    "/tandem.v1.KVTransfer/ReleasePages": (worker_pb2.ReleasePagesRequest,
                                           worker_pb2.ReleasePagesResponse, False),
}
S = grpc.StatusCode
# what a fuzzed call may end with (besides OK): refusals the services state
REFUSALS = {S.INVALID_ARGUMENT, S.PERMISSION_DENIED, S.FAILED_PRECONDITION, S.NOT_FOUND,
            S.RESOURCE_EXHAUSTED, S.DEADLINE_EXCEEDED, S.OUT_OF_RANGE}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(HTTP URL, gRPC channel) of a tiny-model worker with the tests' key, role both."""
    path = tmp_path_factory.mktemp("fuzz-grpc")
    make_tiny_model_dir(path, max_position_embeddings=128)
    port = free_port()
    server, _ = tiny_worker(path, ServerSettings(
        served_model_name=MODEL, grpc_port=port, auth_key=WorkerKey(worker_key_file(path))))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    yield server.url, channel
    channel.close()
    server.stop()


# -- strategies ---------------------------------------------------------------------------------

SCALARS = {
    FD.TYPE_STRING: st.text(max_size=12) | st.sampled_from([MODEL, "grpc", "torch", ""]),
    FD.TYPE_BYTES: st.binary(max_size=40),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_UINT32: st.integers(0, 40) | st.integers(0, 2**32 - 1),
    FD.TYPE_UINT64: st.integers(0, 40) | st.integers(0, 2**64 - 1),
    FD.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FD.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FD.TYPE_FLOAT: st.floats(width=32),
    FD.TYPE_DOUBLE: st.floats(),
}


def field_values(f: FD, depth: int) -> st.SearchStrategy:
    if f.type == FD.TYPE_MESSAGE:
        one = messages(f.message_type._concrete_class, depth + 1)
    elif f.type == FD.TYPE_ENUM:
        one = st.sampled_from([v.number for v in f.enum_type.values])
    else:
        one = SCALARS[f.type]
    if f.is_repeated:
        if f.type == FD.TYPE_UINT32 and f.name == "token_ids":  # a prompt, mostly in vocab
            return st.lists(st.integers(0, 49151), max_size=60) | st.lists(one, max_size=8)
        return st.lists(one, max_size=4)
    return one


def messages(cls, depth: int = 0) -> st.SearchStrategy:
    """`cls` with a random subset of its fields set to random values (from its descriptor)."""
    fields = [f for f in cls.DESCRIPTOR.fields if depth < 2 or f.type != FD.TYPE_MESSAGE]

    @st.composite
    def build(draw):
        msg = cls()
        for f in draw(st.lists(st.sampled_from(fields), unique=True)) if fields else []:
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                continue
            value = draw(field_values(f, depth))
            if f.is_repeated:
                if f.type == FD.TYPE_MESSAGE:
                    getattr(msg, f.name).extend(value)
                else:
                    getattr(msg, f.name)[:] = value
            elif f.type == FD.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(value)
            else:
                setattr(msg, f.name, value)
        return msg
    return build()


@st.composite
def wire(draw, cls) -> bytes:
    """The encoding of a random `cls`, perhaps mutated: truncated, bytes flipped or spliced,
    or random bytes outright."""
    raw = draw(messages(cls)).SerializeToString()
    how = draw(st.sampled_from(["as is", "truncate", "flip", "splice", "random"]))
    if how == "truncate" and raw:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif how == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    elif how == "splice":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.binary(min_size=1, max_size=12)) + raw[i:]
    elif how == "random":
        raw = draw(st.binary(max_size=64))
    return raw


SIGNING = st.sampled_from(["none", "valid", "other key", "garbage", "other body"])


def metadata(how: str, cls, raw: bytes, target: str) -> list[tuple[str, str]]:
    """The call's metadata: no signature, a valid one over what the server will re-encode,
    one made with another key or over another body, or a mangled header."""
    try:
        body = rpc_body(cls.FromString(raw))
    except DecodeError:
        body = raw
    if how == "none":
        return []
    if how == "garbage":
        return [(SIGNATURE_HEADER, "v1,0,zz,not-a-signature")]
    key = b"another-key-of-at-least-16-bytes" if how == "other key" else WORKER_KEY
    signed = body + b"\x08\x01" if how == "other body" else body
    return [(SIGNATURE_HEADER, sign(key, signed, f"grpc:{target}"))]


def parses(cls, raw: bytes) -> bool:
    try:
        cls.FromString(raw)
    except DecodeError:
        return False
    return True


def call(channel: grpc.Channel, method: str, raw: bytes,
         md: list[tuple[str, str]]) -> tuple[grpc.StatusCode, list]:
    """(status, answers) of one call of `method` with the request bytes `raw`: a streaming
    answer is read until it ends, or a KV event subscription (which stays open) for 0.3 s and
    then cancelled."""
    cls, resp, streaming = METHODS[method]
    ident = lambda b: b  # noqa: E731 - send the bytes exactly
    if not streaming:
        rpc = channel.unary_unary(method, request_serializer=ident,
                                  response_deserializer=resp.FromString)
        try:
            return S.OK, [rpc(raw, metadata=md, timeout=DEADLINE_S)]
        except grpc.RpcError as exc:
            return exc.code(), []
    rpc = channel.unary_stream(method, request_serializer=ident,
                               response_deserializer=resp.FromString)
    it = rpc(raw, metadata=md, timeout=DEADLINE_S)
    out: list = []
    start = time.monotonic()
    try:
        for msg in it:
            out.append(msg)
            if method.endswith("SubscribeKVEvents") and time.monotonic() - start > 0.3:
                it.cancel()
                return S.OK, out
        return S.OK, out
    except grpc.RpcError as exc:
        if exc.code() == S.CANCELLED and method.endswith("SubscribeKVEvents"):
            return S.OK, out
        return exc.code(), out


def release(channel: grpc.Channel, chunks: list) -> None:
    """Acknowledge a Prefill answer's pages (signed), as its decode worker would."""
    if chunks and chunks[0].WhichOneof("kind") == "header":
        req = worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id)
        target = "/tandem.v1.KVTransfer/ReleasePages"
        status, _ = call(channel, target, req.SerializeToString(),
                         metadata("valid", worker_pb2.ReleasePagesRequest,
                                  req.SerializeToString(), target))
        assert status == S.OK


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_answers_fuzzed_calls_with_a_status(worker, method):
    url, channel = worker
    cls = METHODS[method][0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(raw=wire(cls), how=SIGNING)
    def one(raw: bytes, how: str) -> None:
        if cls is worker_pb2.PrefillRequest and parses(cls, raw):
            # a real torch pair group dials the address it names: another test's business
            assume(cls.FromString(raw).backend != "torch")
        md = metadata(how, cls, raw, method)
        t0 = time.monotonic()
        status, answers = call(channel, method, raw, md)
        assert time.monotonic() - t0 < DEADLINE_S + 5
        if not parses(cls, raw):
            # refused before any handler runs (grpc.aio alone: UNKNOWN and a traceback)
            assert status == S.INVALID_ARGUMENT, (status, raw)
        elif how != "valid":
            assert status == S.PERMISSION_DENIED, (status, how, raw)
        else:
            assert status == S.OK or status in REFUSALS, (status, raw)
        if method.endswith("Prefill") and status == S.OK:
            release(channel, answers)

    one()
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_the_fuzzed_worker_holds_nothing_and_still_serves(worker):
    url, channel = worker
    wait_idle(url, 30)  # no request running, no KV block in use (every lease released)
    load_md = metadata("valid", worker_pb2.GetLoadRequest, b"", "/tandem.v1.Worker/GetLoad")
    status, (load,) = call(channel, "/tandem.v1.Worker/GetLoad", b"", load_md)
    assert status == S.OK and load.num_running == 0 and load.model == MODEL
    r = httpx.post(url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "still serving", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_prefill_stream_is_counted_while_it_is_served(worker):
    # tandem_kvtransfer_streams_active{direction="send"} (the chaos suite's leak check): some
    # reading during back-to-back Prefill calls sees one, and it reads 0 once they end
    url, channel = worker
    stub = worker_pb2_grpc.KVTransferStub(signing_channel(channel))
    name = f'tandem_kvtransfer_streams_active{{direction="send",model_name="{MODEL}"}}'
    done = threading.Event()

    def prefill_forever() -> None:
        i = 0
        while not done.is_set():
            i += 1
            req = worker_pb2.PrefillRequest(
                request_id=f"count-{i}", model_id=MODEL, token_ids=list(range(100, 220)),
                block_size=TINY_BLOCK, num_blocks=29, backend="grpc", lease_s=5)
            chunks = list(stub.Prefill(req, timeout=30))
            stub.ReleasePages(worker_pb2.ReleasePagesRequest(
                lease_id=chunks[0].header.lease_id), timeout=10)

    thread = threading.Thread(target=prefill_forever)
    thread.start()
    seen = set()
    try:
        deadline = time.monotonic() + 30
        while 1.0 not in seen and time.monotonic() < deadline:
            seen.add(metric_sample(url, name))
    finally:
        done.set()
        thread.join(timeout=60)
    assert 1.0 in seen
    assert metric_sample(url, name) == 0.0


def metric_sample(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")
