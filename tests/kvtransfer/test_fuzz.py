"""Fuzzing the KV-transfer boundary.

Receiver side, in-process: whatever bytes arrive (decoded as grpc does with the decode side's
`decode_chunk`, which must read what protobuf reads), `check_header`, `GrpcBackend.receive`
and the decode side's header reader either accept pages that are exactly what was asked for,
placed where the messages say and matching each layer's digest and the trailer's checksum,
or raise `KVTransferError`; nothing else. Whatever happens, only layers whose digest checked
ever reach the sink, in layer order. Sender side, against a real prefill worker: random
`PrefillRequest`s end with OK or INVALID_ARGUMENT (DEADLINE_EXCEEDED for a lease shorter
than the prefill), and the worker stays healthy and holds nothing afterwards."""

from __future__ import annotations

import asyncio
import itertools
import math

import grpc
import httpx
import pytest
import torch
import xxhash
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from tandem.engine.kv_cache.pages import gather_layer
from tandem.kvtransfer.client import RemotePrefill
from tandem.kvtransfer.grpc_backend import (
    GrpcBackend,
    RawPageData,
    decode_chunk,
    encode_data,
    encode_pages,
)
from tandem.kvtransfer.pages import (
    KVTransferError,
    PageChecksum,
    PageLayout,
    check_header,
    header_for,
    layer_page_views,
    transfer_digest,
)
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.bundled import BUNDLED_NAME
from tests.serving.helpers import free_port, signing_channel, start_worker, wait_idle

LAYOUT = PageLayout("fuzz-model", num_layers=2, num_kv_heads=1, block_size=2, head_dim=2,
                    dtype=torch.float32)
BLOCK = LAYOUT.block_layer_bytes  # 32 bytes of K + V per block and layer
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
OFFSETS = st.sampled_from([0, 16, 32, 64, 96]) | st.integers(0, 130) | U64
HASHES = st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=4, unique=True)
PageChunk, PageData, PageTrailer = worker_pb2.PageChunk, worker_pb2.PageData, worker_pb2.PageTrailer
PageLayerEnd = worker_pb2.PageLayerEnd


# -- strategies ---------------------------------------------------------------------------------

def random_headers() -> st.SearchStrategy:
    return st.builds(
        worker_pb2.PageHeader,
        model_id=st.sampled_from(["fuzz-model", "", "other"]) | st.text(max_size=8),
        num_layers=st.integers(0, 3) | U32,
        num_kv_heads=st.integers(0, 2) | U32,
        block_size=st.integers(0, 3) | U32,
        head_dim=st.integers(0, 3) | U32,
        dtype=st.sampled_from(["float32", "float16", "", "torch.float32"]) | st.text(max_size=8),
        first_block=st.integers(0, 3) | U32,
        block_hashes=st.lists(st.binary(max_size=40), max_size=5),
        layer_bytes=st.integers(0, 200) | U64,
        lease_id=st.text(max_size=8), first_token=U32, tail_tokens=st.integers(0, 2) | U32)


def random_chunks() -> st.SearchStrategy:
    data = st.builds(PageData, layer=st.integers(0, 3) | U32,
                     offset=OFFSETS, data=st.binary(max_size=100))
    return st.one_of(
        st.builds(lambda h: PageChunk(header=h), random_headers()),
        st.builds(lambda d: PageChunk(data=d), data),
        st.builds(lambda c: PageChunk(trailer=PageTrailer(xxh3_64=c)), U64),
        st.builds(lambda layer, c: PageChunk(layer_end=PageLayerEnd(layer=layer, xxh3_64=c)),
                  st.integers(0, 3) | U32, U64),
        st.just(PageChunk()))  # no kind at all


@st.composite
def valid_pages(draw, num_blocks: int) -> tuple[list[bytes], list[worker_pb2.PageChunk]]:
    """Every layer's bytes and a correct stream of them, cut into random chunks."""
    size = num_blocks * BLOCK
    layers, chunks = [], []
    for layer in range(LAYOUT.num_layers):
        data = draw(st.binary(min_size=size, max_size=size))
        cuts = sorted(set(draw(st.lists(st.integers(1, size - 1), max_size=4))))
        bounds = [0, *cuts, size]
        chunks += [PageChunk(data=PageData(layer=layer, offset=a, data=data[a:b]))
                   for a, b in itertools.pairwise(bounds)]
        chunks.append(_end(layer, data))
        layers.append(data)
    return layers, [*chunks, _trailer(*layers)]


