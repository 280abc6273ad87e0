"""`shm` backend: page bytes through a shared-memory segment between workers on one node.

The receiver (decode worker) asks for `grpc` and offers a segment of layer slots
(`shm_segments`; two, or more while small layers fit `SLOT_BUDGET`: `slots_for`), created in
`prepare` and named, with its node identity, in the request (`shm_*` fields). A sender on
the same node (same identity, segment opened) answers with the header's `transport` "shm";
any other sender (another node, another /dev/shm, a version without shm) sends by grpc, so
no request fails for the offer: `auto` is safe as a default wherever workers may or may not
share a node (as NIXL/UCX pick shared memory by themselves on one node).

Per layer L the sender's writer thread waits until the receiver is done with slot L % S's
previous layer (the control page's `consumed` counter), copies the layer's pages into that
slot and hashes them (from a host cache in one native call that hashes each block as it
copies it, `HostPages.digest_into`, the GIL released; else in chunks, or from the cache's
page views or its gathered copy), and the stream sends the layer's `PageLayerEnd` (XXH3-64)
on the Prefill stream while the thread goes on with the next layer: every digest ready goes
in one `layer_ends` message when the request allows it (`shm_layer_batches`). A small send
from a host cache whose layers each have a slot runs on the event loop instead
(`INLINE_SEND`: no thread, no hand-off). The trailer follows the last layer, as with `grpc`.
The receiver, on each layer's end, checks the order and the slot's digest before the sink
sees the bytes; a `HashingSink` (the engine's import writer) writes them into its pinned
blocks while hashing them, one pass over the slot, and the digest is checked right after
(a mismatch fails the transfer; those blocks are freed uncached). It bumps `consumed` once
the sink is done. So the receiver holds at most S layers, the bytes cross memory once on
each side, and a layer's validation is exactly the `grpc` backend's. Any `PageData` on a
`shm` stream is refused.

Lifetime: the receiver unlinks the segment as soon as the first layer arrives (the sender
has it mapped by then) and in `release`, which always runs (success, failure, timeout,
cancellation); the sender unmaps when its stream ends (its lease's end bounds it). A killed
receiver's segment goes at the next sweep on the node (`shm_segments.sweep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch

from tandem.kvtransfer.base import BACKENDS, SendJob, TransferBackend, abandon, register_backend
from tandem.kvtransfer.fastcopy import CHUNK, copy_digest, gather_digest
from tandem.kvtransfer.grpc_backend import GrpcBackend
from tandem.kvtransfer.pages import (
    HashingSink,
    KVTransferError,
    LayerSink,
    PageChecksum,
    PageLayout,
    tensor_bytes,
    transfer_digest,
)
from tandem.kvtransfer.shm_segments import (
    Instance,
    Segment,
    node_identity,
    open_segment,
    path_of,
    unlink,
)
from tandem.protocol import worker_pb2

if TYPE_CHECKING:
    from tandem.kvtransfer.layer_stream import LayerStream

logger = logging.getLogger(__name__)
SLOTS = 2  # layer slots at least; more while they fit SLOT_BUDGET (up to one per layer)
# bytes of slots a receiver offers beyond two: small layers get more slots, so the sender
# runs further ahead of the receiver and a transfer is not one round trip per two layers
SLOT_BUDGET = 8 << 20
# a send of at most this many bytes from a host cache, each layer with a slot of its own,
# is copied on the event loop (`_send_inline`): a thread and its hand-offs cost more
INLINE_SEND = 4 << 20
# a layer larger than this is written into its slot with non-temporal stores: two slots of
# it would not stay in a last-level cache for the receiver to read them from
STREAM_SLOTS_ABOVE = 16 << 20
IDLE_PER_PEER = 2  # receiver: segments kept per prefill worker between transfers
IDLE_S = 30.0  # ... for at most this long
MAPPED = 8  # sender: receivers' segments kept mapped
GRPC_PEER_S = 300.0  # receiver: how long a peer that answered by grpc is asked for grpc
HASH_IN_THREAD = 16 << 20  # hash larger layers off the event loop (~0.5 ms and more)
# layers up to this size are copied, then hashed: the copy is still in the last-level
# cache; larger ones are hashed chunk by chunk as they are copied (`copy_digest`)
FUSE_ABOVE = 8 << 20
# sender: while its next slot is still in use it sleeps on the `consumed` futex (woken as
# the receiver bumps it) for at most WAIT_SLICE_S at a time, or, without futexes, polls
# with sleeps that double from POLL_MIN_S to POLL_MAX_S
WAIT_SLICE_S = 5e-3
POLL_MIN_S, POLL_MAX_S = 2e-5, 5e-4


def slots_for(num_layers: int, layer_bytes: int) -> int:
    """The slots a receiver offers for layers of `layer_bytes`: `SLOTS`, or more while they
    fit `SLOT_BUDGET`, at most one per layer."""
    return min(num_layers, max(SLOTS, SLOT_BUDGET // max(1, layer_bytes)))


def _digest(view: memoryview) -> int:
    return PageChecksum().update(view).digest()


def _copy_in(slot: memoryview, pieces: list[memoryview] | None, pages: torch.Tensor | None
             ) -> int:
    """Write a layer's bytes into `slot`; their XXH3-64. Host bytes of a layer over
    `FUSE_ABOVE` are hashed as they are copied (`copy_digest`: they cross memory once); a
    device tensor is copied, then hashed."""
    if pieces is None:
        assert pages is not None
        src = pages.contiguous().view(torch.uint8).reshape(-1)
        if src.device.type == "cpu":
            return copy_digest(slot, [tensor_bytes(src)],
                               CHUNK if len(slot) > FUSE_ABOVE else len(slot))
        torch.frombuffer(slot, dtype=torch.uint8).copy_(src)
        return _digest(slot)
    return copy_digest(slot, pieces, CHUNK if len(slot) > FUSE_ABOVE else len(slot))


def _check(got: int, want: int, layer: int) -> None:
    if got != want:
        raise KVTransferError("invalid", f"page checksum mismatch in layer {layer}")


async def _check_slot(view: memoryview, want: int, layer: int) -> None:
    """The slot's bytes hash to `want` (hashed off the event loop when large)."""
    _check(await asyncio.to_thread(_digest, view) if len(view) > HASH_IN_THREAD
           else _digest(view), want, layer)


