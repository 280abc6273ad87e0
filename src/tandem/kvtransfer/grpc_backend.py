"""`grpc` backend: the page bytes travel as bounded `PageData` chunks on the Prefill stream.

The receiver accepts only what it asked for: layers in order, each chunk at the next
offset, at most `MAX_DATA_CHUNK` bytes, exactly `layer_bytes` per layer, then a trailer whose
crc32 matches. Anything else raises `KVTransferError("invalid")`; a stream that ends early
raises `KVTransferError("incomplete")`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from tandem.kvtransfer.base import SendJob, TransferBackend, register_backend
from tandem.kvtransfer.pages import (
    MAX_DATA_CHUNK,
    SEND_CHUNK,
    KVTransferError,
    PageLayout,
    crc32_update,
    tensor_bytes,
)
from tandem.protocol import worker_pb2


@register_backend
class GrpcBackend(TransferBackend):
    name = "grpc"

    async def send(self, job: SendJob) -> AsyncIterator[worker_pb2.PageChunk]:
        loop = asyncio.get_running_loop()
        crc = 0
        for layer in range(job.layout.num_layers):
            pages = await asyncio.to_thread(job.gather, layer)
            data = tensor_bytes(pages.cpu())
            for off in range(0, len(data), SEND_CHUNK):
                if loop.time() > job.deadline:
                    raise KVTransferError("expired", "the lease ended before the pages "
                                                     "were sent")
                piece = data[off:off + SEND_CHUNK]
                crc = crc32_update(crc, piece)
                yield worker_pb2.PageChunk(data=worker_pb2.PageData(
                    layer=layer, offset=off, data=bytes(piece)))
        yield worker_pb2.PageChunk(trailer=worker_pb2.PageTrailer(crc32=crc))

    async def receive(self, request: worker_pb2.PrefillRequest, layout: PageLayout,
                      num_blocks: int, stream: AsyncIterator[worker_pb2.PageChunk]
                      ) -> list[torch.Tensor]:
        size = num_blocks * layout.block_layer_bytes
        buffers = [bytearray(size) for _ in range(layout.num_layers)] if size else []
        layer, filled, crc = 0, 0, 0
        async for chunk in stream:
            kind = chunk.WhichOneof("kind")
            if kind == "trailer":
                if layer < layout.num_layers and size:
                    raise KVTransferError("invalid", f"trailer after {layer} of "
                                                     f"{layout.num_layers} layers")
                if chunk.trailer.crc32 != crc:
                    raise KVTransferError("invalid", "page checksum mismatch")
                shape = layout.layer_shape(num_blocks)
                return [torch.frombuffer(b, dtype=torch.uint8).view(layout.dtype).view(shape)
                        for b in buffers]
            if kind != "data":
                raise KVTransferError("invalid", f"unexpected {kind} message among the pages")
            d = chunk.data
            if layer >= len(buffers):
                raise KVTransferError("invalid", "page data after the last layer")
            if d.layer != layer or d.offset != filled:
                raise KVTransferError("invalid", f"page data out of order (layer {d.layer} "
                                                 f"offset {d.offset}; expected layer {layer} "
                                                 f"offset {filled})")
            n = len(d.data)
            if n == 0 or n > MAX_DATA_CHUNK or filled + n > size:
                raise KVTransferError("invalid", f"page chunk of {n} bytes at {filled} does "
                                                 f"not fit a {size}-byte layer")
            buffers[layer][filled:filled + n] = d.data
            crc = crc32_update(crc, d.data)
            filled += n
            if filled == size:
                layer, filled = layer + 1, 0
        raise KVTransferError("incomplete", "the page stream ended before its trailer")