def copy(c: worker_pb2.PageChunk | bytes) -> worker_pb2.PageChunk | bytes:
    return c if isinstance(c, bytes) else PageChunk.FromString(c.SerializeToString())


def wire_bytes(c: worker_pb2.PageChunk | bytes) -> bytes:
    return c if isinstance(c, bytes) else c.SerializeToString()


@st.composite
def edited_bytes(draw, raw: bytes) -> bytes:
    """`raw` with a bit flipped, cut short or grown: a message that may no longer parse."""
    how = draw(st.sampled_from(["flip", "cut", "grow"]))
    if how == "flip" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        return raw[:at] + bytes([raw[at] ^ (1 << draw(st.integers(0, 7)))]) + raw[at + 1:]
    if how == "cut":
        return raw[: draw(st.integers(0, len(raw)))]
    return raw + draw(st.binary(min_size=1, max_size=8))


@st.composite
def damaged(draw, chunks: list[worker_pb2.PageChunk]) -> list[worker_pb2.PageChunk | bytes]:
    """`chunks` after up to 4 random edits: drop, duplicate, swap, truncate or grow a chunk's
    data, flip a byte, change an offset, a layer or the checksum, insert a random message,
    damage a message's wire bytes, hand-encode a data message as the sender does, cut the
    stream. Items are messages or the raw bytes to send instead."""
    out = [copy(c) for c in chunks]
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["drop", "dup", "swap", "truncate", "grow", "flip", "offset",
                                   "layer", "checksum", "digest", "insert", "bytes", "encode",
                                   "cut"]))
        if not out and op != "insert":
            continue
        i = draw(st.integers(0, max(len(out) - 1, 0)))
        c = out[i] if out else None
        kind = c.WhichOneof("kind") if isinstance(c, PageChunk) else None
        if op == "drop":
            del out[i]
        elif op == "dup":
            out.insert(i, copy(c))
        elif op == "swap":
            j = draw(st.integers(0, len(out) - 1))
            out[i], out[j] = out[j], out[i]
        elif op == "truncate" and kind == "data":
            c.data.data = c.data.data[: draw(st.integers(0, len(c.data.data)))]
        elif op == "grow" and kind == "data":
            c.data.data += draw(st.binary(min_size=1, max_size=64))
        elif op == "flip" and kind == "data" and c.data.data:
            at = draw(st.integers(0, len(c.data.data) - 1))
            d = c.data.data
            c.data.data = d[:at] + bytes([d[at] ^ (1 << draw(st.integers(0, 7)))]) + d[at + 1:]
        elif op == "offset" and kind == "data":
            c.data.offset = draw(OFFSETS)
        elif op == "layer" and kind in ("data", "layer_end"):
            getattr(c, kind).layer = draw(st.integers(0, 3) | U32)
        elif op == "checksum" and kind == "trailer":
            c.trailer.xxh3_64 = draw(U64)
        elif op == "digest" and kind == "layer_end":
            c.layer_end.xxh3_64 = draw(U64)
        elif op == "insert":
            out.insert(i, draw(random_chunks() | st.binary(max_size=40)))
        elif op == "bytes":
            out[i] = draw(edited_bytes(wire_bytes(c)))
        elif op == "encode" and kind == "data":
            out[i] = encode_data(c.data.layer, c.data.offset, c.data.data)
        elif op == "cut":
            out = out[:i]
    if draw(st.booleans()):  # a sender whose digests match what it sent, however wrong
        h, digests = xxhash.xxh3_64(), []
        for c in out:
            kind = c.WhichOneof("kind") if isinstance(c, PageChunk) else None
            if kind == "data":
                h.update(c.data.data)
            elif kind == "layer_end":
                c.layer_end.xxh3_64 = h.intdigest()
                digests.append(h.intdigest())
                h = xxhash.xxh3_64()
            elif kind == "trailer":
                c.trailer.xxh3_64 = transfer_digest(digests)
                break
    return out


def grpc_deserialize(raw: bytes):
    """What a grpc.aio stream yields for `raw` with the decode side's deserializer: the
    decoded message, or None when the deserializer raised (grpc logs it and goes on)."""
    try:
        return decode_chunk(raw)
    except Exception:  # noqa: BLE001 - exactly what grpc does
        return None


