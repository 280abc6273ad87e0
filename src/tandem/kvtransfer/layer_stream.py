"""Layer-by-layer sending: a prefill's pages leave as soon as each layer is written.

A `LayerStream` is the engine's `LayerObserver` for one prompt (`ModelRunner.observe`). The
engine thread reports, during the step that computes the prompt's last tokens, the
request's block table and then every finished layer. Blocks of earlier steps are complete
in every layer by then, and the step's own blocks are complete in layer i once layer i is
done, so a sender may read layer i's pages of any of the request's blocks from then on,
while layers i+1.. still compute.

Waiting works from the event loop (`started`, `wait`) and from a sender thread
(`wait_sync`); `fail` (loop side) wakes every waiter with `KVTransferError` when the prompt
run ends without reporting every layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import torch

from tandem.kvtransfer.pages import KVTransferError


class LayerStream:
    def __init__(self, loop: asyncio.AbstractEventLoop, num_layers: int,
                 device: torch.device | None = None) -> None:
        """`device`: where the KV cache lives (None or CPU: host memory)."""
        self._loop = loop
        self.num_layers = num_layers
        self.device = device
        self._cond = threading.Condition()
        self.block_ids: list[int] | None = None
        self.done = 0  # layers written
        self._events: list[Any | None] = [None] * num_layers
        self.failed: str | None = None
        self._waiters: list[tuple[int, asyncio.Future]] = []  # (layers needed; -1: begun)
        self._side: Any = None  # a CUDA stream of the sender's own, made on first use

    def device_context(self) -> contextlib.AbstractContextManager:
        """Where a sender does its device work (gather, copy out, NCCL send) for this
        prompt: on a GPU, a stream of its own, so reading layer i does not queue behind
        the later layers the engine has queued on its stream since (`wait` has seen layer
        i's event complete by then); on the CPU, nothing."""
        if self.device is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return torch.cuda.stream(self._side)

    # -- engine thread (LayerObserver) -----------------------------------------------------
    def begin(self, block_ids: list[int]) -> None:
        with self._cond:
            self.block_ids = block_ids
            self._cond.notify_all()
        self._wake_loop()

    def layer_done(self, layer: int, event: Any | None) -> None:
        with self._cond:
            self._events[layer] = event
            self.done = layer + 1
            self._cond.notify_all()
        self._wake_loop()

    def _wake_loop(self) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop has nobody waiting
            self._loop.call_soon_threadsafe(self._wake)

    # -- event loop ------------------------------------------------------------------------
    def fail(self, why: str) -> None:
        """The prompt run ended without every layer (an error, an abort): wake all waiters."""
        with self._cond:
            if self.done < self.num_layers and self.failed is None:
                self.failed = why
            self._cond.notify_all()
        self._wake()

    def _ready(self, need: int) -> bool:
        return self.block_ids is not None if need < 0 else self.done >= need

    def _wake(self) -> None:
        keep = []
        for need, fut in self._waiters:
            if fut.done():
                continue
            if self._ready(need):
                fut.set_result(None)
            elif self.failed is not None:
                fut.set_exception(KVTransferError("incomplete", self.failed))
            else:
                keep.append((need, fut))
        self._waiters = keep

    async def _until(self, need: int) -> None:
        if self._ready(need):
            return
        if self.failed is not None:
            raise KVTransferError("incomplete", self.failed)
        fut = self._loop.create_future()
        self._waiters.append((need, fut))
        await fut

    async def started(self) -> list[int]:
        """The request's block table, once its last prompt step has begun."""
        await self._until(-1)
        return self.block_ids  # type: ignore[return-value]

    async def wait(self, layer: int) -> None:
        """Until `layer`'s pages can be read (on a GPU: its event has completed)."""
        await self._until(layer + 1)
        event = self._events[layer]
        if event is not None and not event.query():
            await asyncio.to_thread(event.synchronize)

    # -- a sender thread -------------------------------------------------------------------
    def wait_sync(self, layer: int, timeout_s: float) -> None:
        """Blocking `wait`; raises `KVTransferError` on failure or after `timeout_s`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done > layer or self.failed is not None,
                                       timeout_s):
                raise KVTransferError("expired", f"layer {layer} was not computed in time")
            if self.done <= layer:
                raise KVTransferError("incomplete", self.failed or "the prompt run failed")
            event = self._events[layer]
        if event is not None:
            event.synchronize()
