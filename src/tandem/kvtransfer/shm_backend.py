"""`shm` backend: page bytes through a shared-memory segment between workers on one node.

The receiver (decode worker) creates a segment of two layer slots (`shm_segments`) in
`prepare` and names it, with its node identity, in the request (`shm_*` fields). A sender
whose node identity differs, or that cannot open the segment, sends by `grpc` instead and
says so in the header (`transport`), so a cross-node request never fails for it: `shm` is
safe as a default wherever workers may or may not share a node (as NIXL/UCX pick shared
memory by themselves on one node).

Per layer L the sender waits until the receiver is done with slot L % 2's previous layer
(the control page's `consumed` counter), copies the layer's pages into that slot (from the
cache's page views or its gathered copy), hashes them and sends the layer's `PageLayerEnd`
(XXH3-64) on the Prefill stream; the trailer follows the last layer, as with `grpc`. The
receiver, on each `PageLayerEnd`, checks the order and the slot's digest before the sink
sees the bytes (which it reads from the slot into the engine's pinned blocks), and bumps
`consumed` once the sink is done. So the receiver never holds more than two layers, the
bytes cross memory once on each side, and a layer's validation is exactly the `grpc`
backend's. Any `PageData` on a `shm` stream is refused.

Lifetime: the receiver unlinks the segment as soon as the first layer arrives (the sender
has it mapped by then) and in `release`, which always runs (success, failure, timeout,
cancellation); the sender unmaps when its stream ends (its lease's end bounds it). A killed
receiver's segment goes at the next sweep on the node (`shm_segments.sweep`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import torch

from tandem.kvtransfer.base import BACKENDS, SendJob, TransferBackend, abandon, register_backend
from tandem.kvtransfer.grpc_backend import GrpcBackend
from tandem.kvtransfer.pages import (
    KVTransferError,
    LayerSink,
    PageChecksum,
    PageLayout,
    transfer_digest,
)
from tandem.kvtransfer.shm_segments import (
    Instance,
    Segment,
    node_identity,
    open_segment,
    unlink,
)
from tandem.protocol import worker_pb2

logger = logging.getLogger(__name__)
SLOTS = 2
HASH_IN_THREAD = 1 << 20  # hash larger layers off the event loop


def _digest(view: memoryview) -> int:
    return PageChecksum().update(view).digest()


def _copy_in(slot: memoryview, pieces: list[memoryview] | None, pages: torch.Tensor | None
             ) -> int:
    """Write a layer's bytes into `slot`; their XXH3-64."""
    if pieces is None:
        assert pages is not None
        src = pages.contiguous().view(torch.uint8).reshape(-1)
        torch.frombuffer(slot, dtype=torch.uint8).copy_(src)
    else:
        off = 0
        for p in pieces:
            slot[off:off + len(p)] = p
            off += len(p)
    return _digest(slot)