def on_the_wire(items) -> list:
    """The stream a receiver reads when a sender sends `items` (messages or raw bytes)."""
    return [grpc_deserialize(wire_bytes(c)) for c in items]


async def _aiter(chunks):
    for c in chunks:
        yield c


def collector(got: list[tuple[int, bytes]], num_blocks: int, layout: PageLayout = LAYOUT):
    """A sink that checks each layer's tensor and keeps a copy of its bytes (the backend
    reuses its buffers), after yielding to the loop as a real write would."""
    async def sink(layer: int, pages: torch.Tensor) -> None:
        assert pages.dtype == layout.dtype
        assert tuple(pages.shape) == layout.layer_shape(num_blocks)
        await asyncio.sleep(0)
        got.append((layer, pages.contiguous().numpy().tobytes()))
    return sink


class Refused(Exception):
    """A refusal (`error`) and what reached the sink before it (`got`)."""

    def __init__(self, error: KVTransferError, got: list[tuple[int, bytes]]) -> None:
        super().__init__(str(error))
        self.error, self.got = error, got


def receive(num_blocks: int, items) -> list[tuple[int, bytes]]:
    """What the sink got, in order; raises `Refused`."""
    request = worker_pb2.PrefillRequest(backend="grpc")
    got: list[tuple[int, bytes]] = []
    try:
        asyncio.run(GrpcBackend().receive(request, LAYOUT, num_blocks,
                                          _aiter(on_the_wire(items)),
                                          collector(got, num_blocks)))
    except KVTransferError as exc:
        raise Refused(exc, got) from exc
    return got


def check_sunk(got: list[tuple[int, bytes]], items) -> None:
    """Whatever happened, the sink got layers 0, 1, ... in order, each with the digest a
    layer end of that layer carried."""
    assert [layer for layer, _ in got] == list(range(len(got)))
    ends = {(m.layer_end.layer, m.layer_end.xxh3_64) for m in on_the_wire(items)
            if isinstance(m, PageChunk) and m.WhichOneof("kind") == "layer_end"}
    for layer, raw in got:
        assert (layer, xxhash.xxh3_64_intdigest(raw)) in ends


def check_accepted(got: list[tuple[int, bytes]], num_blocks: int, items) -> bytes:
    """What a receiver may accept: every layer at the asked-for size, in order, made of the
    data messages before the first trailer, each at the place it names, covering every byte
    once, each layer closed by an end with its digest, and matching the trailer's checksum."""
    check_sunk(got, items)
    assert len(got) == LAYOUT.num_layers
    size = num_blocks * BLOCK
    placed = [bytearray(size) for _ in range(LAYOUT.num_layers)]
    covered = [0] * LAYOUT.num_layers
    ends: list[int] = []
    for m in on_the_wire(items):
        kind = "data" if isinstance(m, RawPageData) else (
            m.WhichOneof("kind") if isinstance(m, PageChunk) else None)
        if kind == "trailer":
            assert m.trailer.xxh3_64 == transfer_digest(ends)
            break
        if kind == "layer_end":
            assert m.layer_end.layer == len(ends) and covered[len(ends)] == size
            ends.append(m.layer_end.xxh3_64)
            continue
        assert kind == "data"
        d = m if isinstance(m, RawPageData) else m.data
        assert d.layer == len(ends) and d.offset + len(d.data) <= size
        placed[d.layer][d.offset:d.offset + len(d.data)] = d.data
        covered[d.layer] += len(d.data)
    else:
        raise AssertionError("accepted without a trailer")
    assert covered == [size] * LAYOUT.num_layers
    assert [bytes(p) for p in placed] == [raw for _, raw in got]
    return b"".join(raw for _, raw in got)


# -- receiver side -------------------------------------------------------------------------------

@st.composite
def wire_messages(draw) -> bytes:
    """Bytes a peer may send: a real message (protobuf- or hand-encoded), maybe damaged, or
    arbitrary bytes."""
    c = draw(random_chunks())
    raw = c.SerializeToString()
    if c.WhichOneof("kind") == "data" and draw(st.booleans()):
        raw = encode_data(c.data.layer, c.data.offset, c.data.data)
    pick = draw(st.integers(0, 2))
    return raw if pick == 0 else draw(edited_bytes(raw)) if pick == 1 else draw(
        st.binary(max_size=40))