async def _write_checked(sink: HashingSink, layer: int, pages: torch.Tensor, view: memoryview,
                         want: int) -> None:
    """`sink` writes `layer` while hashing it (one pass over the slot), then the digest is
    checked: a mismatch fails the transfer, and the blocks written are freed uncached
    (`HashingSink`). A sink that cannot hash gets the pages after the check, as any sink."""
    got = await sink.write_hashed(layer, pages)
    if got is not None:
        _check(got, want, layer)
        return
    await _check_slot(view, want, layer)
    await sink(layer, pages)


@register_backend
class ShmBackend(TransferBackend):
    name = "shm"

    def __init__(self) -> None:
        self.node = node_identity()
        self.layout: PageLayout | None = None
        self._instance: Instance | None = None
        self._segments: dict[str, Segment] = {}  # leased: request's segment name -> it
        self._clean: set[str] = set()  # leased segments whose transfer succeeded
        self._idle: dict[str, list[Segment]] = {}  # peer -> segments kept for its next ones
        self._maps: OrderedDict[str, Segment] = OrderedDict()  # sender: mapped segments
        self._grpc = GrpcBackend()
        self._grpc_peers: dict[str, float] = {}  # peer -> when it last answered by grpc

    # -- receiver --------------------------------------------------------------------------
    def configure(self, *, device: torch.device, advertise_host: str,
                  layout: PageLayout | None = None) -> None:
        self.layout = layout
        self._instance = Instance()
        self._instance.maybe_sweep()  # what killed receivers on this node left behind

    async def prepare(self, request: worker_pb2.PrefillRequest, peer: str) -> None:
        """Ask for `grpc`, offering a segment (two slots of the requested layer size) named
        in `request`'s `shm_*` fields: a sender on this node answers with the header's
        `transport` "shm"; one elsewhere (or one that knows no shm) sends by grpc. No
        segment without a layout or a node identity, or for a peer that answered by grpc in
        the last `GRPC_PEER_S`."""
        request.backend = "grpc"  # what a sender that knows no shm sends by
        grpc_since = self._grpc_peers.get(peer)
        if (self.layout is None or not self.node
                or (grpc_since is not None and time.monotonic() - grpc_since < GRPC_PEER_S)):
            return  # no segment for a peer known to be on another node
        if self._instance is None:
            self._instance = Instance()
        self._instance.maybe_sweep()
        blocks = request.num_blocks + (1 if request.tail_tokens else 0)
        need = blocks * self.layout.block_layer_bytes
        slots = slots_for(self.layout.num_layers, need)
        seg = self._reuse(peer, need, slots)
        if seg is None:
            try:
                seg = self._instance.create(slots, need)
            except OSError as exc:  # shared memory full or missing: no offer
                logger.warning("[%s] no shared-memory segment of %d x %d bytes (%s); asking "
                               "for grpc", request.request_id[:64], slots, need, exc)
                return
            seg.peer = peer
        seg.consumed = 0
        self._segments[seg.name] = seg
        request.shm_node, request.shm_segment = self.node, seg.name
        request.shm_slots, request.shm_slot_bytes = seg.slots, seg.slot_bytes
        request.shm_layer_batches = True

    def _reuse(self, peer: str, need: int, slots: int) -> Segment | None:
        """An idle segment kept for `peer` of `slots` slots that fit `need` bytes each
        without holding more than four times that; drops the idle ones past `IDLE_S`."""
        now = time.monotonic()
        for key in list(self._idle):
            keep = []
            for seg in self._idle[key]:
                if now - seg.idle_since > IDLE_S:
                    self._discard(seg)
                else:
                    keep.append(seg)
            self._idle[key] = keep
        pool = self._idle.get(peer, [])
        for i, seg in enumerate(pool):
            if seg.slots == slots and need <= seg.slot_bytes <= 4 * need + (1 << 16):
                return pool.pop(i)
        return None

    def _discard(self, seg: Segment) -> None:
        unlink(seg.name)
        seg.close()

    def for_transport(self, transport: str) -> TransferBackend:
        if transport == "grpc":  # the request's backend: the sender did not take the offer
            return _Fallback(self)
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
        hashing = isinstance(sink, HashingSink)

        def finished(layer: int) -> None:
            done[layer] = True  # failed too: the sender goes on, the failure is raised here
            n = seg.consumed
            while n < len(done) and done[n]:
                n += 1
            seg.consumed = n  # a change wakes a sender asleep on its next slot

        async def layer_end(end: worker_pb2.PageLayerEnd) -> None:
            layer = len(digests)
            if end.layer != layer or layer >= layout.num_layers:
                raise KVTransferError("invalid", f"layer {end.layer} ended; expected "
                                                 f"layer {layer}")
            if seg.consumed + seg.slots <= layer:  # it wrote a slot still in use
                raise KVTransferError("invalid", f"layer {layer} overwrote a slot "
                                                 "still in use")
            view = seg.slot(layer % seg.slots, size)
            pages = torch.frombuffer(view, dtype=torch.uint8).view(layout.dtype).view(shape)
            if hashing:  # written while hashed, checked after
                work = _write_checked(sink, layer, pages, view, end.xxh3_64)  # type: ignore[arg-type]
            else:
                await _check_slot(view, end.xxh3_64, layer)
                work = sink(layer, pages)
            digests.append(end.xxh3_64)
            done.append(False)
            call = asyncio.ensure_future(work)
            call.add_done_callback(lambda f, n=layer: finished(n))
            calls.append(call)

        try:
            async for chunk in stream:
                for call in calls:  # a failed sink call ends the transfer
                    if call.done() and not call.cancelled() and call.exception() is not None:
                        raise call.exception()  # type: ignore[misc]
                kind = chunk.WhichOneof("kind") if isinstance(chunk, worker_pb2.PageChunk) \
                    else None
                if kind == "trailer":
                    if len(digests) != layout.num_layers:
                        raise KVTransferError("invalid", f"trailer after {len(digests)} of "
                                                         f"{layout.num_layers} layers")
                    if chunk.trailer.xxh3_64 != transfer_digest(digests):
                        raise KVTransferError("invalid", "page checksum mismatch")
                    await asyncio.gather(*calls)
                    self._clean.add(seg.name)
                    return
                if kind == "layer_end":
                    await layer_end(chunk.layer_end)
                elif kind == "layer_ends" and request.shm_layer_batches:
                    if not 0 < len(chunk.layer_ends.ends) <= layout.num_layers - len(digests):
                        raise KVTransferError("invalid", f"{len(chunk.layer_ends.ends)} layer "
                                                         "ends in one message")
                    for end in chunk.layer_ends.ends:
                        await layer_end(end)
                else:
                    raise KVTransferError("invalid", f"unexpected {kind or 'data'} message on "
                                                     "a shared-memory page stream")
        finally:
            for call in calls:
                abandon(call)
        raise KVTransferError("incomplete", "the page stream ended before its trailer")

    async def release(self, request: worker_pb2.PrefillRequest) -> None:
        """After a clean transfer the segment is kept for the same peer's next one (at most
        `IDLE_PER_PEER`, for `IDLE_S`); after any failure it is unlinked at once."""
        seg = self._segments.pop(request.shm_segment, None)
        if seg is None:
            return
        if request.shm_segment not in self._clean:
            self._discard(seg)
            return
        self._clean.discard(seg.name)
        pool = self._idle.setdefault(seg.peer, [])
        seg.idle_since = time.monotonic()
        pool.append(seg)
        while len(pool) > IDLE_PER_PEER:
            self._discard(pool.pop(0))

    async def close(self) -> None:
        for seg in [*self._segments.values(), *(s for p in self._idle.values() for s in p)]:
            self._discard(seg)  # this receiver's own
        for seg in self._maps.values():
            seg.close()  # the receivers'
        self._segments.clear()
        self._idle.clear()
        self._maps.clear()
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
            self._mapped(request)
        except (OSError, ValueError) as exc:
            logger.warning("[%s] shared-memory segment unusable (%s); sending by grpc",
                           request.request_id[:64], exc)
            return "grpc"
        return "shm"

    async def send(self, job: SendJob) -> AsyncIterator[worker_pb2.PageChunk]:
        """Each layer into its slot once the receiver is done with the slot, then its
        digest; the trailer last. Stops at the lease's end (`job.deadline`).

        One thread per send writes the layers (`_Writer`): it waits for each slot itself
        and goes on with the next layer while this coroutine sends the last one's digest,
        so neither the stream nor a thread hand-off per layer holds the copies up."""
        seg = self._mapped(job.request)
        batches = job.request.shm_layer_batches
        size = len(job.block_ids) * job.layout.block_layer_bytes
        if (batches and job.gather_into is not None and seg.slots >= job.layout.num_layers
                and size * job.layout.num_layers <= INLINE_SEND):
            async for chunk in self._send_inline(seg, job, size):
                yield chunk
            return
        writer = _Writer(seg, job, asyncio.get_running_loop())
        digests: list[int] = []
        try:
            while len(digests) < job.layout.num_layers:
                first = len(digests)
                digests.append(await writer.digest(first))
                while batches and len(digests) < job.layout.num_layers and writer.ready():
                    digests.append(await writer.digest(len(digests)))  # ready: no wait
                yield _ends(digests, first)
        finally:
            writer.stop()
        yield worker_pb2.PageChunk(trailer=worker_pb2.PageTrailer(
            xxh3_64=transfer_digest(digests)))

    async def _send_inline(self, seg: Segment, job: SendJob, size: int
                           ) -> AsyncIterator[worker_pb2.PageChunk]:
        """`send` for a small transfer from a host cache whose every layer has a slot of its
        own: each layer is copied on the event loop as soon as it is computed (microseconds
        each: no thread, no hand-off), and the digests ready go in one message whenever the
        next layer is still computing, and at the end."""
        digests: list[int] = []
        first = 0
        for layer in range(job.layout.num_layers):
            if job.layers is not None and job.layers.done <= layer:
                if first < layer:
                    yield _ends(digests, first)
                    first = layer
                await job.layers.wait(layer)
            digests.append(_fill(seg, job, layer, size))
        yield _ends(digests, first)
        yield worker_pb2.PageChunk(trailer=worker_pb2.PageTrailer(
            xxh3_64=transfer_digest(digests)))

    def _mapped(self, request: worker_pb2.PrefillRequest) -> Segment:
        """Sender: the request's segment, mapped (kept for the receiver's next transfers
        through it; mappings of segments unlinked since are dropped here, and at most
        `MAPPED` stay)."""
        for name in [n for n in self._maps if not os.path.exists(path_of(n))]:
            self._maps.pop(name).close()
        seg = self._maps.get(request.shm_segment)
        if seg is not None and (seg.slots, seg.slot_bytes) == (request.shm_slots,
                                                               request.shm_slot_bytes):
            self._maps.move_to_end(seg.name)
            return seg
        seg = open_segment(request.shm_segment, request.shm_slots, request.shm_slot_bytes)
        self._maps[seg.name] = seg
        while len(self._maps) > MAPPED:
            self._maps.popitem(last=False)[1].close()
        return seg


