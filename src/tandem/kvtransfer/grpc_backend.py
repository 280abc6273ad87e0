"""`grpc` backend: the page bytes travel as bounded `PageData` chunks on the Prefill stream.

The receiver accepts only what it asked for: layers in order, each chunk at the next
offset, at most `MAX_DATA_CHUNK` bytes, exactly `layer_bytes` per layer, each layer closed
by a `PageLayerEnd` whose XXH3-64 matches its bytes, then a trailer whose checksum matches
the layers' digests. Anything else raises `KVTransferError("invalid")`; a stream that ends
early raises `KVTransferError("incomplete")`. A layer is handed to the caller's sink as soon
as its digest checks, so the receiver holds two layers' bytes at most (two buffers, reused:
one filling while the sink writes the other), whatever the transfer's size.

Data messages are the `PageChunk{data: PageData}` wire format, but encoded and decoded here
(`encode_data`, `decode_chunk`): the payload is copied once into the message on the way out
and viewed, not copied, on the way in. protobuf's generic path copied each byte three times
more, which capped loopback transfers well below 1 GB/s. Anything `decode_chunk` does not
recognise goes through the generic protobuf parser.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tandem.kvtransfer.base import SendJob, SinkCalls, TransferBackend, register_backend
from tandem.kvtransfer.pages import (
    MAX_DATA_CHUNK,
    SEND_CHUNK,
    KVTransferError,
    LayerSink,
    PageChecksum,
    PageLayout,
    layer_buffer,
    tensor_bytes,
    transfer_digest,
)
from tandem.protocol import worker_pb2


@dataclass(frozen=True)
class RawPageData:
    """A decoded data message whose payload is a view into the received bytes."""

    layer: int
    offset: int
    data: memoryview


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    """(value, next index); raises ValueError past the end or beyond 64 bits."""
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("bad varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def _data_prefix(layer: int, offset: int, size: int) -> bytes:
    """The bytes of a `PageChunk{data: PageData}` message before its `size`-byte payload."""
    inner = b"\x08" + _varint(layer) + b"\x10" + _varint(offset) + b"\x1a" + _varint(size)
    return b"\x12" + _varint(len(inner) + size) + inner


def encode_data(layer: int, offset: int, payload: memoryview | bytes) -> bytes:
    """`PageChunk(data=PageData(layer, offset, payload)).SerializeToString()`, one copy."""
    return _data_prefix(layer, offset, len(payload)) + payload


def encode_pages(layer: int, pieces: list[memoryview], chunk: int,
                 checksum: PageChecksum) -> list[bytes]:
    """Data messages of one layer from its bytes given as pieces in wire order: whole
    pieces per message, up to `chunk` bytes (a piece larger than `chunk` goes alone). Each
    payload is copied once, from the pieces into the message, and fed to `checksum` in
    order."""
    out: list[bytes] = []
    offset = i = 0
    while i < len(pieces):
        j, size = i + 1, len(pieces[i])
        while j < len(pieces) and size + len(pieces[j]) <= chunk:
            size += len(pieces[j])
            j += 1
        prefix = _data_prefix(layer, offset, size)
        message = b"".join((prefix, *pieces[i:j]))
        checksum.update(memoryview(message)[len(prefix):])
        out.append(message)
        offset, i = offset + size, j
    return out


def decode_chunk(raw: bytes) -> worker_pb2.PageChunk | RawPageData:
    """A data message as `RawPageData` (payload not copied); anything else parsed by
    protobuf (which raises on malformed input)."""
    try:
        if raw[:1] == b"\x12":
            size, i = _read_varint(raw, 1)
            if i + size == len(raw):
                fields: dict[int, int] = {}
                payload = None
                while i < len(raw):
                    key, i = _read_varint(raw, i)
                    if key in (0x08, 0x10) and key not in fields:
                        fields[key], i = _read_varint(raw, i)
                    elif key == 0x1A and payload is None:
                        n, i = _read_varint(raw, i)
                        if i + n > len(raw):
                            raise ValueError("truncated payload")
                        payload = memoryview(raw)[i:i + n]
                        i += n
                    else:
                        raise ValueError("unexpected field")
                if payload is not None:
                    return RawPageData(fields.get(0x08, 0), fields.get(0x10, 0), payload)
    except ValueError:
        pass
    return worker_pb2.PageChunk.FromString(raw)


def serialize_chunk(message: worker_pb2.PageChunk | bytes) -> bytes:
    """The Prefill stream's serializer: pre-encoded data messages pass through."""
    return message if isinstance(message, bytes) else message.SerializeToString()


