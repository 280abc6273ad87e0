"""The `shm` backend's page path: exact pages through a real shared-memory segment (read in
place or gathered, any sink speed), at most two layers mapped on the receiver, a damaged slot
rejected before the sink sees it, the grpc fallback across nodes, and no segment left behind
by a failed transfer or a killed receiver (after the node's sweep)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import pytest
import torch
import xxhash

from tandem import SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache.pages import (
    HostPages,
    gather_layer,
    host_pages_into,
    scatter_layer,
    scatter_layer_digest,
    scatter_targets,
)
from tandem.engine.llm_engine import LLMEngine
from tandem.kvtransfer import shm_backend, shm_segments
from tandem.kvtransfer.base import SendJob
from tandem.kvtransfer.client import RemotePrefill, RemotePrefillSettings, prefill_method
from tandem.kvtransfer.grpc_backend import decode_chunk, serialize_chunk
from tandem.kvtransfer.pages import KVTransferError, PageLayout, layer_page_views
from tandem.kvtransfer.shm_backend import IDLE_PER_PEER, ShmBackend, slots_for
from tandem.kvtransfer.shm_segments import (
    CONTROL_BYTES,
    PREFIX,
    SHM_DIR,
    Instance,
    node_identity,
    open_segment,
    sweep,
)
from tandem.protocol import worker_pb2
from tests.engine.utils import make_tiny_model_dir
from tests.kvtransfer.fake_prefill import LAYOUT as FAKE_LAYOUT
from tests.serving.helpers import free_port

REPO = Path(__file__).resolve().parents[2]

KVH, BS, HD, LAYERS, BLOCKS = 2, 4, 8, 5, 16


def caches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BLOCKS, KVH, BS, HD, generator=g),
             torch.randn(BLOCKS, KVH, BS, HD, generator=g)) for _ in range(LAYERS)]


@pytest.fixture(autouse=True, scope="module")
def own_shm_dir():
    """This module's segments in a directory of their own (on the same shared-memory
    filesystem, so the node identity is the same), inherited by the processes it starts:
    test files running beside it (P/D and peer-pull tests, whose decode workers use shared
    memory by default) must not change the sets these tests compare."""
    d = tempfile.mkdtemp(prefix="tandem-test-", dir=SHM_DIR)
    mp = pytest.MonkeyPatch()
    mp.setattr(shm_segments, "SHM_DIR", d)
    mp.setattr(sys.modules[__name__], "SHM_DIR", d)
    mp.setenv("TANDEM_SHM_DIR", d)
    try:
        yield d
    finally:
        mp.undo()
        shutil.rmtree(d, ignore_errors=True)


def segments() -> set[str]:
    """The KV segments and instance locks in shared memory."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}


def data_segments() -> set[str]:
    return {n for n in segments() if not n.endswith(".lock")}


async def transfer(receiver: ShmBackend, sender: ShmBackend, src, src_ids: list[int],
                   sink, *, in_place: bool = True, damage=None, into=None) -> str:
    """One transfer of `src_ids` through `prepare` -> sender `transport`/`send` -> receiver
    `for_transport`/`receive` -> `release`; the transport used. `damage(segment)` runs on
    the sender's side after each layer is written; `into`: the job's `gather_into`."""
    layout = receiver.layout
    n = len(src_ids)
    req = worker_pb2.PrefillRequest(request_id="t", num_blocks=n, backend="shm")
    await receiver.prepare(req, "peer")
    assert req.backend == "grpc"  # what a sender without shm sends by
    try:  # as the service decides
        offered = "shm" if req.shm_segment else req.backend
        transport = sender.backend(offered).transport(req, n * layout.block_layer_bytes)
        header_transport = transport if transport != req.backend else ""
        job = SendJob(req, layout, src_ids, lambda layer: gather_layer(src, layer, src_ids),
                      1e18, (lambda layer: layer_page_views(src, layer, src_ids))
                      if in_place else None, gather_into=into)

        async def stream():
            async for msg in sender.backend(transport).send(job):
                if damage is not None and isinstance(msg, worker_pb2.PageChunk) and ends(msg):
                    damage(req, [layer for layer, _ in ends(msg)])
                yield decode_chunk(serialize_chunk(msg))  # as off the wire

        await receiver.for_transport(header_transport or req.backend).receive(
            req, layout, n, stream(), sink)
    finally:
        await receiver.release(req)
    return transport