@settings(max_examples=500, deadline=None)
@given(raw=wire_messages())
def test_decode_chunk_agrees_with_protobuf(raw):
    """The decode side's hand-written parser reads what protobuf reads (only stricter about
    out-of-range integers, which the receiver refuses anyway) and fails where it fails."""
    try:
        want = PageChunk.FromString(raw)
    except DecodeError:
        want = None
    try:
        got = decode_chunk(raw)
    except DecodeError:
        got = None
    if want is None:
        assert got is None
    elif isinstance(got, RawPageData):
        assert want.WhichOneof("kind") == "data"
        assert (got.layer % 2**32, got.offset % 2**64) == (want.data.layer, want.data.offset)
        assert bytes(got.data) == want.data.data
    else:
        assert got == want


@settings(max_examples=200, deadline=None)
@given(layer=U32, offset=U64, payload=st.binary(max_size=300))
def test_encode_data_is_the_protobuf_encoding(layer, offset, payload):
    raw = encode_data(layer, offset, payload)
    want = PageChunk(data=PageData(layer=layer, offset=offset, data=payload))
    assert PageChunk.FromString(raw) == want
    got = decode_chunk(raw)
    assert isinstance(got, RawPageData)
    assert (got.layer, got.offset, bytes(got.data)) == (layer, offset, payload)


@settings(max_examples=100, deadline=None)
@given(num_cache_blocks=st.integers(1, 9), data=st.data())
def test_pages_sent_from_cache_views_equal_the_gathered_layer(num_cache_blocks, data):
    """Both send paths carry exactly `gather_layer`'s bytes and its checksum: messages built
    from per-block views of a host cache (whole pages per message), and from slices of the
    gathered layer."""
    shape = (num_cache_blocks, 3, 4, 2)  # [blocks, kv_heads, block_size, head_dim]
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]
    ids = data.draw(st.lists(st.integers(0, num_cache_blocks - 1), min_size=1, max_size=12))
    chunk = data.draw(st.integers(1, 400))  # bytes; a 96-byte page exceeds the small ones
    for layer in range(2):
        want = gather_layer(caches, layer, ids).contiguous().view(torch.uint8).numpy().tobytes()
        checksum = PageChecksum()
        messages = encode_pages(layer, layer_page_views(caches, layer, ids), chunk, checksum)
        offset, got = 0, b""
        for raw in messages:
            m = PageChunk.FromString(raw).data
            assert (m.layer, m.offset) == (layer, offset)
            assert len(m.data) % 96 == 0 and (len(m.data) <= max(chunk, 96))
            offset += len(m.data)
            got += m.data
        assert got == want
        assert checksum.digest() == xxhash.xxh3_64_intdigest(want)
        # the gather path (device caches): the layer cut into `chunk`-byte slices, the last
        # one shorter; one slice per message
        mv = memoryview(want)
        slices = [mv[o:o + chunk] for o in range(0, len(want), chunk)]
        checksum = PageChecksum()
        messages = [PageChunk.FromString(raw).data
                    for raw in encode_pages(layer, slices, chunk, checksum)]
        assert [m.offset for m in messages] == list(range(0, len(want), chunk))
        assert b"".join(m.data for m in messages) == want
        assert checksum.digest() == xxhash.xxh3_64_intdigest(want)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_check_header_accepts_a_prefix_of_the_chain_or_raises(data):
    expected = data.draw(HASHES)
    first = data.draw(st.integers(0, 3))
    asked_tail = data.draw(st.sampled_from([0, 0, 1]))  # LAYOUT's blocks hold 2 tokens
    if data.draw(st.booleans()):  # a real header, maybe with one field changed
        offered = expected[: data.draw(st.integers(0, len(expected)))]
        tail = data.draw(st.sampled_from([0, asked_tail, 1]))
        header = header_for(LAYOUT, first, offered, "lease", 0, tail)
        field = data.draw(st.sampled_from(["", "model_id", "num_layers", "num_kv_heads",
                                           "block_size", "head_dim", "dtype", "first_block",
                                           "block_hashes", "layer_bytes", "tail_tokens"]))
        if field == "block_hashes":
            del header.block_hashes[:]
            header.block_hashes.extend(data.draw(st.lists(st.binary(max_size=40), max_size=6)))
        elif field:
            other = worker_pb2.PageHeader.FromString(
                data.draw(random_headers()).SerializeToString())
            setattr(header, field, getattr(other, field))
    else:
        header = data.draw(random_headers())
    try:
        offer = check_header(header, LAYOUT, first, expected, asked_tail)
    except KVTransferError as exc:
        assert exc.reason == "invalid"
        return
    n = offer.num_full
    assert 0 <= n <= len(expected) and list(header.block_hashes) == expected[:n]
    # a partial block only as asked for, and only after every full block
    assert offer.tail_tokens in (0, asked_tail) and (not offer.tail_tokens or n == len(expected))
    assert offer.num_blocks == n + (1 if offer.tail_tokens else 0)
    assert header.first_block == first and header.layer_bytes == offer.num_blocks * BLOCK
    assert (header.model_id, header.num_layers, header.num_kv_heads, header.block_size,
            header.head_dim, header.dtype) == ("fuzz-model", 2, 1, 2, 2, "float32")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_receive_returns_checked_pages_or_raises(data):
    num_blocks = data.draw(st.integers(1, 3))
    layers, chunks = data.draw(valid_pages(num_blocks))
    stream = data.draw(damaged(chunks))
    asked = num_blocks if data.draw(st.integers(0, 9)) else data.draw(st.integers(0, 4))
    try:
        got = receive(asked, stream)
    except Refused as exc:
        assert exc.error.reason in ("invalid", "incomplete")
        assert stream != chunks or asked != num_blocks  # an intact stream is never refused
        check_sunk(exc.got, stream)
        return
    if not asked:
        assert got == []
        return
    raw = check_accepted(got, asked, stream)
    if stream == chunks and asked == num_blocks:
        assert raw == b"".join(layers)


