"""The `torch` transfer backend over real gloo pair groups between two backends in one
process (receiver = decode side, sender = prefill side; the Prefill stream is a queue):
pages arrive bit-identical, bad or missing trailers and dead peers raise `KVTransferError`
within bounded time, groups are recycled after clean transfers and discarded after failures.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import pytest
import torch
import torch.distributed as dist

from tandem.engine.kv_cache.pages import gather_layer
from tandem.kvtransfer import BACKENDS, KVTransferError, PageLayout
from tandem.kvtransfer.base import SendJob
from tandem.kvtransfer.pages import layer_page_views, tensor_bytes
from tandem.kvtransfer.torch_backend import TorchBackend
from tandem.protocol import worker_pb2

LAYOUT = PageLayout("m", num_layers=3, num_kv_heads=2, block_size=4, head_dim=8,
                    dtype=torch.float32)
PEER = "prefill:1"


def random_pages(layout: PageLayout, n: int, seed: int) -> list[torch.Tensor]:
    """Random bytes (NaN and denormal patterns included) in each layer's page shape."""
    g = torch.Generator().manual_seed(seed)
    nbytes = n * layout.block_layer_bytes
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
            .view(layout.dtype).view(layout.layer_shape(n)) for _ in range(layout.num_layers)]


def pipe(sender: TorchBackend, job: SendJob,
         edit: Callable[[worker_pb2.PageChunk], object | None] = lambda c: c,
         errors: list[Exception] | None = None) -> AsyncIterator[object]:
    """The reply stream after the header: what `sender.send(job)` yields, through `edit`
    (None drops a message); a sender failure ends the stream with its exception (and is
    appended to `errors`). The sender runs at once, as a gRPC server would."""
    queue: asyncio.Queue = asyncio.Queue()

    async def produce() -> None:
        try:
            async for chunk in sender.send(job):
                out = edit(chunk)
                if out is not None:
                    queue.put_nowait(out)
            queue.put_nowait(StopAsyncIteration())
        except Exception as exc:  # noqa: BLE001 - handed to the receiver, like a gRPC status
            if errors is not None:
                errors.append(exc)
            queue.put_nowait(exc)

    async def consume() -> AsyncIterator[object]:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, StopAsyncIteration):
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            task.cancel()

    task = asyncio.ensure_future(produce())
    return consume()


async def transfer(receiver: TorchBackend, sender: TorchBackend, pages: list[torch.Tensor],
                   edit=lambda c: c, layout: PageLayout = LAYOUT, lease_s: float = 30.0,
                   gather: Callable[[int], torch.Tensor] | None = None,
                   views: Callable[[int], list[memoryview] | None] | None = None,
                   errors: list[Exception] | None = None,
                   prepared: Callable[[worker_pb2.PrefillRequest], object] = lambda r: None,
                   ) -> tuple[list[torch.Tensor], str]:
    """One transfer as client.fetch drives it; (received pages, the group id used).
    `prepared` sees the request once the receiver has filled in its channel."""
    n = pages[0].shape[1]
    req = worker_pb2.PrefillRequest(request_id="t", num_blocks=n, backend="torch")
    await receiver.prepare(req, PEER)
    prepared(req)
    try:
        wire = worker_pb2.PrefillRequest.FromString(req.SerializeToString())
        job = SendJob(wire, layout, list(range(n)), gather or (lambda layer: pages[layer]),
                      asyncio.get_running_loop().time() + lease_s, views)
        started: list[int] = []
        written: dict[int, torch.Tensor] = {}

        async def sink(layer: int, layer_pages: torch.Tensor) -> None:
            started.append(layer)  # calls start in layer order (and may overlap)
            await asyncio.sleep(0.005)  # a slow write: the receiver must not reuse its buffer
            written[layer] = layer_pages.clone()

        await receiver.receive(req, layout, n, pipe(sender, job, edit, errors), sink)
        assert started == list(range(layout.num_layers)) == sorted(written)
        got = [written[layer] for layer in started]
    finally:
        await receiver.release(req)
    return got, req.torch.group_id


def run(coro_fn: Callable[[TorchBackend, TorchBackend], object], timeout_s: float = 5.0):
    async def main():
        receiver, sender = TorchBackend(timeout_s=timeout_s), TorchBackend(timeout_s=timeout_s)
        try:
            return await coro_fn(receiver, sender)
        finally:
            await receiver.close()
            await sender.close()
    return asyncio.run(main())


def test_a_host_cache_is_sent_from_its_page_views():
    """A host cache's layers go out joined from its page views (no gather), scattered block
    ids in chain order: the receiver gets exactly what gathering them would give; a layer
    without views (None) is gathered."""
    layout = PageLayout("m", 4, 2, 4, 8, torch.float32)
    g = torch.Generator().manual_seed(7)
    caches = [tuple(torch.randn(12, 2, 4, 8, generator=g) for _ in range(2))
              for _ in range(layout.num_layers)]
    ids = [9, 2, 11, 0, 5]
    want = [gather_layer(caches, layer, ids) for layer in range(layout.num_layers)]
    gathered: list[int] = []

    def gather(layer: int) -> torch.Tensor:
        gathered.append(layer)
        return gather_layer(caches, layer, ids)

    def views(layer: int) -> list[memoryview] | None:
        return None if layer == 2 else layer_page_views(caches, layer, ids)

    async def body(receiver, sender):
        return await transfer(receiver, sender, want, layout=layout, gather=gather,
                              views=views)

    got, _ = run(body)
    assert gathered == [2]
    for w, h in zip(want, got, strict=True):
        assert bytes(tensor_bytes(h)) == bytes(tensor_bytes(w))