def ends(msg: worker_pb2.PageChunk) -> list[tuple[int, int]]:
    """The (layer, digest) pairs a message ends: one `layer_end`, several `layer_ends`."""
    kind = msg.WhichOneof("kind")
    if kind == "layer_end":
        return [(msg.layer_end.layer, msg.layer_end.xxh3_64)]
    if kind == "layer_ends":
        return [(e.layer, e.xxh3_64) for e in msg.layer_ends.ends]
    return []


class HashingCacheSink:
    """A `HashingSink` over a cache (as a decode worker's import writer is): writes while
    hashing (`scatter_layer_digest`), records the layers it was called for."""

    def __init__(self, dst, ids: list[int], select: list[int] | None = None) -> None:
        """`select`: the positions among the sent pages that `ids` are for (the rest: held
        already, hashed and not written, as an import skips them); None: all."""
        self.dst, self.ids, self.select, self.seen = dst, ids, select, []

    async def __call__(self, layer, pages) -> None:
        self.seen.append(layer)
        chosen = pages if self.select is None else pages[:, self.select]
        scatter_layer(self.dst, layer, self.ids, chosen)

    async def write_hashed(self, layer, pages) -> int | None:
        self.seen.append(layer)
        targets = scatter_targets(pages.shape[1], self.ids, self.select,
                                  self.dst[0][0].shape[0])
        return scatter_layer_digest(self.dst, layer, targets, pages)


class Sender(ShmBackend):
    """A sender with the grpc fallback at hand (as the service's backend table is)."""

    def backend(self, name: str):
        return self if name == "shm" else self._grpc


def backends(seed: int) -> tuple[ShmBackend, Sender, list]:
    src = caches(seed)
    layout = PageLayout.of("m", src)
    receiver = ShmBackend()
    receiver.configure(device=torch.device("cpu"), advertise_host="", layout=layout)
    return receiver, Sender(), src