def _data(layer: int, offset: int, payload: bytes) -> worker_pb2.PageChunk:
    return PageChunk(data=PageData(layer=layer, offset=offset, data=payload))


def _end(layer: int, *payloads: bytes) -> worker_pb2.PageChunk:
    """A layer's end carrying the digest of `payloads` as sent (concatenated)."""
    return PageChunk(layer_end=PageLayerEnd(layer=layer,
                                            xxh3_64=xxhash.xxh3_64_intdigest(b"".join(payloads))))


def _trailer(*layers: bytes) -> worker_pb2.PageChunk:
    """The trailer for layers of these bytes (each layer's bytes as sent, concatenated)."""
    return PageChunk(trailer=PageTrailer(xxh3_64=transfer_digest(
        [xxhash.xxh3_64_intdigest(x) for x in layers])))


A, B, C = b"a" * BLOCK, b"b" * BLOCK, b"c" * BLOCK  # one block of layer 0, of layer 1, extra
GOOD_TAIL = [_data(1, 0, B), _end(1, B)]
EDGE_STREAMS = {  # one block asked for; every digest matches the data sent before it
    "a trailer first": [_trailer()],
    "a trailer after one layer": [_data(0, 0, A), _end(0, A), _trailer(A)],
    "a trailer mid-layer": [_data(0, 0, A[:8]), _trailer(A[:8])],
    "data after the last layer": [_data(0, 0, A), _end(0, A), *GOOD_TAIL, _data(2, 0, C),
                                  _end(2, C), _trailer(A, B, C)],
    "a layer sent twice": [_data(0, 0, A), _end(0, A), _data(0, 0, A), _end(0, A), *GOOD_TAIL,
                           _trailer(A, A, B)],
    "layers swapped": [_data(1, 0, B), _end(1, B), _data(0, 0, A), _end(0, A), _trailer(B, A)],
    "a gap in a layer": [_data(0, 0, A[:8]), _data(0, 16, A[16:]), _end(0, A[:8], A[16:]),
                         *GOOD_TAIL, _trailer(A[:8] + A[16:], B)],
    "overlapping pieces": [_data(0, 0, A[:16]), _data(0, 8, A[8:]), _end(0, A[:16], A[8:]),
                           *GOOD_TAIL, _trailer(A[:16] + A[8:], B)],
    "a piece past the layer's end": [_data(0, 0, A + C[:1]), _end(0, A + C[:1]), *GOOD_TAIL,
                                     _trailer(A + C[:1], B)],
    "an empty piece": [_data(0, 0, b""), _data(0, 0, A), _end(0, A), *GOOD_TAIL,
                       _trailer(A, B)],
    "layer 2**32 (protobuf would read 0)": [encode_data(2**32, 0, A), _end(0, A), *GOOD_TAIL,
                                            _trailer(A, B)],
    "an undecodable message": [_data(0, 0, A), b"\x12\x05\x08", _end(0, A), *GOOD_TAIL,
                               _trailer(A, B)],
    "a message of no kind": [_data(0, 0, A), PageChunk(), _end(0, A), *GOOD_TAIL,
                             _trailer(A, B)],
    "a header among the pages": [_data(0, 0, A), PageChunk(header=worker_pb2.PageHeader()),
                                 _end(0, A), *GOOD_TAIL, _trailer(A, B)],
    "no layer ends": [_data(0, 0, A), _data(1, 0, B), _trailer(A, B)],
    "a layer end mid-layer": [_data(0, 0, A[:8]), _end(0, A[:8]), _data(0, 8, A[8:]),
                              _end(0, A[8:]), *GOOD_TAIL, _trailer(A, B)],
    "a layer end naming another layer": [_data(0, 0, A), _end(1, A), *GOOD_TAIL,
                                         _trailer(A, B)],
    "a layer end twice": [_data(0, 0, A), _end(0, A), _end(0, A), *GOOD_TAIL, _trailer(A, B)],
    "a wrong layer digest": [_data(0, 0, A), _end(0, B), *GOOD_TAIL, _trailer(B, B)],
    "a trailer over other digests": [_data(0, 0, A), _end(0, A), *GOOD_TAIL, _trailer(B, A)],
    "no trailer": [_data(0, 0, A), _end(0, A), *GOOD_TAIL],
    "nothing": [],
}