def test_registered():
    assert BACKENDS["torch"] is TorchBackend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_arrive_bit_identical_and_the_group_is_reused(dtype):
    layout = PageLayout("m", 3, 2, 4, 8, dtype)

    async def body(receiver, sender):
        groups = set()
        for seed, n in enumerate((1, 3, 17)):
            pages = random_pages(layout, n, seed)
            got, gid = await transfer(receiver, sender, pages, layout=layout)
            groups.add(gid)
            assert len(got) == layout.num_layers
            for want, have in zip(pages, got, strict=True):
                assert have.shape == layout.layer_shape(n) and have.dtype == dtype
                assert have.device.type == "cpu"
                assert bytes(tensor_bytes(have)) == bytes(tensor_bytes(want))
        assert len(groups) == 1  # one pair group carried every transfer
    run(body)


def test_concurrent_transfers_with_one_peer_use_separate_groups():
    async def body(receiver, sender):
        sets = [random_pages(LAYOUT, n, 10 + n) for n in (2, 5, 9)]
        results = await asyncio.gather(*(transfer(receiver, sender, p) for p in sets))
        assert len({gid for _, gid in results}) == 3
        for pages, (got, _) in zip(sets, results, strict=True):
            for want, have in zip(pages, got, strict=True):
                assert bytes(tensor_bytes(have)) == bytes(tensor_bytes(want))
        # afterwards all three are idle and get reused
        again = await asyncio.gather(*(transfer(receiver, sender, p) for p in sets))
        assert {gid for _, gid in again} == {gid for _, gid in results}
    run(body)


def bad_checksum(chunk):
    if chunk.WhichOneof("kind") == "trailer":
        return worker_pb2.PageChunk(trailer=worker_pb2.PageTrailer(
            xxh3_64=chunk.trailer.xxh3_64 ^ 1))
    return chunk


@pytest.mark.parametrize("edit,reason", [
    (bad_checksum, "invalid"),
    # no trailer: the stream ends after the last layer's end
    (lambda c: None if c.WhichOneof("kind") == "trailer" else c, "incomplete"),
    (lambda c: worker_pb2.PageChunk(layer_end=worker_pb2.PageLayerEnd(
        layer=c.layer_end.layer, xxh3_64=c.layer_end.xxh3_64 ^ 1))
     if c.WhichOneof("kind") == "layer_end" else c, "invalid"),  # a layer's bad digest
    (lambda c: worker_pb2.PageChunk(data=worker_pb2.PageData(layer=0, offset=0, data=b"x")),
     "invalid"),
])
def test_a_bad_or_missing_trailer_is_rejected_and_the_group_replaced(edit, reason):
    async def body(receiver, sender):
        pages = random_pages(LAYOUT, 4, 1)
        with pytest.raises(KVTransferError) as err:
            await transfer(receiver, sender, pages, edit)
        assert err.value.reason == reason
        _, first = await transfer(receiver, sender, pages)
        _, second = await transfer(receiver, sender, pages)
        assert first == second  # a fresh group after the failure, then reused
    run(body)


def test_a_sender_that_dies_mid_transfer_fails_the_receiver_fast():
    pages = random_pages(LAYOUT, 6, 2)

    def gather(layer: int) -> torch.Tensor:
        if layer == 1:
            raise RuntimeError("engine gone")
        return pages[layer]

    async def body(receiver, sender):
        t0 = time.monotonic()
        with pytest.raises((KVTransferError, RuntimeError)):
            await transfer(receiver, sender, pages, gather=gather)
        assert time.monotonic() - t0 < 10  # not the 20 s operation timeout
        got, _ = await transfer(receiver, sender, pages)  # a new group works
        assert bytes(tensor_bytes(got[2])) == bytes(tensor_bytes(pages[2]))
    run(body, timeout_s=20)


async def _never_called(layer: int, pages: torch.Tensor) -> None:
    raise AssertionError("no page may reach the sink")


def test_a_sender_that_never_joins_times_out():
    async def body(receiver, _sender):
        req = worker_pb2.PrefillRequest(num_blocks=2, backend="torch")
        await receiver.prepare(req, PEER)

        async def silent():
            await asyncio.sleep(60)
            yield None

        t0 = time.monotonic()
        try:
            with pytest.raises(KVTransferError) as err:
                await receiver.receive(req, LAYOUT, 2, silent(), _never_called)
        finally:
            await receiver.release(req)
        assert err.value.reason in ("timeout", "unavailable")
        assert time.monotonic() - t0 < 10
        assert not receiver._leased and not receiver._idle  # discarded
    run(body, timeout_s=1.0)