@register_backend
class ShmBackend(TransferBackend):
    name = "shm"

    def __init__(self) -> None:
        self.node = node_identity()
        self.layout: PageLayout | None = None
        self._instance: Instance | None = None
        self._segments: dict[str, Segment] = {}  # request's segment name -> its segment
        self._grpc = GrpcBackend()

    # -- receiver --------------------------------------------------------------------------
    def configure(self, *, device: torch.device, advertise_host: str,
                  layout: PageLayout | None = None) -> None:
        self.layout = layout
        self._instance = Instance()
        self._instance.maybe_sweep()  # what killed receivers on this node left behind

    async def prepare(self, request: worker_pb2.PrefillRequest, peer: str) -> None:
        """Create the transfer's segment (two slots of the requested layer size) and name it
        in `request`; without a layout or a node identity, ask for `grpc`."""
        if self.layout is None or not self.node:
            request.backend = "grpc"
            return
        if self._instance is None:
            self._instance = Instance()
        self._instance.maybe_sweep()
        blocks = request.num_blocks + (1 if request.tail_tokens else 0)
        slots = min(SLOTS, self.layout.num_layers)
        seg = self._instance.create(slots, blocks * self.layout.block_layer_bytes)
        self._segments[seg.name] = seg
        request.shm_node, request.shm_segment = self.node, seg.name
        request.shm_slots, request.shm_slot_bytes = seg.slots, seg.slot_bytes

    def for_transport(self, transport: str) -> TransferBackend:
        if transport == "grpc":
            return self._grpc
        return super().for_transport(transport)

    async def receive(self, request: worker_pb2.PrefillRequest, layout: PageLayout,
                      num_blocks: int, stream: AsyncIterator[worker_pb2.PageChunk],
                      sink: LayerSink) -> None:
        seg = self._segments.get(request.shm_segment)
        size = num_blocks * layout.block_layer_bytes
        if seg is None or size > seg.slot_bytes:
            raise KVTransferError("invalid", "no shared-memory segment fits this transfer")
        shape = layout.layer_shape(num_blocks)
        calls: list[asyncio.Future] = []
        done: list[bool] = []
        digests: list[int] = []

        def finished(layer: int) -> None:
            done[layer] = True
            n = seg.consumed
            while n < len(done) and done[n]:
                n += 1
            seg.consumed = n

        try:
            async for chunk in stream:
                kind = chunk.WhichOneof("kind") if isinstance(chunk, worker_pb2.PageChunk) \
                    else None
                if kind == "trailer":
                    if len(digests) != layout.num_layers:
                        raise KVTransferError("invalid", f"trailer after {len(digests)} of "
                                                         f"{layout.num_layers} layers")
                    if chunk.trailer.xxh3_64 != transfer_digest(digests):
                        raise KVTransferError("invalid", "page checksum mismatch")
                    await asyncio.gather(*calls)
                    return
                if kind != "layer_end":
                    raise KVTransferError("invalid", f"unexpected {kind or 'data'} message on "
                                                     "a shared-memory page stream")
                layer = len(digests)
                end = chunk.layer_end
                if end.layer != layer or layer >= layout.num_layers:
                    raise KVTransferError("invalid", f"layer {end.layer} ended; expected "
                                                     f"layer {layer}")
                if seg.consumed + seg.slots <= layer:  # it wrote a slot still in use
                    raise KVTransferError("invalid", f"layer {layer} overwrote a slot "
                                                     "still in use")
                if layer == 0:  # mapped by the sender: nothing needs the name any more
                    self._unlink(seg)
                view = seg.slot(layer % seg.slots, size)
                got = (await asyncio.to_thread(_digest, view) if size > HASH_IN_THREAD
                       else _digest(view))
                if end.xxh3_64 != got:
                    raise KVTransferError("invalid", f"page checksum mismatch in layer {layer}")
                digests.append(got)
                done.append(False)
                pages = torch.frombuffer(view, dtype=torch.uint8).view(layout.dtype).view(shape)
                call = asyncio.ensure_future(sink(layer, pages))
                call.add_done_callback(lambda f, n=layer: f.cancelled() or f.exception()
                                       or finished(n))
                calls.append(call)
        finally:
            for call in calls:
                abandon(call)
        raise KVTransferError("incomplete", "the page stream ended before its trailer")

    @staticmethod
    def _unlink(seg: Segment) -> None:
        unlink(seg.name)

    async def release(self, request: worker_pb2.PrefillRequest) -> None:
        seg = self._segments.pop(request.shm_segment, None)
        if seg is not None:
            self._unlink(seg)
            seg.close()

    async def close(self) -> None:
        for seg in self._segments.values():
            self._unlink(seg)
            seg.close()
        self._segments.clear()
        if self._instance is not None:
            self._instance.close()
        await self._grpc.close()

    # -- sender ----------------------------------------------------------------------------
    def transport(self, request: worker_pb2.PrefillRequest, layer_bytes: int) -> str:
        """`shm` when the receiver shares this node's shared memory and its segment fits
        `layer_bytes`, else `grpc`."""
        if not request.shm_node or request.shm_node != self.node:
            return "grpc"
        if request.shm_slot_bytes < layer_bytes:
            return "grpc"
        try:
            open_segment(request.shm_segment, request.shm_slots,
                         request.shm_slot_bytes).close()
        except (OSError, ValueError) as exc:
            logger.warning("[%s] shared-memory segment unusable (%s); sending by grpc",
                           request.request_id[:64], exc)
            return "grpc"
        return "shm"

    async def send(self, job: SendJob) -> AsyncIterator[worker_pb2.PageChunk]:
        """Each layer into its slot once the receiver is done with the slot, then its
        digest; the trailer last. Stops at the lease's end (`job.deadline`)."""
        req = job.request
        loop = asyncio.get_running_loop()
        seg = open_segment(req.shm_segment, req.shm_slots, req.shm_slot_bytes)
        size = len(job.block_ids) * job.layout.block_layer_bytes
        digests: list[int] = []

        def fill(layer: int) -> int:
            pieces = job.views(layer) if job.views is not None else None
            pages = None
            if pieces is None:
                with job.device_context():
                    pages = job.gather(layer)
            return _copy_in(seg.slot(layer % seg.slots, size), pieces, pages)

        try:
            for layer in range(job.layout.num_layers):
                if job.layers is not None:
                    await job.layers.wait(layer)
                delay = 0.0
                while seg.consumed + seg.slots <= layer:  # its slot's last layer is in use
                    if loop.time() > job.deadline:
                        raise KVTransferError("expired", "the lease ended before the pages "
                                                         "were sent")
                    await asyncio.sleep(delay)
                    delay = min(0.002, delay * 2 or 5e-5)
                digests.append(await asyncio.to_thread(fill, layer))
                yield worker_pb2.PageChunk(layer_end=worker_pb2.PageLayerEnd(
                    layer=layer, xxh3_64=digests[-1]))
        finally:
            seg.close()
        yield worker_pb2.PageChunk(trailer=worker_pb2.PageTrailer(
            xxh3_64=transfer_digest(digests)))


BACKENDS["auto"] = ShmBackend  # the flag's default: shared memory on one node, else grpc