@pytest.mark.parametrize("name", list(EDGE_STREAMS))
def test_malformed_streams_are_refused(name):
    with pytest.raises(Refused) as info:
        receive(1, EDGE_STREAMS[name])
    assert info.value.error.reason in ("invalid", "incomplete")
    check_sunk(info.value.got, EDGE_STREAMS[name])


def test_a_well_formed_stream_is_accepted():
    for stream in ([_data(0, 0, A), _end(0, A), *GOOD_TAIL, _trailer(A, B)],
                   [_data(0, 0, A[:5]), encode_data(0, 5, A[5:]), _end(0, A), *GOOD_TAIL,
                    _trailer(A, B)]):
        got = receive(1, stream)
        assert check_accepted(got, 1, stream) == A + B


def test_a_bad_layer_is_refused_after_the_good_ones_reached_the_sink():
    """Layers are validated one by one: layer 0 is written before layer 1's bytes fail."""
    got: list[tuple[int, bytes]] = []

    async def stream():  # noqa: ANN202 - a sender slow to finish layer 1
        for c in on_the_wire([_data(0, 0, A), _end(0, A), _data(1, 0, B)]):
            yield c
        await asyncio.sleep(0.05)
        for c in on_the_wire([_end(1, C), _trailer(A, C)]):
            yield c

    with pytest.raises(KVTransferError) as info:
        asyncio.run(GrpcBackend().receive(worker_pb2.PrefillRequest(backend="grpc"), LAYOUT, 1,
                                          stream(), collector(got, 1)))
    assert info.value.reason == "invalid"
    assert got == [(0, A)]


def test_many_layers_through_two_buffers_with_a_slow_sink():
    """Seven layers through the receiver's two reused buffers: a sink still copying layer i
    is never overwritten by layer i + 2, and every layer arrives intact and in order."""
    layout = PageLayout("fuzz-model", num_layers=7, num_kv_heads=1, block_size=2, head_dim=2,
                        dtype=torch.float32)
    layers = [bytes([i]) * (3 * BLOCK) for i in range(7)]
    stream = [c for i, x in enumerate(layers)
              for c in (_data(i, 0, x[:40]), _data(i, 40, x[40:]), _end(i, x))]
    stream.append(_trailer(*layers))
    got: list[tuple[int, bytes]] = []

    async def slow(layer: int, pages: torch.Tensor) -> None:
        await asyncio.sleep(0.01)  # meanwhile the receiver reads on into the other buffer
        got.append((layer, pages.contiguous().numpy().tobytes()))

    asyncio.run(GrpcBackend().receive(worker_pb2.PrefillRequest(backend="grpc"), layout, 3,
                                      _aiter(on_the_wire(stream)), slow))
    assert got == list(enumerate(layers))


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(random_chunks() | st.binary(max_size=40), max_size=8),
       num_blocks=st.integers(0, 3))