def test_an_expired_lease_stops_the_sender():
    async def body(receiver, sender):
        errors: list[Exception] = []
        with pytest.raises(KVTransferError):
            await transfer(receiver, sender, random_pages(LAYOUT, 2, 3), lease_s=-1,
                           errors=errors)
        assert [getattr(e, "reason", None) for e in errors] == ["expired"]
    run(body)


def test_the_sender_rejects_malformed_and_closed_channels():
    async def body(_receiver, sender):
        pages = random_pages(LAYOUT, 1, 4)
        for ch in (worker_pb2.TorchChannel(),
                   worker_pb2.TorchChannel(store_host="127.0.0.1", store_port=1,
                                           group_id="gloo-x", tag=1),
                   worker_pb2.TorchChannel(store_host="127.0.0.1", store_port=1,
                                           group_id="gloo-" + "0" * 32, tag=1 << 31)):
            job = SendJob(worker_pb2.PrefillRequest(torch=ch), LAYOUT, [0],
                          lambda layer: pages[layer], asyncio.get_running_loop().time() + 5)
            with pytest.raises(KVTransferError) as err:
                [c async for c in sender.send(job)]
            assert err.value.reason == "invalid"
        sender._closed["gloo-" + "1" * 32] = None
        ch = worker_pb2.TorchChannel(store_host="127.0.0.1", store_port=1,
                                     group_id="gloo-" + "1" * 32, tag=1)
        job = SendJob(worker_pb2.PrefillRequest(torch=ch), LAYOUT, [0],
                      lambda layer: pages[layer], asyncio.get_running_loop().time() + 5)
        with pytest.raises(KVTransferError, match="closed"):
            [c async for c in sender.send(job)]
    run(body)


def test_idle_groups_are_closed():
    async def body(receiver, sender):
        receiver.idle_s = sender.idle_s = 0.2
        await transfer(receiver, sender, random_pages(LAYOUT, 1, 5))
        assert receiver._idle and sender._joined
        async with asyncio.timeout(10):  # closed once idle past 0.2 s (a sweep's delay more)
            while receiver._idle or sender._joined:
                await asyncio.sleep(0.05)
    run(body)


def test_a_transfer_released_unreceived_frees_its_sender():
    """The receiver rejected the header (so never received): release discards the group and
    the sender, stuck joining it, fails well before its timeout."""
    async def body(receiver, sender):
        pages = random_pages(LAYOUT, 2, 6)
        req = worker_pb2.PrefillRequest(num_blocks=2, backend="torch")
        await receiver.prepare(req, PEER)
        job = SendJob(worker_pb2.PrefillRequest.FromString(req.SerializeToString()), LAYOUT,
                      [0, 1], lambda layer: pages[layer], asyncio.get_running_loop().time() + 30)
        sending = asyncio.ensure_future(anext(sender.send(job)))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await receiver.release(req)
        with pytest.raises(KVTransferError):
            await sending
        assert time.monotonic() - t0 < 10
        assert not receiver._leased and not receiver._idle
    run(body, timeout_s=20)


def test_the_store_listens_only_on_the_advertised_address():
    async def body(receiver, sender):
        req = worker_pb2.PrefillRequest(request_id="t", num_blocks=1, backend="torch")
        await receiver.prepare(req, PEER)
        try:
            assert req.torch.store_host == "127.0.0.1"
            socket.create_connection(("127.0.0.1", req.torch.store_port), timeout=5).close()
            with pytest.raises(ConnectionRefusedError):  # another loopback address
                socket.create_connection(("127.0.0.2", req.torch.store_port), timeout=5)
        finally:
            await receiver.release(req)
    run(body)


def test_a_store_client_without_the_group_id_cannot_take_a_rank():
    """Someone who reaches the store but did not see the Prefill stream (so not the group
    id) tries to join as the receiver's rank before it does: they meet nobody (their join
    fails), and the real transfer still goes through, bit-identical. Without the group id
    as a key prefix the intruder and the sender pair up, and the transfer fails."""
    pages = random_pages(LAYOUT, 4, 3)
    joined: list[object] = []

    def intrude(req: worker_pb2.PrefillRequest) -> threading.Thread:
        def run_intruder() -> None:
            try:
                store = dist.TCPStore(req.torch.store_host, req.torch.store_port, None, False,
                                      datetime.timedelta(seconds=5))
                pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=2))
                joined.append(pg)
            except Exception as exc:  # noqa: BLE001 - the expected outcome
                joined.append(exc)
        t = threading.Thread(target=run_intruder, daemon=True)
        t.start()
        threads.append(t)
        return t

    threads: list[threading.Thread] = []

    async def body(receiver, sender):
        await asyncio.sleep(0)
        got, _ = await transfer(receiver, sender, pages, prepared=intrude)
        assert [bytes(tensor_bytes(g)) for g in got] == [bytes(tensor_bytes(p))
                                                         for p in pages]
    run(body, timeout_s=10.0)
    for t in threads:
        t.join(15)
    assert len(joined) == 1 and isinstance(joined[0], Exception), joined