def test_pages_arrive_exactly_whatever_the_sink_speed(monkeypatch):
    """Seeded random block sets, read in place, gathered or written straight into the slot
    (`gather_into`, on the event loop when every layer has a slot), with a sink that is fast
    or slow (a slow one makes the sender wait for its slot when there are two) or that
    writes while hashing (`HashingSink`): every page lands as it was sent, and the
    receiver's segment holds `slots_for` slots of one layer each (two, or one per layer
    for small layers)."""
    for seed in range(12):
        rng = random.Random(seed)
        monkeypatch.setattr(shm_backend, "SLOT_BUDGET", 0 if seed % 4 < 2 else 8 << 20)
        receiver, sender, src = backends(seed)
        n = rng.randint(1, 6)
        src_ids, dst_ids = rng.sample(range(BLOCKS), n), rng.sample(range(BLOCKS), n)
        dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
        slow = seed % 2 == 1

        async def plain(layer, pages, dst=dst, ids=dst_ids, slow=slow):
            if slow:
                await asyncio.sleep(0.01)
            scatter_layer(dst, layer, ids, pages.clone() if slow else pages)

        sink = HashingCacheSink(dst, dst_ids) if seed % 6 >= 4 else plain

        async def main(receiver=receiver, sender=sender, src=src, src_ids=src_ids,
                       sink=sink, seed=seed, n=n) -> str:
            before = data_segments()
            sizes_seen: list[int] = []
            orig = receiver._instance.create

            def create(slots, slot_bytes):
                seg = orig(slots, slot_bytes)
                sizes_seen.append(os.path.getsize(os.path.join(SHM_DIR, seg.name)))
                return seg

            receiver._instance.create = create
            used = await transfer(receiver, sender, src, src_ids, sink,
                                  in_place=seed % 3 == 1,
                                  into=host_pages_into(src, src_ids) if seed % 3 == 2 else None)
            layer_bytes = n * receiver.layout.block_layer_bytes
            slots = slots_for(LAYERS, layer_bytes)
            assert slots == (2 if seed % 4 < 2 else LAYERS)
            assert sizes_seen == [CONTROL_BYTES + slots * (-(-layer_bytes // 4096) * 4096)]
            kept = data_segments() - before
            assert len(kept) == 1  # kept for this peer's next transfer: reused
            assert await transfer(receiver, sender, src, src_ids, sink) == "shm"
            assert data_segments() - before == kept and len(sizes_seen) == 1
            await receiver.close()
            await sender.close()
            assert data_segments() == before
            return used

        assert asyncio.run(main()) == "shm"
        for layer in range(LAYERS):
            for kv in range(2):
                assert torch.equal(dst[layer][kv][dst_ids], src[layer][kv][src_ids]), seed
                others = [b for b in range(BLOCKS) if b not in dst_ids]
                assert not dst[layer][kv][others].any()


@pytest.mark.parametrize("budget", [0, 8 << 20])  # two slots; one per layer
def test_a_damaged_slot_is_refused_before_the_sink_sees_it(monkeypatch, budget):
    """A byte flipped in the slot after the sender hashed it: the layer is refused
    (`invalid`), no sink call gets it, and the segment is gone afterwards. A sink that
    writes while hashing (`HashingSink`) does get the layer, into blocks nothing reads yet:
    the transfer fails all the same, so its caller frees them uncached."""
    monkeypatch.setattr(shm_backend, "SLOT_BUDGET", budget)
    receiver, sender, src = backends(1)
    seen: list[int] = []

    async def sink(layer, pages):
        seen.append(layer)

    def damage(req, layers):  # flips layer 2's first byte, once its digest is on its way
        if 2 in layers:
            seg = receiver._segments[req.shm_segment]
            view = seg.slot(2 % seg.slots, 1)
            view[0] ^= 0xFF

    async def main() -> None:
        before = data_segments()
        with pytest.raises(KVTransferError, match="page checksum mismatch in layer 2") as err:
            await transfer(receiver, sender, src, [3, 1, 4], sink, damage=damage)
        assert err.value.reason == "invalid"
        # the calls for layers 0 and 1 may not have started before layer 2 failed (then
        # cancelled: with their digests in one message, in the same turn of the loop)
        assert seen in ([], [0], [0, 1]) and data_segments() == before
        dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
        hashing = HashingCacheSink(dst, [0, 1, 2])
        with pytest.raises(KVTransferError, match="page checksum mismatch in layer 2") as err:
            await transfer(receiver, sender, src, [3, 1, 4], hashing, damage=damage)
        assert err.value.reason == "invalid" and 2 in hashing.seen
        assert data_segments() == before
        await receiver.close()

    asyncio.run(main())


def test_layer_ends_come_batched_only_to_a_receiver_that_offers_it():
    """A receiver that offers `shm_layer_batches` gets the ready digests several to a
    message (here every layer at once: small layers from a host cache, one slot each); one
    that does not (an older version) gets one `layer_end` per layer, and a `layer_ends` it
    did not ask for, or one ending more layers than remain, is refused."""
    receiver, sender, src = backends(3)
    ids = [4, 11, 6]

    async def main() -> None:
        for batches in (True, False):
            req = worker_pb2.PrefillRequest(request_id="b", num_blocks=3, backend="shm")
            await receiver.prepare(req, "peer")
            assert req.shm_layer_batches
            req.shm_layer_batches = batches
            layout = receiver.layout
            assert sender.transport(req, 3 * layout.block_layer_bytes) == "shm"
            job = SendJob(req, layout, ids, lambda layer: gather_layer(src, layer, ids), 1e18,
                          gather_into=host_pages_into(src, ids))
            msgs = [m async for m in sender.send(job)]
            kinds = [m.WhichOneof("kind") for m in msgs]
            assert kinds == (["layer_ends", "trailer"] if batches
                             else ["layer_end"] * LAYERS + ["trailer"])
            want = [xxhash.xxh3_64_intdigest(gather_layer(src, layer, ids).numpy().tobytes())
                    for layer in range(LAYERS)]
            assert [d for m in msgs for _, d in ends(m)] == want

            async def replay(msgs=msgs):
                for m in msgs:
                    yield m

            got: list[int] = []

            async def sink(layer, pages, got=got):
                got.append(layer)

            await receiver.receive(req, layout, 3, replay(), sink)
            assert got == list(range(LAYERS))
            await receiver.release(req)

        for batches, forged, match in ((False, LAYERS, "unexpected layer_ends"),
                                       (True, LAYERS + 1, "layer ends in one message")):
            req = worker_pb2.PrefillRequest(request_id="f", num_blocks=3, backend="shm")
            await receiver.prepare(req, "peer")
            req.shm_layer_batches = batches

            async def forged_stream(n=forged):
                yield worker_pb2.PageChunk(layer_ends=worker_pb2.PageLayerEnds(ends=[
                    worker_pb2.PageLayerEnd(layer=i, xxh3_64=0) for i in range(n)]))

            async def nothing(layer, pages):
                raise AssertionError("no layer may reach the sink")

            with pytest.raises(KVTransferError, match=match):
                await receiver.receive(req, receiver.layout, 3, forged_stream(), nothing)
            await receiver.release(req)
        await receiver.close()
        await sender.close()

    asyncio.run(main())


def test_no_damaged_slot_goes_unnoticed_over_random_traces(monkeypatch):
    """400 seeded traces: random blocks sent, a random subset of them written (the rest
    held already: hashed, not written), two slots or one per layer, a sink that hashes as
    it writes or one that is handed checked pages, and in half the traces one random byte
    of one random layer's slot flipped after the sender hashed it. A damaged trace always
    fails `invalid` (however far the writes went); a sound one lands every written page
    exactly and leaves every other block as it was."""
    receiver, sender, src = backends(11)

    async def main() -> None:
        rng = random.Random(11)
        for trace in range(400):
            monkeypatch.setattr(shm_backend, "SLOT_BUDGET", rng.choice([0, 8 << 20]))
            n = rng.randint(1, 6)
            src_ids = rng.sample(range(BLOCKS), n)
            select = sorted(rng.sample(range(n), rng.randint(0, n)))
            dst_ids = rng.sample(range(BLOCKS), len(select))
            dst = [(torch.randn_like(k), torch.randn_like(v)) for k, v in src]
            before = [(k.clone(), v.clone()) for k, v in dst]
            sink = HashingCacheSink(dst, dst_ids, select)
            sink_fn = sink if rng.random() < 0.75 else sink.__call__  # no write_hashed
            bad = rng.randrange(LAYERS) if trace % 2 else None
            size = n * receiver.layout.block_layer_bytes
            at = rng.randrange(size)

            def damage(req, layers, bad=bad, at=at, size=size):
                if bad in layers:
                    seg = receiver._segments[req.shm_segment]
                    seg.slot(bad % seg.slots, size)[at] ^= 1 << rng.randrange(8)

            if bad is not None:
                with pytest.raises(KVTransferError, match=f"mismatch in layer {bad}") as err:
                    await transfer(receiver, sender, src, src_ids, sink_fn, damage=damage)
                assert err.value.reason == "invalid", trace
                continue
            assert await transfer(receiver, sender, src, src_ids, sink_fn) == "shm"
            for layer in range(LAYERS):
                for kv in range(2):
                    want = before[layer][kv].clone()
                    want[dst_ids] = src[layer][kv][[src_ids[i] for i in select]]
                    assert torch.equal(dst[layer][kv], want), trace
        await receiver.close()
        await sender.close()

    asyncio.run(main())


def test_a_receiver_on_another_node_gets_grpc():
    """Node identities that differ, or a segment the sender cannot open: the pages travel by
    grpc (the header's transport) and arrive exactly; nothing is left in shared memory."""
    receiver, sender, src = backends(2)
    got: dict[int, torch.Tensor] = {}

    async def sink(layer, pages):
        got[layer] = pages.clone()

    async def main() -> list[str]:
        before = data_segments()
        used = []
        receiver.node = "another-boot-id/1"
        used.append(await transfer(receiver, sender, src, [5, 2], sink))
        assert data_segments() == before
        # that peer is known to be elsewhere now: asked for grpc, with no segment
        req = worker_pb2.PrefillRequest(num_blocks=2, backend="shm")
        await receiver.prepare(req, "peer")
        assert req.backend == "grpc" and not req.shm_segment
        receiver._grpc_peers.clear()
        receiver.node = node_identity()
        orig = receiver.prepare

        async def unopenable(req, peer):
            await orig(req, peer)
            req.shm_slots = 3  # not the segment's size: the sender cannot use it
        receiver.prepare = unopenable
        used.append(await transfer(receiver, sender, src, [5, 2], sink))
        assert data_segments() == before
        await receiver.close()
        return used

    assert asyncio.run(main()) == ["grpc", "grpc"]
    for layer in range(LAYERS):
        assert torch.equal(got[layer], gather_layer(src, layer, [5, 2]))


def test_a_sender_opens_only_a_real_segment_by_its_exact_name_and_size():
    """The name, slots and slot size a (signed) request names: no path outside the segment
    directory, no symlink, no size but the file's, at most 4 slots, and the magic first."""
    inst = Instance()
    seg = inst.create(2, 4096)
    try:
        bad_names = ["../" + seg.name, seg.name + "/x", "/dev/zero", f"{PREFIX}x",
                     seg.name.upper(), seg.name + ".lock", "tandem-kv-../../etc/passwd"]
        for name in bad_names:
            with pytest.raises(ValueError):
                open_segment(name, 2, seg.slot_bytes)
        for slots, slot_bytes in [(0, 4096), (5, 4096), (2, 0), (1, 4096), (2, 8192),
                                  (2, 1 << 62)]:
            with pytest.raises(ValueError):
                open_segment(seg.name, slots, slot_bytes)
        link = f"{PREFIX}{'1' * 16}-{'2' * 32}"
        os.symlink(os.path.join(SHM_DIR, seg.name), os.path.join(SHM_DIR, link))
        with pytest.raises(OSError):  # ELOOP: a link is never followed
            open_segment(link, 2, seg.slot_bytes)
        plain = f"{PREFIX}{'3' * 16}-{'4' * 32}"  # the right size, not a segment
        with open(os.path.join(SHM_DIR, plain), "wb") as f:
            f.truncate(CONTROL_BYTES + 2 * seg.slot_bytes)
        with pytest.raises(ValueError):
            open_segment(plain, 2, seg.slot_bytes)
        opened = open_segment(seg.name, 2, seg.slot_bytes)
        assert (opened.slots, opened.consumed) == (2, 0)
        opened.close()
    finally:
        for name in (seg.name, f"{PREFIX}{'1' * 16}-{'2' * 32}", f"{PREFIX}{'3' * 16}-{'4' * 32}"):
            shm_segments.unlink(name)
        seg.close()
        inst.close()


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-shm-send" and t.is_alive()]


async def no_writer_left(timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while writer_threads() and loop.time() < end:
        await asyncio.sleep(0.01)
    assert not writer_threads()


def test_a_sender_waiting_for_a_slot_stops_at_the_leases_end_or_when_closed(monkeypatch):
    """A receiver of two slots that never frees one: the sender writes the two layers the
    slots hold (each digest the XXH3-64 of that layer's pages), then fails with `expired`
    at the lease's end; a stream closed while its writer waits for a slot leaves no writer
    thread either."""
    monkeypatch.setattr(shm_backend, "SLOT_BUDGET", 0)
    receiver, sender, src = backends(6)
    ids = [5, 0, 9]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        req = worker_pb2.PrefillRequest(request_id="stuck", num_blocks=len(ids), backend="shm")
        await receiver.prepare(req, "peer")
        layout = receiver.layout
        assert sender.transport(req, len(ids) * layout.block_layer_bytes) == "shm"

        def job(deadline_s: float) -> SendJob:
            return SendJob(req, layout, ids, lambda layer: gather_layer(src, layer, ids),
                           loop.time() + deadline_s,
                           lambda layer: layer_page_views(src, layer, ids))

        stream = sender.send(job(0.3))
        got = ends(await anext(stream))
        if len(got) < 2:  # the second layer came apart from the first
            got += ends(await anext(stream))
        want = [xxhash.xxh3_64_intdigest(gather_layer(src, layer, ids).numpy().tobytes())
                for layer in range(2)]
        assert got == [(0, want[0]), (1, want[1])]
        t0 = loop.time()
        with pytest.raises(KVTransferError, match="lease ended") as err:
            await anext(stream)
        assert err.value.reason == "expired" and loop.time() - t0 < 5
        await no_writer_left()

        stream = sender.send(job(600))
        if len(ends(await anext(stream))) < 2:
            await anext(stream)
        await asyncio.sleep(0.05)  # its writer now waits for slot 0
        assert len(writer_threads()) == 1
        await stream.aclose()
        await no_writer_left()
        await receiver.release(req)
        await receiver.close()
        await sender.close()

    asyncio.run(main())


def test_a_layer_that_fails_to_compute_ends_the_stream_after_the_layers_before_it():
    """Layer-by-layer sending (`job.layers`) whose wait for layer 1 fails: layer 0's digest
    goes out, then the stream raises that error (it does not wait for the lease's end), and
    no writer thread is left."""
    receiver, sender, src = backends(7)
    ids = [2, 3]

    class Layers:
        async def wait(self, layer: int) -> None:
            if layer == 1:
                await asyncio.sleep(0.05)
                raise KVTransferError("failed", "the prefill failed")

        def device_context(self):
            return contextlib.nullcontext()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        req = worker_pb2.PrefillRequest(request_id="fails", num_blocks=len(ids), backend="shm")
        await receiver.prepare(req, "peer")
        layout = receiver.layout
        assert sender.transport(req, len(ids) * layout.block_layer_bytes) == "shm"
        job = SendJob(req, layout, ids, lambda layer: gather_layer(src, layer, ids),
                      loop.time() + 600, lambda layer: layer_page_views(src, layer, ids),
                      Layers())  # type: ignore[arg-type]
        stream = sender.send(job)
        first = await anext(stream)
        assert first.layer_end.layer == 0
        async with asyncio.timeout(5):
            with pytest.raises(KVTransferError, match="the prefill failed"):
                await anext(stream)
        await no_writer_left()
        await receiver.release(req)
        await receiver.close()
        await sender.close()

    asyncio.run(main())


def test_no_room_in_shared_memory_asks_for_grpc(monkeypatch):
    """Shared memory that cannot hold the segment (a container's small /dev/shm): the
    request asks for grpc with no offer, and no file is left."""
    receiver, _, _ = backends(5)

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)

    async def main() -> None:
        before = data_segments()
        req = worker_pb2.PrefillRequest(request_id="full", num_blocks=2, backend="shm")
        await receiver.prepare(req, "peer")
        assert req.backend == "grpc" and not req.shm_segment
        assert data_segments() == before
        await receiver.close()

    asyncio.run(main())


def test_a_header_naming_a_transport_not_offered_is_invalid():
    receiver, _, _ = backends(3)
    assert receiver.for_transport("shm") is receiver
    with pytest.raises(KVTransferError, match="pages offered by 'torch', asked for shm"):
        receiver.for_transport("torch")


def test_a_stream_that_fails_midway_leaves_no_segment():
    """The sender's stream breaks after one layer (a killed prefill worker), or the sink
    fails writing a layer: the receive fails at once and `release` unlinks the segment."""
    receiver, sender, src = backends(4)

    async def sink(layer, pages):
        pass

    def die(req, layers):  # the stream breaks as layer 1's digest would go
        if max(layers) >= 1:
            raise ConnectionResetError("the prefill worker is gone")

    async def failing(layer, pages):
        if layer == 1:
            raise OSError("the cache write failed")

    async def main() -> None:
        before = data_segments()
        with pytest.raises(ConnectionResetError):
            await transfer(receiver, sender, src, [0, 1, 2], sink, damage=die)
        assert data_segments() == before
        # a sink that fails: the transfer ends with its error, not at the fetch's timeout
        async with asyncio.timeout(10):
            with pytest.raises(OSError, match="the cache write failed"):
                await transfer(receiver, sender, src, [0, 1, 2], failing)
        assert data_segments() == before
        await receiver.close()

    asyncio.run(main())


def test_pages_written_straight_into_the_slot_cross_exactly_in_chunks(monkeypatch):
    """`gather_into` with the copy and hash in chunks smaller than a layer (several blocks,
    one block, a chunk ending mid-layer): every page lands exactly; a `gather_into` that
    fails at layer 2 ends the transfer with its error and leaves no segment or thread."""
    import tandem.kvtransfer.shm_backend as shm
    from tandem.engine.kv_cache import page_copy

    monkeypatch.setattr(page_copy, "available", lambda: False)  # the numpy path, in chunks
    receiver, sender, src = backends(8)
    ids = [9, 2, 15, 0, 7]
    layer_bytes = len(ids) * receiver.layout.block_layer_bytes

    async def main() -> None:
        before = data_segments()
        for chunk in (1, 3 * layer_bytes // 10, 1 << 20):
            monkeypatch.setattr(shm, "FUSE_ABOVE", 0)  # chunked whatever the layer size
            monkeypatch.setattr(shm, "CHUNK", chunk)
            dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]

            async def sink(layer, pages, dst=dst):
                scatter_layer(dst, layer, [0, 1, 2, 3, 4], pages)

            assert await transfer(receiver, sender, src, ids, sink, in_place=False,
                                  into=host_pages_into(src, ids)) == "shm"
            for layer in range(LAYERS):
                for kv in range(2):
                    assert torch.equal(dst[layer][kv][:5], src[layer][kv][ids]), chunk

        class Failing(HostPages):
            def __call__(self, layer, kv, first, out):
                if layer == 2:
                    raise OSError("the cache read failed")
                super().__call__(layer, kv, first, out)

        failing = Failing(src, ids)

        seen: list[int] = []

        async def count(layer, pages):
            seen.append(layer)

        async with asyncio.timeout(10):
            with pytest.raises(OSError, match="the cache read failed"):
                await transfer(receiver, sender, src, ids, count, in_place=False,
                               into=failing)
        assert seen in ([], [0], [0, 1])  # the later calls cancelled: never layer 2
        await no_writer_left()
        await receiver.close()
        await sender.close()
        assert data_segments() == before

    asyncio.run(main())


KILLED_RECEIVER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("segments", sys.argv[1])  # stdlib only: fast
segments = sys.modules["segments"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(segments)
inst = segments.Instance()
seg = inst.create(2, 1 << 16)
print(inst.id, seg.name, flush=True)
time.sleep(600)
"""


def test_a_killed_receivers_segment_is_swept():
    """kill -9 of a receiver holding a segment: the segment stays until the node's next
    sweep, which removes it and the instance's lock; a live instance's are kept."""
    live = Instance()
    kept = live.create(1, 4096)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RECEIVER, shm_segments.__file__],
                            stdout=subprocess.PIPE, text=True)
    try:
        inst, name = proc.stdout.readline().split()
        assert name in segments() and f"{PREFIX}{inst}.lock" in segments()
        assert name not in sweep()  # alive: its lock is held
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert name in segments()
        assert sweep(keep=live.id) == [name]
        assert not {n for n in segments() if inst in n}
        assert kept.name in segments()
    finally:
        proc.kill()
        proc.wait()
        os.unlink(os.path.join(SHM_DIR, kept.name))
        kept.close()
        live.close()


# -- between two processes -----------------------------------------------------------------------

MODEL, EBS = "tiny-shm", 4
LENGTHS = (EBS + 1, 9, 23, 49)  # 1 to 12 full blocks, with or without a partial one
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill process (plain and layer-streaming services) and, here, a decode engine and
    an aggregated one of the same tiny model."""
    path = tmp_path_factory.mktemp("shm-pd")
    make_tiny_model_dir(path, "llama", seed=11)
    proc = subprocess.Popen([sys.executable, "-m", "tests.kvtransfer.shm_prefill_process",
                             str(path), MODEL, str(EBS)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    engines = []
    try:
        for _ in range(2):
            engines.append(AsyncLLMEngine(LLMEngine(EngineConfig(
                model=str(path), block_size=EBS, num_kv_blocks=128, num_threads=1,
                served_model_name=MODEL))))
        ready, *ports = proc.stdout.readline().split()
        assert ready == "READY"
        yield [f"127.0.0.1:{p}" for p in ports], engines[0], engines[1]
    finally:
        proc.kill()
        proc.wait()
        for e in engines:
            e.shutdown()


async def greedy(engine: AsyncLLMEngine, prompt: list[int], rid: str) -> list[int]:
    _, q = await engine.add(prompt, GREEDY, rid)
    while not (out := await q.get()).finished:
        pass
    assert out.outputs[0].finish_reason == "length", out.error
    return out.outputs[0].token_ids


def test_disaggregated_tokens_over_shared_memory_equal_aggregated(pair, monkeypatch):
    """Prompts of 1..12 blocks (and a partial one) prefilled in the other process, their
    pages through shared memory (with and without layer streaming), decoded here, written
    while hashed on the event loop or on the writer thread: the aggregated engine's greedy
    tokens, every page imported by `shm`, none by grpc, and no segment left once it
    closes; the same decode worker made to look like another node gets them by grpc."""
    from tandem.kvtransfer import client

    targets, decode, single = pair
    rng = random.Random(5)

    async def main() -> None:
        before = data_segments()
        remote = RemotePrefill(decode, MODEL, RemotePrefillSettings(backend="auto"))
        used = {"shm": 0, "grpc": 0}
        shm, grpc_ = remote._backend, remote._backend._grpc
        for name, backend in (("shm", shm), ("grpc", grpc_)):
            def counted(*a, name=name, orig=backend.receive, **kw):
                used[name] += 1
                return orig(*a, **kw)
            backend.receive = counted
        try:
            for node in (shm.node, "another-node/1"):
                shm.node = node
                for t, target in enumerate(targets):
                    # layers written on the event loop (small), or all on the writer thread
                    monkeypatch.setattr(client, "INLINE_WRITE", 256 << 10 if t == 0 else 0)
                    for i, n in enumerate(LENGTHS):
                        prompt = [rng.randrange(100, 40000) for _ in range(n)]  # fresh
                        rid = f"{node[:7]}-{i}-{t}"
                        want = await greedy(single, prompt, f"ref-{rid}")
                        imported = await remote.fetch(target, rid, prompt)
                        assert imported is not None and imported.bytes > 0
                        try:
                            assert await greedy(decode, prompt, rid) == want, (node, i, t)
                        finally:
                            await remote.unpin(imported)
                assert len(data_segments() - before) <= 2 * IDLE_PER_PEER  # kept per peer
                assert used == {"shm": 2 * len(LENGTHS),
                                "grpc": 0 if node != "another-node/1" else 2 * len(LENGTHS)}
        finally:
            await remote.close()
        assert data_segments() == before

    asyncio.run(main())


def test_a_sender_killed_mid_transfer_leaves_no_segment():
    """A prefill process that took the offer, wrote layer 0 and stalls is killed -9: the
    receive fails at once, `release` unlinks the segment, and with the sender's mapping gone
    with its process nothing of the transfer is left in shared memory."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.kvtransfer.fake_prefill", str(port),
                             "shm"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    receiver = ShmBackend()
    receiver.configure(device=torch.device("cpu"), advertise_host="", layout=FAKE_LAYOUT)
    bs = FAKE_LAYOUT.block_size

    async def main() -> None:
        before = data_segments()
        req = worker_pb2.PrefillRequest(request_id="killed", model_id=FAKE_LAYOUT.model_id,
                                        token_ids=list(range(100, 100 + 3 * bs + 1)),
                                        block_size=bs, num_blocks=3, backend="shm")
        await receiver.prepare(req, f"127.0.0.1:{port}")
        assert data_segments() - before == {req.shm_segment}
        seen: list[int] = []

        async def sink(layer, pages):
            seen.append(layer)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            it = prefill_method(channel)(req, timeout=60).__aiter__()
            header = (await it.__anext__()).header
            backend = receiver.for_transport(header.transport or req.backend)
            assert backend is receiver
            receiving = asyncio.ensure_future(backend.receive(req, FAKE_LAYOUT, 3, it, sink))
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line.strip() == "stalled"
            proc.send_signal(signal.SIGKILL)
            async with asyncio.timeout(30):
                with pytest.raises(grpc.aio.AioRpcError):
                    await receiving
            await receiver.release(req)
        assert seen == [0] and data_segments() == before
        await receiver.close()

    try:
        assert proc.stdout.readline().strip() == "serving"
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
