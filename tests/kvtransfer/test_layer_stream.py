"""`LayerStream`: what the engine thread reports reaches waiters on the event loop and in
sender threads, in order; a failed run wakes every waiter with an error, never a hang."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tandem.kvtransfer.layer_stream import LayerStream
from tandem.kvtransfer.pages import KVTransferError


def test_waiters_wake_as_the_engine_thread_reports():
    async def main() -> None:
        stream = LayerStream(asyncio.get_running_loop(), num_layers=3)
        gate = threading.Event()
        seen: list[str] = []

        def engine() -> None:  # the engine thread: table, then layers one by one
            stream.begin([7, 8, 9])
            for layer in range(3):
                gate.wait(5)
                gate.clear()
                seen.append(f"done {layer}")
                stream.layer_done(layer, None)

        threading.Thread(target=engine, daemon=True).start()
        assert await asyncio.wait_for(stream.started(), 5) == [7, 8, 9]
        for layer in range(3):
            waiter = asyncio.ensure_future(stream.wait(layer))
            await asyncio.sleep(0.05)
            assert not waiter.done()  # not before the engine reports the layer
            gate.set()
            await asyncio.wait_for(waiter, 5)
            assert seen[-1] == f"done {layer}"
        await stream.wait(0)  # an earlier layer: at once

    asyncio.run(main())


def test_a_failed_run_wakes_every_waiter_with_an_error():
    async def main() -> None:
        stream = LayerStream(asyncio.get_running_loop(), num_layers=4)
        stream.begin([1])
        stream.layer_done(0, None)
        await asyncio.sleep(0)
        await stream.wait(0)
        waiters = [asyncio.ensure_future(stream.wait(layer)) for layer in (1, 3)]
        result: list[BaseException] = []

        def sender() -> None:
            try:
                stream.wait_sync(2, timeout_s=10)
            except KVTransferError as exc:
                result.append(exc)

        thread = threading.Thread(target=sender)
        thread.start()
        await asyncio.sleep(0.05)
        stream.fail("the prompt run ended early")
        for w in waiters:
            with pytest.raises(KVTransferError, match="ended early"):
                await asyncio.wait_for(w, 5)
        thread.join(5)
        assert result and result[0].reason == "incomplete"
        with pytest.raises(KVTransferError):  # later waits fail at once
            await stream.wait(2)
        await stream.wait(0)  # what was reported stays readable

    asyncio.run(main())


def test_fail_after_every_layer_changes_nothing():
    async def main() -> None:
        stream = LayerStream(asyncio.get_running_loop(), num_layers=2)
        stream.begin([3])
        stream.layer_done(0, None)
        stream.layer_done(1, None)
        stream.fail("the run finished")  # the service calls this whenever the run ends
        await stream.wait(1)
        stream.wait_sync(1, timeout_s=0.1)

    asyncio.run(main())


def test_a_sender_thread_waiting_too_long_is_told_so():
    async def main() -> None:
        stream = LayerStream(asyncio.get_running_loop(), num_layers=2)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as err:
            await asyncio.to_thread(stream.wait_sync, 0, 0.2)
        assert err.value.reason == "expired" and time.monotonic() - t0 < 5

    asyncio.run(main())


def test_device_work_needs_no_stream_of_its_own_on_the_cpu():
    """On a GPU the sender reads layers on a stream of its own (so a layer's gather does not
    queue behind later layers); on the CPU there is nothing to switch."""
    import contextlib

    import torch

    from tandem.kvtransfer.base import SendJob
    from tandem.kvtransfer.pages import PageLayout
    from tandem.protocol import worker_pb2

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for device in (None, torch.device("cpu")):
            stream = LayerStream(loop, num_layers=1, device=device)
            assert isinstance(stream.device_context(), contextlib.nullcontext)
            assert stream._side is None
        layout = PageLayout("m", 1, 1, 16, 16, torch.float32)
        job = SendJob(worker_pb2.PrefillRequest(), layout, [0], lambda layer: None, 0.0,
                      layers=stream)
        assert isinstance(job.device_context(), contextlib.nullcontext)
        whole = SendJob(worker_pb2.PrefillRequest(), layout, [0], lambda layer: None, 0.0)
        assert isinstance(whole.device_context(), contextlib.nullcontext)

    asyncio.run(main())