class _Writer:
    """A send's writer thread: layer by layer, in order, it waits until the layer is computed
    (`job.layers`, forwarded from the event loop) and its slot is free (the receiver's
    `consumed`: asleep on its futex, woken as the receiver bumps it; polled where there is
    no futex), then copies and
    hashes the layer into the slot and posts the digest to `digest`. Any error, or the
    lease's end while waiting for a slot (KVTransferError "expired"), is posted instead.
    `stop` ends it after at most the layer it is writing."""

    def __init__(self, seg: Segment, job: SendJob, loop: asyncio.AbstractEventLoop) -> None:
        self.seg, self.job, self.loop = seg, job, loop
        self.size = len(job.block_ids) * job.layout.block_layer_bytes
        self.deadline = time.monotonic() + (job.deadline - loop.time())
        self._posted: asyncio.Queue[int | BaseException] = asyncio.Queue()
        self._stop = threading.Event()
        self._ready: threading.Semaphore | None = None
        self._feeder: asyncio.Future | None = None
        if job.layers is not None:
            self._ready = threading.Semaphore(0)
            self._feeder = asyncio.ensure_future(self._feed(job.layers))
        threading.Thread(target=self._run, name="kv-shm-send", daemon=True).start()

    async def _feed(self, layers: LayerStream) -> None:
        """Hand the thread each computed layer; a failed wait (the prefill failed, the lease
        ended) is raised on the stream after the layers already written."""
        try:
            for layer in range(self.job.layout.num_layers):
                await layers.wait(layer)
                self._ready.release()  # type: ignore[union-attr]
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised on the stream
            self._posted.put_nowait(exc)

    def ready(self) -> bool:
        """A digest (or an error) is posted: `digest` returns without waiting."""
        return not self._posted.empty()

    async def digest(self, layer: int) -> int:
        """Layer `layer`'s digest once it is in its slot (layers come in order)."""
        got = await self._posted.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def stop(self) -> None:
        self._stop.set()
        self.seg.wake()  # the thread, if asleep on a slot
        if self._feeder is not None:
            self._feeder.cancel()

    def _run(self) -> None:
        try:
            for layer in range(self.job.layout.num_layers):
                if not self._wait(layer):
                    return
                self._post(self._fill(layer))
        except BaseException as exc:  # noqa: BLE001 - handed to the stream, raised there
            self._post(exc)

    def _post(self, item: int | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self.loop.call_soon_threadsafe(self._posted.put_nowait, item)

    def _wait(self, layer: int) -> bool:
        """Until `layer` is computed and its slot is free; False once stopped."""
        while self._ready is not None and not self._ready.acquire(timeout=0.05):
            if self._stop.is_set():
                return False
        seg, delay = self.seg, 0.0
        while (seen := seg.consumed) + seg.slots <= layer:  # its slot's last layer is in use
            if self._stop.is_set():
                return False
            now = time.monotonic()
            if now > self.deadline:
                raise KVTransferError("expired", "the lease ended before the pages were sent")
            if not seg.wait_consumed(seen, min(WAIT_SLICE_S, self.deadline - now)):
                time.sleep(delay)  # no futex: poll
                delay = min(POLL_MAX_S, delay * 2 or POLL_MIN_S)
        return not self._stop.is_set()

    def _fill(self, layer: int) -> int:
        return _fill(self.seg, self.job, layer, self.size)


def _ends(digests: list[int], first: int) -> worker_pb2.PageChunk:
    """The message ending layers first.. (`digests[first:]`): one `layer_end`, or several
    in one `layer_ends`."""
    ends = [worker_pb2.PageLayerEnd(layer=first + i, xxh3_64=d)
            for i, d in enumerate(digests[first:])]
    return (worker_pb2.PageChunk(layer_ends=worker_pb2.PageLayerEnds(ends=ends))
            if len(ends) > 1 else worker_pb2.PageChunk(layer_end=ends[0]))


def _fill(seg: Segment, job: SendJob, layer: int, size: int) -> int:
    """Write layer `layer`'s pages (`size` bytes) into its slot; their XXH3-64."""
    slot = seg.slot(layer % seg.slots, size)
    if job.gather_into is not None:  # straight from a host cache, the GIL released
        out = torch.frombuffer(slot, dtype=torch.uint8).view(job.layout.dtype).view(
            job.layout.layer_shape(len(job.block_ids)))
        # one native call: copy and hash (a slot too large to stay cached: streaming stores)
        got = job.gather_into.digest_into(layer, out, size > STREAM_SLOTS_ABOVE)
        if got is not None:
            return got
        return gather_digest(out, lambda kv, first, o: job.gather_into(layer, kv, first, o),
                             CHUNK if size > FUSE_ABOVE else size)
    pieces = job.views(layer) if job.views is not None else None
    pages = None
    if pieces is None:
        with job.device_context():
            pages = job.gather(layer)
    return _copy_in(slot, pieces, pages)


class _Fallback(TransferBackend):
    """Receives a `shm` request's pages sent by grpc, and remembers the peer as one on
    another node for `GRPC_PEER_S` (its next requests ask for grpc, with no segment)."""

    name = "grpc"

    def __init__(self, shm: ShmBackend) -> None:
        self.shm = shm

    def send(self, job: SendJob) -> AsyncIterator[worker_pb2.PageChunk]:
        raise NotImplementedError

    async def receive(self, request: worker_pb2.PrefillRequest, layout: PageLayout,
                      num_blocks: int, stream: AsyncIterator[worker_pb2.PageChunk],
                      sink: LayerSink) -> None:
        seg = self.shm._segments.get(request.shm_segment)
        if seg is not None:
            self.shm._grpc_peers[seg.peer] = time.monotonic()
        await self.shm._grpc.receive(request, layout, num_blocks, stream, sink)


BACKENDS["auto"] = ShmBackend  # the flag's default: shared memory on one node, else grpc