def test_receive_of_random_messages_raises_only_kv_transfer_errors(chunks, num_blocks):
    try:
        got = receive(num_blocks, chunks)
    except Refused as exc:
        check_sunk(exc.got, chunks)
        return
    if num_blocks:
        check_accepted(got, num_blocks, chunks)


def _receiver() -> RemotePrefill:
    remote = RemotePrefill.__new__(RemotePrefill)  # no engine: reading needs only these
    remote.layout = LAYOUT
    remote._backend = GrpcBackend()
    return remote


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_decode_side_stream_reader_raises_only_kv_transfer_errors(data):
    """The decode side's reading of a Prefill reply, as `RemotePrefill.fetch` does it: the
    header (`_header`), then the pages through the backend into a sink."""
    expected = data.draw(HASHES)
    first = data.draw(st.integers(0, 2))
    offered = expected[: data.draw(st.integers(0, len(expected)))]
    _, pages = data.draw(valid_pages(max(len(offered), 1)))
    header = PageChunk(header=header_for(LAYOUT, first, offered, "lease", 7))
    intact = [header, *pages]
    stream = data.draw(damaged(intact))
    req = worker_pb2.PrefillRequest(backend="grpc")
    got: list[tuple[int, bytes]] = []

    async def read():  # noqa: ANN202
        remote = _receiver()
        it = _aiter(on_the_wire(stream))
        got_header, offer = await remote._header(it, expected, first, 0)
        n = offer.num_blocks
        await remote._backend.receive(req, LAYOUT, n, it, collector(got, n))
        return got_header, n

    try:
        got_header, n = asyncio.run(read())
    except KVTransferError as exc:
        assert exc.reason in ("invalid", "incomplete")
        assert stream != intact or not offered
        check_sunk(got, stream[1:])
        return
    assert 1 <= n <= len(expected) and list(got_header.block_hashes) == expected[:n]
    check_accepted(got, n, stream[1:])


# -- sender side: a real prefill worker -----------------------------------------------------------

VOCAB, BS, MAX_LEN, KV_TOKENS = 49152, 16, 8192, 256 * 16


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    port = free_port()
    w = start_worker(tmp_path_factory.mktemp("fuzz"), "--role", "prefill", "--grpc-port",
                     str(port), "--num-threads", "1", "--num-kv-blocks", "256")
    ch = signing_channel(grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 8 << 20)]))
    try:
        yield w, worker_pb2_grpc.KVTransferStub(ch)
    finally:
        ch.close()
        assert w.stop() == 0, w.log()


ANY_FIELD = {  # a random value for each PrefillRequest field, in or out of range
    "request_id": st.text(max_size=300),
    "model_id": st.text(max_size=30),
    "token_ids": st.lists(U32, max_size=40) | st.lists(st.integers(0, VOCAB - 1), max_size=90),
    "cache_salt": st.text(max_size=20),
    "block_size": st.sampled_from([0, 1, 8, 32]) | U32,
    "first_block": st.integers(0, 8) | U32,
    "num_blocks": st.integers(0, 8) | U32,
    "backend": st.sampled_from(["", "GRPC", "nope", "grpc ", "shm", "auto"])
    | st.text(max_size=10),
    "torch": st.builds(worker_pb2.TorchChannel, store_host=st.text(max_size=20),
                       store_port=U32, group_id=st.text(max_size=20), tag=U64),
    "lease_s": st.floats(width=32),
    "tail_tokens": st.integers(0, 20) | U32,
    "shm_node": st.text(max_size=60),
    "shm_segment": st.sampled_from(["tandem-kv-" + "0" * 16 + "-" + "0" * 32, "../etc/passwd",
                                    "/dev/zero"]) | st.text(max_size=80),
    "shm_slot_bytes": U64,
    "shm_slots": st.integers(0, 5) | U32,
}


