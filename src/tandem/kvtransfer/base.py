"""The transfer backend interface and its registry.

A transfer always starts with the decode worker's `KVTransfer.Prefill` call to the prefill
worker and that call's reply stream carries the `PageHeader` first and a `PageTrailer` (the
checksum over the layers' digests) last; the backend decides how the page bytes travel in
between:

* `grpc` (`grpc_backend.py`): each layer's `PageData` chunks then its `PageLayerEnd`
  (digest) on the same stream; works between any hosts.
* `torch` (`torch_backend.py`): torch.distributed point-to-point send/recv of one tensor per
  layer in a pair process group (NCCL between GPUs, gloo on CPU); each layer's
  `PageLayerEnd` still comes on the stream.
* `shm` (`shm_backend.py`): through a shared-memory segment the receiver creates, when both
  run on one node; `grpc` otherwise (the header's `transport` says so).

Sender side (prefill worker): `send(job)` yields the stream messages after the header.
Receiver side (decode worker): `configure(...)` once, then per transfer `prepare(request,
peer)` fills the request's backend fields before the call, `receive(..., sink)` hands each
layer to `sink` once its bytes are validated (never before: only checked pages reach the
caller's cache; a `pages.HashingSink` may be handed a layer to write while hashing it, into
blocks nothing reads before the transfer succeeds, and a mismatch fails the transfer) and
returns after the trailer checks and every sink call has finished (or raises
`KVTransferError`), and `release(request)` always ends the transfer, whether or not
`receive` ran or succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.kvtransfer.pages import KVTransferError, LayerSink, PageLayout
from tandem.protocol import worker_pb2

if TYPE_CHECKING:
    from tandem.engine.kv_cache.pages import HostPages
    from tandem.kvtransfer.layer_stream import LayerStream


@dataclass
class SendJob:
    """What a sender streams: `num_blocks` pinned blocks of every layer."""

    request: worker_pb2.PrefillRequest
    layout: PageLayout
    block_ids: list[int]  # the sender's own ids of the blocks to send, chain order
    gather: Callable[[int], torch.Tensor]  # layer -> [2, n, kvh, bs, row] (may block: a copy)
    deadline: float  # loop time at which the lease ends: stop sending
    # layer -> the same bytes as 2n per-block page views (K of each block, then V), read in
    # place from a host-memory cache; None where the cache is not in host memory
    views: Callable[[int], list[memoryview]] | None = None
    # set while the prompt still computes: wait for each layer before reading it
    layers: LayerStream | None = None
    # the pages written into caller buffers straight from a host-memory cache, the GIL
    # released, and a whole layer with its digest (`kv_cache.pages.HostPages`); None
    # elsewhere
    gather_into: HostPages | None = None

    def device_context(self) -> contextlib.AbstractContextManager:
        """Wrap a sender's device work: a stream of its own while the prompt still
        computes on a GPU (`LayerStream.device_context`), else nothing."""
        return contextlib.nullcontext() if self.layers is None else self.layers.device_context()


class TransferBackend(ABC):
    name: str

    def configure(self, *, device: torch.device, advertise_host: str,
                  layout: PageLayout | None = None) -> None:
        """Receiver: where its KV cache lives, the address its peers reach it at, and its
        page layout."""
        return None

    def transport(self, request: worker_pb2.PrefillRequest, layer_bytes: int) -> str:
        """Sender: the backend that carries this request's pages of `layer_bytes` per layer
        (named in the header's `transport` when not this one: e.g. `shm` across nodes sends
        by `grpc`)."""
        return self.name

    def for_transport(self, transport: str) -> TransferBackend:
        """Receiver: the backend that receives pages the header says travel by `transport`
        (the header's, else the request's `backend`, which `prepare` may have changed);
        raises KVTransferError("invalid") for one it did not offer."""
        if transport in ("", self.name):
            return self
        raise KVTransferError("invalid", f"pages offered by {transport[:32]!r}, asked for "
                                         f"{self.name}")

    async def prepare(self, request: worker_pb2.PrefillRequest, peer: str) -> None:
        """Receiver: fill the backend's fields of `request` before calling Prefill on `peer`
        (the prefill worker's host:port)."""
        return None

    @abstractmethod
    def send(self, job: SendJob) -> AsyncIterator[worker_pb2.PageChunk]:
        """Sender: the reply stream's messages after the header, ending with the trailer."""

    @abstractmethod
    async def receive(self, request: worker_pb2.PrefillRequest, layout: PageLayout,
                      num_blocks: int, stream: AsyncIterator[worker_pb2.PageChunk],
                      sink: LayerSink) -> None:
        """Receiver: await `sink(layer, pages)` with every layer's validated `[2,
        num_blocks, kvh, bs, row]` pages; calls start in layer order and may overlap
        (`pages` is valid only until its call completes). Return once the trailer's
        checksum matches and every sink call is done. `stream` is the reply stream after
        the header. On failure, sink calls not yet finished are cancelled; work they handed
        to threads is the sink owner's to wait for."""

    async def release(self, request: worker_pb2.PrefillRequest) -> None:
        """Receiver: the transfer `prepare` set up is over (received, failed or never
        started); free or recycle what it reserved. Must not block: it runs on cancellation."""
        return None

    async def close(self) -> None:
        """Release connections and process groups."""
        return None


class SinkCalls:
    """The sink calls of one `receive` over `slots` reused buffers: a slot is refilled only
    once its last call is done (`slot_free`), all calls are done before a successful
    `receive` returns (`finish`), and a failed one cancels the rest (`abandon`)."""

    def __init__(self, sink: LayerSink, slots: int) -> None:
        self._sink = sink
        self._calls: list[asyncio.Future | None] = [None] * slots

    async def slot_free(self, layer: int) -> int:
        """The slot `layer` fills, once the sink is done with its previous layer."""
        slot = layer % len(self._calls)
        call, self._calls[slot] = self._calls[slot], None
        if call is not None:
            await call
        return slot

    def start(self, layer: int, pages: torch.Tensor) -> None:
        """Hand `layer`'s validated pages (in its slot's buffer) to the sink."""
        self._calls[layer % len(self._calls)] = asyncio.ensure_future(self._sink(layer, pages))

    async def finish(self) -> None:
        await asyncio.gather(*(c for c in self._calls if c is not None))

    def abandon(self) -> None:
        for call in self._calls:
            abandon(call)


def abandon(fut: asyncio.Future | None) -> None:
    """Cancel `fut` unless done; its exception, if any, counts as retrieved."""
    if fut is None:
        return
    fut.cancel()  # a no-op once done
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())


BACKENDS: dict[str, Callable[[], TransferBackend]] = {}


def register_backend(cls: type[TransferBackend]) -> type[TransferBackend]:
    BACKENDS[cls.name] = cls
    return cls


def make_backend(name: str) -> TransferBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose from "
                         f"{sorted(BACKENDS)}")
    return BACKENDS[name]()
