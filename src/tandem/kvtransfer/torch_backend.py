"""`torch` backend: page tensors travel by torch.distributed point-to-point send/recv in a
pair process group (NCCL when the receiver's KV cache is on CUDA, gloo otherwise); the
header, each layer's `PageLayerEnd` (its digest) and the trailer stay on the Prefill
stream. The receiver checks each layer against its digest and hands it on while the next
one arrives, in two reused buffers.

Groups are built on demand, never through `init_process_group`: the receiver (decode worker,
rank 1) hosts a `TCPStore` per group on a free port and advertises `advertise_host`; the
sender (prefill worker, rank 0) joins on its first transfer with that `group_id`. A group
carries one transfer at a time (NCCL has no tags): the receiver leases it in `prepare` and,
in `release`, recycles it for the same peer after a clean transfer or discards it. Any
failure, timeout or cancellation discards the group on that side, which closes its
connections, so the other side fails fast and discards its copy; a discarded `group_id` is
never joined again. Idle groups close after `idle_s` (the sender waits twice as long, so a
receiver never picks a group its sender dropped). Every store connect, rendezvous and
per-layer send/recv is bounded by `timeout_s`. Per layer the wire carries the contiguous
`[2, n, kvh, bs, row]` pages as one flat uint8 tensor (whatever the cache dtype: a quantized
cache's codes and scales alike) under the transfer's tag.

Trust: torch's store and the gloo/NCCL sockets have no authentication of their own (mTLS
covers only gRPC). What this backend adds: the receiver's store listens only on the address
it advertises (not every interface), and each group's rendezvous keys sit under its
`group_id`, 122 random bits that travel only on the (mTLS-capable) gRPC stream, so a
client of the store that did not see that stream can neither read the ranks' addresses nor
plant its own. Still use a private network: a peer sending more bytes than the header
promised aborts the receiving process (gloo enforces it).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.engine.parallel.comm import host_store
from tandem.kvtransfer.base import (
    SendJob,
    SinkCalls,
    TransferBackend,
    abandon,
    register_backend,
)
from tandem.kvtransfer.pages import (
    KVTransferError,
    LayerSink,
    PageChecksum,
    PageLayout,
    tensor_bytes,
    transfer_digest,
)
from tandem.protocol import worker_pb2

logger = logging.getLogger(__name__)
SENDER, RECEIVER = 0, 1
GROUP_ID = re.compile(r"(gloo|nccl)-[0-9a-f]{32}")
MAX_TAG = (1 << 31) - 1  # gloo tags are C ints


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass(eq=False)
class _Pair:
    """One side of a pair process group. Blocking methods run on the backend's threads."""

    group_id: str
    device: torch.device = torch.device("cpu")  # receiver: where recv buffers live
    store: Any = None  # TCPStore (the master on the receiver); the group holds it too
    pg: Any = None  # ProcessGroupGloo | ProcessGroupNCCL once joined
    peer: str = ""  # receiver: the prefill worker's host:port
    tag: int = 0  # receiver: the leased transfer's tag
    clean: bool = False  # receiver: the leased transfer completed
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # sender: one transfer at a time

    @property
    def nccl(self) -> bool:
        return self.group_id.startswith("nccl-")

    def join(self, rank: int, timeout_s: float) -> None:
        """This rank's group (gloo connects both ranks here, NCCL on first use); its
        rendezvous keys are under the secret `group_id`."""
        store = dist.PrefixStore(self.group_id, self.store)
        if self.nccl:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(timeout_s)
            self.pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, 2, _td(timeout_s))

    def post(self, op: str, flat: torch.Tensor, peer: int, tag: int) -> Any:
        """Start `op` ("send" | "recv") of the 1-D `flat`; its Work."""
        if self.pg is None:
            raise KVTransferError("unavailable", "the process group was closed")
        return getattr(self.pg, op)([flat], peer, tag)

    def wait(self, work: Any, timeout_s: float) -> None:
        """`work` done within `timeout_s`, or raise (gloo then closes the pair; an NCCL group
        is aborted)."""
        if not self.nccl:
            work.wait(_td(timeout_s))
            return
        end = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > end:
                self.drop()
                raise TimeoutError(f"NCCL transfer timed out after {timeout_s:g} s")
            time.sleep(0.0002)
        work.wait()

    def drop(self) -> None:
        """Destroy the group once no thread uses it (its connections close)."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None and self.nccl:
            with contextlib.suppress(Exception):  # already aborted or broken
                pg.abort()  # unlike shutdown, never waits for a stuck operation


def _failure(exc: BaseException, what: str) -> KVTransferError:
    if isinstance(exc, KVTransferError):
        return exc
    text = (str(exc) or type(exc).__name__).splitlines()[0]
    reason = "timeout" if re.search("timed out|timeout", text, re.I) else "unavailable"
    return KVTransferError(reason, f"torch.distributed {what} failed: {text}")


@register_backend
class TorchBackend(TransferBackend):
    name = "torch"

    def __init__(self, timeout_s: float = 30.0, idle_s: float = 60.0,
                 max_threads: int = 16) -> None:
        self.timeout_s, self.idle_s = timeout_s, idle_s
        self.advertise_host, self.device = "127.0.0.1", torch.device("cpu")
        self._max_threads = max_threads
        self._executor: ThreadPoolExecutor | None = None
        self._idle: dict[str, list[_Pair]] = {}  # receiver: peer -> recyclable groups
        self._leased: dict[str, _Pair] = {}  # receiver: group_id -> group in a transfer
        self._joined: dict[str, asyncio.Future] = {}  # sender: group_id -> joined _Pair
        self._closed: OrderedDict[str, None] = OrderedDict()  # sender: never join again
        self._tags = itertools.count(1)
        self._sweeper: asyncio.Task | None = None

    def configure(self, *, device: torch.device, advertise_host: str,
                  layout: PageLayout | None = None) -> None:
        self.device, self.advertise_host = torch.device(device), advertise_host

    async def _run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on this backend's threads (blocking torch.distributed calls)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._max_threads, "kv-torch")
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _discard(self, pair: _Pair) -> None:
        """Forget `pair` now; its group dies when no thread uses it any more."""
        self._leased.pop(pair.group_id, None)
        if self._joined.pop(pair.group_id, None) is not None:
            self._closed[pair.group_id] = None
            while len(self._closed) > 4096:
                self._closed.popitem(last=False)
        if self._executor is not None:
            self._executor.submit(pair.drop)  # destructors may block: off the loop
        else:
            pair.drop()

    def _joined_pairs(self) -> list[_Pair]:
        return [f.result() for f in self._joined.values()
                if f.done() and not f.cancelled() and f.exception() is None]

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.idle_s / 4))
            now = time.monotonic()
            for peer, pairs in list(self._idle.items()):
                for p in [p for p in pairs if now - p.last_used > self.idle_s]:
                    pairs.remove(p)
                    self._discard(p)
                if not pairs:
                    del self._idle[peer]
            for p in self._joined_pairs():
                if not p.lock.locked() and now - p.last_used > 2 * self.idle_s:
                    self._discard(p)

    # -- receiver ------------------------------------------------------------------------------
    async def prepare(self, request: worker_pb2.PrefillRequest, peer: str) -> None:
        """Lease an idle group with `peer` or host a new one; fill `request.torch`."""
        pairs = self._idle.get(peer)
        if pairs:
            pair = pairs.pop()
        else:
            nccl = self.device.type == "cuda" and dist.is_nccl_available()
            pair = _Pair(f"{'nccl' if nccl else 'gloo'}-{uuid.uuid4().hex}",
                         self.device if nccl else torch.device("cpu"), peer=peer)
            try:
                pair.store = await self._run(lambda: host_store(self.advertise_host,
                                                                 self.timeout_s))
            except Exception as exc:
                raise _failure(exc, "store setup") from exc
        pair.tag, pair.clean = next(self._tags) % MAX_TAG + 1, False
        self._leased[pair.group_id] = pair
        request.torch.CopyFrom(worker_pb2.TorchChannel(
            store_host=self.advertise_host, store_port=pair.store.port,
            group_id=pair.group_id, tag=pair.tag))

    async def receive(self, request: worker_pb2.PrefillRequest, layout: PageLayout,
                      num_blocks: int, stream: AsyncIterator[worker_pb2.PageChunk],
                      sink: LayerSink) -> None:
        """Per layer: recv its bytes (a thread), hash them, read its `PageLayerEnd` from the
        stream; when the digests match, hand the layer to `sink` while the next one is
        received (two buffers, reused). Then the trailer. Fails as soon as the stream fails,
        ends early or says something else."""
        pair = self._leased.get(request.torch.group_id)
        if pair is None or pair.tag != request.torch.tag or pair.store is None:
            raise KVTransferError("invalid", "this transfer was not prepared here")
        nbytes = num_blocks * layout.block_layer_bytes
        shape = layout.layer_shape(num_blocks)
        slots = [torch.empty(nbytes, dtype=torch.uint8, device=pair.device)
                 for _ in range(min(2, layout.num_layers))]
        calls = SinkCalls(sink, len(slots))
        digests: list[int] = []
        msg = asyncio.ensure_future(_next(stream))
        recv: asyncio.Future | None = None

        async def post(layer: int) -> asyncio.Future:  # the recv of `layer`, once its slot is free
            slot = await calls.slot_free(layer)
            return asyncio.ensure_future(self._run(self._recv_layer, pair, slots[slot]))

        try:
            recv = await post(0)
            for layer in range(layout.num_layers):
                await asyncio.wait((recv, msg), return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():  # the stream spoke first: only this layer's end is fine
                    _expect_layer_end(msg.result(), layer)
                try:
                    pages, digest = await recv
                except Exception as exc:
                    raise _failure(exc, "recv") from exc
                if layer + 1 < layout.num_layers:  # the sender goes on while we check this one
                    recv = await post(layer + 1)
                end = _expect_layer_end(await msg, layer)
                if end.xxh3_64 != digest:
                    raise KVTransferError("invalid", f"page checksum mismatch in layer {layer}")
                digests.append(digest)
                calls.start(layer, pages.view(layout.dtype).view(shape))
                msg = asyncio.ensure_future(_next(stream))
            trailer = _expect_trailer(await msg)
            if trailer.xxh3_64 != transfer_digest(digests):
                raise KVTransferError("invalid", "page checksum mismatch")
            await calls.finish()
        finally:  # on failure nothing goes on (a recv thread ends with the discarded group)
            abandon(recv)
            abandon(msg)
            calls.abandon()
        pair.clean, pair.last_used = True, time.monotonic()

    def _recv_layer(self, pair: _Pair, buf: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Blocking: join if new, then one layer's bytes into `buf`; (those bytes on the CPU,
        their digest)."""
        if pair.pg is None and pair.store is not None:
            pair.join(RECEIVER, self.timeout_s)
        pair.wait(pair.post("recv", buf, SENDER, pair.tag), self.timeout_s)
        host = buf.cpu()
        return host, PageChecksum().update(tensor_bytes(host)).digest()

    async def release(self, request: worker_pb2.PrefillRequest) -> None:
        pair = self._leased.pop(request.torch.group_id, None)
        if pair is not None and pair.clean:
            self._idle.setdefault(pair.peer, []).append(pair)
        elif pair is not None:
            self._discard(pair)

    # -- sender --------------------------------------------------------------------------------
    async def send(self, job: SendJob) -> AsyncIterator[worker_pb2.PageChunk]:
        """Every layer from a sender thread; each layer's `PageLayerEnd` goes on the stream
        as soon as the thread has posted and hashed it, then the trailer."""
        ch = job.request.torch
        if not (GROUP_ID.fullmatch(ch.group_id) and 0 < ch.store_port < 65536
                and 0 < len(ch.store_host) <= 255 and 0 < ch.tag <= MAX_TAG):
            raise KVTransferError("invalid", "the request's torch channel is malformed")
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + job.deadline - loop.time()
        pair = await self._sender_pair(ch)
        ends: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

        def report(layer: int, digest: int) -> None:  # from the sender thread
            loop.call_soon_threadsafe(ends.put_nowait, (layer, digest))

        work: asyncio.Future | None = None
        digests: list[int] = []
        try:
            async with pair.lock:
                work = asyncio.ensure_future(
                    self._run(self._send_all, pair, job, ch.tag, deadline, report))
                for _ in range(job.layout.num_layers):
                    got = asyncio.ensure_future(ends.get())
                    try:
                        await asyncio.wait((got, work), return_when=asyncio.FIRST_COMPLETED)
                        if not got.done():  # it ended first: it failed (raised here), or its
                            await work      # last report is already queued for `got`
                        layer, digest = await got
                    except BaseException:
                        abandon(got)
                        raise
                    digests.append(digest)
                    yield worker_pb2.PageChunk(layer_end=worker_pb2.PageLayerEnd(
                        layer=layer, xxh3_64=digest))
                await work
                pair.last_used = time.monotonic()
        except BaseException as exc:
            self._discard(pair)
            abandon(work)
            if isinstance(exc, Exception):
                raise _failure(exc, "send") from exc
            raise
        yield worker_pb2.PageChunk(trailer=worker_pb2.PageTrailer(
            xxh3_64=transfer_digest(digests)))

    async def _sender_pair(self, ch: worker_pb2.TorchChannel) -> _Pair:
        if ch.group_id in self._closed:
            raise KVTransferError("invalid", f"process group {ch.group_id} was closed")
        fut = self._joined.get(ch.group_id)
        if fut is None:
            fut = asyncio.ensure_future(self._run(self._connect, _Pair(ch.group_id), ch))
            self._joined[ch.group_id] = fut
        try:
            return await asyncio.shield(fut)
        except Exception as exc:
            if self._joined.get(ch.group_id) is fut:
                del self._joined[ch.group_id]
                self._closed[ch.group_id] = None
            raise _failure(exc, "group setup") from exc

    def _connect(self, pair: _Pair, ch: worker_pb2.TorchChannel) -> _Pair:
        """Blocking: join the receiver's group as the sender."""
        if pair.nccl and not torch.cuda.is_available():
            raise KVTransferError("invalid", "an NCCL group needs CUDA on this worker")
        pair.store = dist.TCPStore(ch.store_host, ch.store_port, None, False,
                                   _td(self.timeout_s))
        pair.join(SENDER, self.timeout_s)
        return pair

    def _send_all(self, pair: _Pair, job: SendJob, tag: int, deadline: float,
                  report: Callable[[int, int], None]) -> None:
        """Blocking: gather and send every layer in order, `report`ing each one's digest once
        it is on its way. Over gloo the next layer is assembled while this one travels (two
        layers' bytes in host memory at most); over NCCL one layer at a time (GPU memory)."""
        num_layers = job.layout.num_layers
        ahead = not pair.nccl

        def prepare(layer: int) -> torch.Tensor:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError("expired", "the lease ended before the pages were sent")
            if job.layers is not None:  # still computing: wait for this layer
                job.layers.wait_sync(layer, left)
            with job.device_context():
                return self._layer_tensor(job, layer, pair.nccl)

        flat = prepare(0)
        for layer in range(num_layers):
            last = layer + 1 == num_layers
            with job.device_context():
                work = pair.post("send", flat, RECEIVER, tag)
                # hashed while the bytes travel
                report(layer, PageChecksum().update(tensor_bytes(flat.cpu())).digest())
            nxt = prepare(layer + 1) if ahead and not last else None
            try:  # (a zero timeout would mean none to gloo)
                pair.wait(work, min(self.timeout_s, max(deadline - time.monotonic(), 1e-3)))
            except Exception as exc:
                if time.monotonic() >= deadline:
                    raise KVTransferError("expired", "the lease ended before the pages "
                                                     "were sent") from exc
                raise
            if not last:
                flat = nxt if nxt is not None else prepare(layer + 1)

    @staticmethod
    def _layer_tensor(job: SendJob, layer: int, nccl: bool) -> torch.Tensor:
        """`layer`'s `[2, n, kvh, bs, row]` pages as one flat uint8 tensor where the pair's
        group sends from: from a host cache over gloo, its page views joined (one copy at
        memory speed: ~0.05 CPU s/GB against ~0.25 for a gathering `index_select`); else
        gathered (and moved to the GPU for NCCL)."""
        views = job.views(layer) if job.views is not None and not nccl else None
        if views:
            return torch.frombuffer(bytearray().join(views), dtype=torch.uint8)
        pages = job.gather(layer).contiguous()
        if not nccl:
            pages = pages.cpu()
        elif not pages.is_cuda:
            pages = pages.to(torch.device("cuda", torch.cuda.current_device()))
        return pages.view(-1).view(torch.uint8)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        pairs = [*(p for ps in self._idle.values() for p in ps), *self._leased.values(),
                 *self._joined_pairs()]
        for fut in self._joined.values():
            fut.cancel()  # a no-op once done
        self._idle, self._leased, self._joined = {}, {}, {}
        for p in pairs:
            p.drop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


async def _next(stream: AsyncIterator[Any]) -> Any:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


def _expect_layer_end(msg: Any, layer: int) -> worker_pb2.PageLayerEnd:
    if msg is None:
        raise KVTransferError("incomplete", f"the page stream ended before layer {layer}'s end")
    if (not isinstance(msg, worker_pb2.PageChunk) or msg.WhichOneof("kind") != "layer_end"
            or msg.layer_end.layer != layer):
        raise KVTransferError("invalid", f"expected layer {layer}'s end on a torch transfer's "
                                         f"stream")
    return msg.layer_end


def _expect_trailer(msg: Any) -> worker_pb2.PageTrailer:
    if msg is None:
        raise KVTransferError("incomplete", "the page stream ended before its trailer")
    if not isinstance(msg, worker_pb2.PageChunk) or msg.WhichOneof("kind") != "trailer":
        raise KVTransferError("invalid", "unexpected message on a torch transfer's stream")
    return msg.trailer