@st.composite
def prefill_requests(draw) -> worker_pb2.PrefillRequest:
    """A valid request (a short prompt, some of its full blocks) with up to 3 fields
    replaced by random values. The server decides validity up front (INVALID_ARGUMENT);
    a valid one with a lease too short to outlive the prefill ends DEADLINE_EXCEEDED."""
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=BS, max_size=5 * BS))
    full = len(prompt) // BS
    first = draw(st.integers(0, full - 1))
    num = draw(st.integers(1, full - first))
    tail = 0
    usable = (len(prompt) - 1) // BS
    if usable > first and draw(st.booleans()):  # the decode side's ask: up to the last token
        num, tail = usable - first, len(prompt) - 1 - usable * BS
    fields = {"request_id": draw(st.text(max_size=20)), "model_id": BUNDLED_NAME,
              "token_ids": prompt, "cache_salt": draw(st.just("") | st.text(max_size=8)),
              "block_size": BS, "first_block": first, "num_blocks": num, "backend": "grpc",
              "lease_s": draw(st.just(0.0) | st.floats(0, 2) | st.floats(5, 600)),
              "tail_tokens": tail}
    for name in draw(st.sets(st.sampled_from(sorted(ANY_FIELD)), max_size=3)):
        fields[name] = draw(ANY_FIELD[name])
    return worker_pb2.PrefillRequest(**fields)


def is_valid(req: worker_pb2.PrefillRequest) -> bool:
    """The protocol's rules for a request a prefill worker must serve (this worker: 256
    blocks of 16 tokens, the bundled model)."""
    n = len(req.token_ids)
    return (req.model_id == BUNDLED_NAME and req.block_size == BS
            and req.backend in ("grpc", "shm", "auto")  # shm: by grpc unless on this node
            and 0 < n < MAX_LEN and -(-(n + 1) // BS) * BS <= KV_TOKENS
            and all(t < VOCAB for t in req.token_ids)
            and req.num_blocks >= 1 and req.first_block + req.num_blocks <= n // BS
            and (not req.tail_tokens or (req.first_block + req.num_blocks == (n - 1) // BS
                                         and req.tail_tokens == n - 1 - (n - 1) // BS * BS))
            and 0 <= req.lease_s <= 600 and len(req.request_id) <= 256
            and len(req.cache_salt) <= 4096)


@pytest.mark.slow
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@example(req=worker_pb2.PrefillRequest(model_id=BUNDLED_NAME, token_ids=list(range(100, 140)),
                                       block_size=BS, first_block=1, num_blocks=1,
                                       backend="grpc", lease_s=1.0))
@example(req=worker_pb2.PrefillRequest(model_id=BUNDLED_NAME, token_ids=list(range(100, 140)),
                                       block_size=BS, num_blocks=2, backend="grpc",
                                       lease_s=math.nan))
@given(req=prefill_requests())
def test_random_prefill_requests_end_with_a_status(prefill, req):
    worker, stub = prefill
    assume(req.backend != "torch")  # a real pair group: another test's business
    req = worker_pb2.PrefillRequest.FromString(req.SerializeToString())  # float32 lease
    event("valid" if is_valid(req) else "invalid")
    short_lease = 0 < req.lease_s < 5  # may end before the pages are sent or acknowledged
    try:
        chunks = list(stub.Prefill(req, timeout=60))
    except grpc.RpcError as exc:
        if is_valid(req):
            assert short_lease and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (
                exc.code(), exc.details())
        else:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
    else:
        assert is_valid(req)
        header = chunks[0].header
        assert chunks[0].WhichOneof("kind") == "header"
        assert chunks[-1].WhichOneof("kind") == "trailer"
        assert (header.first_block, len(header.block_hashes), header.tail_tokens) == (
            req.first_block, req.num_blocks, req.tail_tokens)
        released = stub.ReleasePages(worker_pb2.ReleasePagesRequest(lease_id=header.lease_id),
                                     timeout=10).released
        assert released or short_lease
    assert httpx.get(worker.url + "/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_the_fuzzed_prefill_worker_holds_nothing_and_still_serves(prefill):
    worker, stub = prefill
    wait_idle(worker.url, 10)  # every lease above was released
    req = worker_pb2.PrefillRequest(model_id=BUNDLED_NAME, token_ids=list(range(200, 300)),
                                    block_size=BS, num_blocks=6, backend="grpc", lease_s=5)
    chunks = list(stub.Prefill(req, timeout=60))
    assert len(chunks[0].header.block_hashes) == 6
    assert chunks[-1].WhichOneof("kind") == "trailer"