@register_backend
class GrpcBackend(TransferBackend):
    name = "grpc"
    chunk = SEND_CHUNK  # sender: payload bytes per data message (at most MAX_DATA_CHUNK)

    async def send(self, job: SendJob) -> AsyncIterator[worker_pb2.PageChunk | bytes]:
        """Layer by layer, each closed by its digest; the next layer is gathered, hashed and
        encoded in a thread while this one's messages go out (once it is computed, when
        `job.layers` is set)."""
        loop = asyncio.get_running_loop()
        layers = job.layout.num_layers

        def prepare(layer: int) -> tuple[list[bytes], int]:
            # a host cache is read in place, block by block; a device cache is gathered
            pieces = job.views(layer) if job.views is not None else None
            if pieces is None:
                with job.device_context():
                    data = tensor_bytes(job.gather(layer).cpu())
                pieces = [data[off:off + self.chunk] for off in range(0, len(data), self.chunk)]
            checksum = PageChecksum()
            return encode_pages(layer, pieces, self.chunk, checksum), checksum.digest()

        async def ready_then_prepare(layer: int) -> tuple[list[bytes], int]:
            if job.layers is not None:
                await job.layers.wait(layer)
            return await asyncio.to_thread(prepare, layer)

        digests: list[int] = []
        nxt = asyncio.ensure_future(ready_then_prepare(0))
        try:
            for layer in range(layers):
                messages, digest = await nxt
                if layer + 1 < layers:
                    nxt = asyncio.ensure_future(ready_then_prepare(layer + 1))
                for message in messages:
                    if loop.time() > job.deadline:
                        raise KVTransferError("expired", "the lease ended before the pages "
                                                         "were sent")
                    yield message
                digests.append(digest)
                yield worker_pb2.PageChunk(layer_end=worker_pb2.PageLayerEnd(
                    layer=layer, xxh3_64=digest))
        finally:
            nxt.cancel()
        yield worker_pb2.PageChunk(trailer=worker_pb2.PageTrailer(
            xxh3_64=transfer_digest(digests)))

    async def receive(self, request: worker_pb2.PrefillRequest, layout: PageLayout,
                      num_blocks: int,
                      stream: AsyncIterator[worker_pb2.PageChunk | RawPageData],
                      sink: LayerSink) -> None:
        size = num_blocks * layout.block_layer_bytes
        shape = layout.layer_shape(num_blocks)
        slots = [layer_buffer(size) for _ in range(min(2, layout.num_layers) if size else 0)]
        calls = SinkCalls(sink, len(slots))
        digests: list[int] = []
        layer, filled, slot = 0, 0, 0
        # each chunk is hashed as it is copied, while its bytes are still in cache: ~12 %
        # less receiver CPU than hashing whole layers again in a thread (256-block loop)
        checksum = PageChecksum()
        try:
            async for chunk in stream:
                if isinstance(chunk, RawPageData):
                    kind, d = "data", chunk
                elif isinstance(chunk, worker_pb2.PageChunk):
                    kind = chunk.WhichOneof("kind")
                    d = chunk.data
                else:  # grpc hands on a message its deserializer failed on as None
                    raise KVTransferError("invalid", "an undecodable message among the pages")
                if kind == "trailer":
                    if layer < layout.num_layers and size:
                        raise KVTransferError("invalid", f"trailer after {layer} of "
                                                         f"{layout.num_layers} layers")
                    if chunk.trailer.xxh3_64 != transfer_digest(digests):
                        raise KVTransferError("invalid", "page checksum mismatch")
                    await calls.finish()
                    return
                if kind == "layer_end":
                    end = chunk.layer_end
                    if (not slots or layer >= layout.num_layers or end.layer != layer
                            or filled != size):
                        raise KVTransferError("invalid", f"layer {end.layer} ended at byte "
                                                         f"{filled} of layer {layer}")
                    if end.xxh3_64 != checksum.digest():
                        raise KVTransferError("invalid", f"page checksum mismatch in layer "
                                                         f"{layer}")
                    digests.append(end.xxh3_64)
                    calls.start(layer, slots[slot][0].view(layout.dtype).view(shape))
                    layer, filled, checksum = layer + 1, 0, PageChecksum()
                    continue
                if kind != "data":
                    raise KVTransferError("invalid", f"unexpected {kind} message among the "
                                                     f"pages")
                if not slots or layer >= layout.num_layers:
                    raise KVTransferError("invalid", "page data after the last layer")
                if d.layer != layer or d.offset != filled:
                    raise KVTransferError("invalid", f"page data out of order (layer "
                                                     f"{d.layer} offset {d.offset}; expected "
                                                     f"layer {layer} offset {filled})")
                n = len(d.data)
                if n == 0 or n > MAX_DATA_CHUNK or filled + n > size:
                    raise KVTransferError("invalid", f"page chunk of {n} bytes at {filled} "
                                                     f"does not fit a {size}-byte layer")
                if filled == 0:  # a new layer: into a slot the sink is done with
                    slot = await calls.slot_free(layer)
                slots[slot][1][filled:filled + n] = d.data
                checksum.update(d.data)
                filled += n
        finally:
            calls.abandon()  # on failure no sink call goes on; its threads are the sink's
        raise KVTransferError("incomplete", "the page stream ended before its trailer")
