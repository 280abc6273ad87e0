"""P/D failure handling between real worker processes: a prefill worker that dies or stalls
mid-transfer, a decode worker that never acknowledges (leases), corrupted or mismatched
pages, and invalid Prefill requests. The decode worker always answers within a bounded time:
the right greedy tokens under `recompute`, an OpenAI error (502) under `fail`; a prefill
worker never holds pages past their lease; rejected pages never reach the decode cache."""

from __future__ import annotations

import asyncio
import math
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from tandem.kvtransfer.pages import MAX_DATA_CHUNK
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.bundled import BUNDLED_NAME
from tandem.protocol.signing import PREFILL_RPC, SIGNATURE_HEADER, rpc_body, sign
from tests.kvtransfer.fake_prefill import CHANNEL_OPTIONS, FakePrefillServer, header
from tests.serving.helpers import (
    WORKER_KEY,
    free_port,
    metric,
    signed,
    signing_channel,
    start_worker,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.slow
BS = 16
VOCAB = 49152
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * BS * HEAD_DIM * 4  # every layer's K + V, float32
TIMEOUT = 2.0  # the decode workers' --kv-transfer-timeout
SMALL_POOL = 24  # KV blocks of the `small` decode worker
BOUND = TIMEOUT + 40  # "never a hang": the longest any answer below may take
REPO = Path(__file__).resolve().parents[2]


def fetches(url: str, result: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem_kvtransfer_fetches_total{") and f'result="{result}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def fetched_bytes(url: str) -> float:
    return metric(url, "tandem_kvtransfer_received_bytes_total")


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def post(url: str, prompt, prefill: str | None = None) -> tuple[httpx.Response, float]:
    body, headers = signed({"model": BUNDLED_NAME, "prompt": prompt, "max_tokens": 8,
                            "temperature": 0, "ignore_eos": True}, prefill)
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", timeout=BOUND + 30, headers=headers, content=body)
    return r, time.monotonic() - t0


def text(url: str, prompt, prefill: str | None = None) -> str:
    r, _ = post(url, prompt, prefill)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_502(r: httpx.Response) -> None:
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == 502
    assert err["message"].startswith("remote prefill failed")


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    t.start()
    return t, box


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    # a 2,048-token budget: the decode worker's busy prompt below is one engine step however
    # fast the CPU (the prefill role caps each prompt's chunk at its default, 256 tokens)
    common = ("--num-threads", "1", "--num-kv-blocks", "256", "--max-num-batched-tokens", "2048")
    decode_args = ("--role", "decode", "--kv-transfer-timeout", str(TIMEOUT), *common)
    ports = {"prefill": free_port(), "victim": free_port(), "streamed": free_port()}
    workers = {
        name: start_worker(tmp, "--role", "prefill", "--grpc-port", str(port), *common,
                           *(["--kv-stream-layers"] if name == "streamed" else []),
                           wait_ready=False) for name, port in ports.items()}
    workers["decode"] = start_worker(tmp, *decode_args, wait_ready=False)
    workers["decode_fail"] = start_worker(tmp, *decode_args, "--kv-transfer-policy", "fail",
                                          wait_ready=False)
    workers["single"] = start_worker(tmp, "--role", "both", *common, wait_ready=False)
    # a decode worker with a pool small enough for a test to evict what it does not pin
    workers["small"] = start_worker(tmp, "--role", "decode", "--kv-transfer-timeout", "60",
                                    "--num-threads", "1", "--num-kv-blocks", str(SMALL_POOL),
                                    "--max-num-batched-tokens", "2048", wait_ready=False)
    fake = cluster = None
    try:
        for w in workers.values():
            wait_for(w, "/ready", 200, timeout=240)
        fake = FakePrefillServer(free_port())
        cluster = Cluster(workers, {n: f"127.0.0.1:{p}" for n, p in ports.items()}, fake)
        yield cluster
    finally:
        if cluster is not None:
            cluster.channel.close()
            cluster.streamed_channel.close()
        if fake is not None:
            fake.stop()
        for w in workers.values():  # all drain at once
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in workers.values():
            w.stop()


class Cluster:
    def __init__(self, workers, targets, fake) -> None:
        self.prefill, self.victim = workers["prefill"], workers["victim"]
        self.decode, self.decode_fail = workers["decode"], workers["decode_fail"]
        self.single, self.streamed = workers["single"], workers["streamed"]
        self.small = workers["small"]
        self.target, self.victim_target = targets["prefill"], targets["victim"]
        self.fake: FakePrefillServer = fake
        self.channel = signing_channel(grpc.insecure_channel(self.target,
                                                             options=CHANNEL_OPTIONS))
        self.streamed_channel = signing_channel(grpc.insecure_channel(
            targets["streamed"], options=CHANNEL_OPTIONS))

    def stub(self) -> worker_pb2_grpc.KVTransferStub:
        """The real prefill worker's KVTransfer, called as a decode worker would."""
        return worker_pb2_grpc.KVTransferStub(self.channel)

    def streamed_stub(self) -> worker_pb2_grpc.KVTransferStub:
        """The same on the worker that sends each layer as soon as it is computed."""
        return worker_pb2_grpc.KVTransferStub(self.streamed_channel)


# -- a prefill worker that stalls or dies ---------------------------------------------------

async def never_answers(request, context):
    await asyncio.Event().wait()
    yield worker_pb2.PageChunk()  # pragma: no cover


async def header_then_silence(request, context):
    yield header(request)
    await asyncio.Event().wait()


async def slow_drip(request, context):
    """Valid-looking progress forever: one byte at a time, a message every 0.2 s."""
    yield header(request)
    for off in range(1 << 30):
        await asyncio.sleep(0.2)
        yield worker_pb2.PageChunk(data=worker_pb2.PageData(layer=0, offset=off, data=b"\0"))


@pytest.mark.parametrize("stall", [never_answers, header_then_silence, slow_drip])
def test_a_stalled_prefill_worker_times_out(cluster, stall):
    """recompute: the right tokens, fail: a 502; either just after --kv-transfer-timeout."""
    c = cluster
    c.fake.behaviour = stall
    seed = 100 + [never_answers, header_then_silence, slow_drip].index(stall)
    p_recompute, p_fail = ids(seed, 6 * BS + 3), ids(seed + 50, 6 * BS + 3)
    want = text(c.single.url, p_recompute)
    timeouts = fetches(c.decode.url, "timeout"), fetches(c.decode_fail.url, "timeout")
    t1, got = in_thread(post, c.decode.url, p_recompute, c.fake.target)
    t2, failed = in_thread(post, c.decode_fail.url, p_fail, c.fake.target)
    time.sleep(1.0)  # both are stuck in their fetch: the worker itself still answers
    assert httpx.get(c.decode.url + "/health", timeout=2).status_code == 200
    t1.join(BOUND + 30)
    t2.join(BOUND + 30)
    (r, took), (r_fail, took_fail) = got[0], failed[0]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert_502(r_fail)
    assert "took over" in r_fail.json()["error"]["message"]
    for t in (took, took_fail):
        assert TIMEOUT - 0.5 <= t < BOUND
    assert fetches(c.decode.url, "timeout") == timeouts[0] + 1
    assert fetches(c.decode_fail.url, "timeout") == timeouts[1] + 1
    wait_idle(c.decode.url, 10)


def test_a_prefill_worker_killed_while_prefilling(cluster):
    """SIGKILL of the real prefill worker mid-prefill: the decode worker notices the dead
    connection at once (not at the timeout) and computes the prompt itself."""
    c = cluster
    # ~2 s of prefill on the victim's one thread (two chunks at the prefill role's cap): it
    # is killed well inside that window; `ok` staying put below proves it
    prompt = ids(200, 500)
    want = text(c.single.url, prompt)
    before = {r: fetches(c.decode.url, r) for r in ("ok", "timeout", "unavailable", "rpc")}
    t, got = in_thread(post, c.decode.url, prompt, c.victim_target)
    time.sleep(0.4)
    c.victim.stop(signal.SIGKILL)
    t.join(BOUND + 30)
    r, took = got[0]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert took < BOUND
    after = {r: fetches(c.decode.url, r) for r in before}
    assert after["ok"] == before["ok"] and after["timeout"] == before["timeout"]
    assert after["unavailable"] + after["rpc"] == before["unavailable"] + before["rpc"] + 1
    wait_idle(c.decode.url, 10)


def test_a_prefill_process_killed_mid_stream(cluster):
    """A prefill server SIGKILLed after the header and some pages: recompute answers the
    right tokens, fail a 502, both without waiting for the timeout."""
    c = cluster
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.kvtransfer.fake_prefill", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout],
                     daemon=True).start()

    def expect(line: str) -> None:
        while (got := lines.get(timeout=60)) != line:
            assert "Error" not in got, got

    try:
        expect("serving")
        target = f"127.0.0.1:{port}"
        p_recompute, p_fail = ids(300, 6 * BS + 3), ids(301, 6 * BS + 3)
        want = text(c.single.url, p_recompute)
        timeouts = fetches(c.decode.url, "timeout"), fetches(c.decode_fail.url, "timeout")
        t1, got = in_thread(post, c.decode.url, p_recompute, target)
        t2, failed = in_thread(post, c.decode_fail.url, p_fail, target)
        expect("stalled")
        expect("stalled")
        proc.send_signal(signal.SIGKILL)
        t1.join(BOUND + 30)
        t2.join(BOUND + 30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    (r, took), (r_fail, took_fail) = got[0], failed[0]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert_502(r_fail)
    assert took < BOUND and took_fail < BOUND
    assert fetches(c.decode.url, "timeout") == timeouts[0]
    assert fetches(c.decode_fail.url, "timeout") == timeouts[1]
    wait_idle(c.decode.url, 10)


# -- corrupted or mismatched pages ----------------------------------------------------------

def _flip(b: bytes, at: int = 0) -> bytes:
    return b[:at] + bytes([b[at] ^ 0x40]) + b[at + 1:]


def _set(chunks, i, **fields):
    kind = chunks[i].WhichOneof("kind")
    for k, v in fields.items():
        setattr(getattr(chunks[i], kind), k, v)
    return chunks


def _hashes(chunks, hashes):
    h = chunks[0].header
    del h.block_hashes[:]
    h.block_hashes.extend(hashes)
    return chunks


# name -> (how the real prefill worker's reply is damaged, the fetch result it must cause);
# a case for each kind of damage (test_fuzz.py tries many more shapes in-process)
CORRUPTIONS = {
    "wrong block hash": (lambda ch: _hashes(ch, [*ch[0].header.block_hashes[:-1],
                                                 _flip(ch[0].header.block_hashes[-1])]),
                         "invalid"),
    "more blocks than asked": (lambda ch: _set(_hashes(ch, [*ch[0].header.block_hashes,
                                                            b"\1" * 16]), 0,
                                               layer_bytes=ch[0].header.layer_bytes
                                               + BLOCK_BYTES // LAYERS), "invalid"),
    # a valid offer of only some of the blocks asked for: its pins would hold blocks while
    # the request still needs free ones for the rest, so it is refused
    "fewer blocks than asked": (lambda ch: _set(_hashes(ch, ch[0].header.block_hashes[:-1]),
                                                0, layer_bytes=ch[0].header.layer_bytes
                                                - BLOCK_BYTES // LAYERS), "partial"),
    "other model": (lambda ch: _set(ch, 0, model_id="other-model"), "invalid"),
    "wrong head count": (lambda ch: _set(ch, 0, num_kv_heads=KV_HEADS + 1), "invalid"),
    "bad checksum": (lambda ch: _set(ch, -1, xxh3_64=ch[-1].trailer.xxh3_64 ^ 1), "invalid"),
    "bad layer digest": (lambda ch: _set(ch, 4, xxh3_64=ch[4].layer_end.xxh3_64 ^ 1),
                         "invalid"),
    "a layer's end missing": (lambda ch: [*ch[:2], *ch[3:]], "invalid"),
    "flipped page byte": (lambda ch: _set(ch, 7, data=_flip(ch[7].data.data, 1000)),
                          "invalid"),
    "truncated chunk": (lambda ch: _set(ch, 3, data=ch[3].data.data[:-1]), "invalid"),
    "oversized chunk": (lambda ch: _set(ch, 1, data=b"\0" * (MAX_DATA_CHUNK + 1)), "invalid"),
    "garbage instead of the header": (lambda ch: [b"\xff", *ch[1:]], "invalid"),
    "garbage among the pages": (lambda ch: [*ch[:3], b"\x12\x05\x08", *ch[3:]], "invalid"),
    "cut before the trailer": (lambda ch: ch[:-1], "incomplete"),
    "empty stream": (lambda ch: [], "incomplete"),
}


def real_pages(c: Cluster, prompt: list[int]) -> list[worker_pb2.PageChunk]:
    """The real prefill worker's reply to the request a decode worker holding none of the
    prompt sends (fetched ahead, so the decode worker's timeout covers only the fake)."""
    stub = c.stub()
    chunks = list(stub.Prefill(prefill_request(prompt, num_blocks=(len(prompt) - 1) // BS),
                               timeout=60))
    stub.ReleasePages(worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id),
                      timeout=10)
    # header, one data chunk and its layer end per layer, trailer
    assert len(chunks) == 2 * LAYERS + 2
    assert [c.WhichOneof("kind") for c in chunks[1:5]] == ["data", "layer_end"] * 2
    return chunks


def serve(chunks: list[worker_pb2.PageChunk], damage):
    """A behaviour answering the decode worker's request for `chunks`' prompt with `damage`d
    copies of them."""
    async def behaviour(request, context):
        want = chunks[0].header
        if (request.first_block, request.num_blocks) != (0, len(want.block_hashes)):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unexpected request")
        for chunk in damage([worker_pb2.PageChunk.FromString(c.SerializeToString())
                             for c in chunks]):
            yield chunk
    return behaviour


def test_the_fake_serving_real_pages_is_accepted(cluster):
    """Control: the real prefill worker's pages, undamaged, through the fake server."""
    c = cluster
    prompt = ids(400, 3 * BS + 5)
    c.fake.behaviour = serve(real_pages(c, prompt), lambda ch: ch)
    ok, got_bytes = fetches(c.decode.url, "ok"), fetched_bytes(c.decode.url)
    assert text(c.decode.url, prompt, c.fake.target) == text(c.single.url, prompt)
    assert fetches(c.decode.url, "ok") == ok + 1
    assert fetched_bytes(c.decode.url) == got_bytes + 3 * BLOCK_BYTES


def corruption_prompt(name: str) -> list[int]:
    """A prompt only `name`'s case uses: nobody holds it before."""
    return ids(500 + list(CORRUPTIONS).index(name), 3 * BS + 5)


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_damaged_pages_are_rejected_and_recomputed(cluster, name):
    c = cluster
    damage, result = CORRUPTIONS[name]
    prompt = corruption_prompt(name)
    c.fake.behaviour = serve(real_pages(c, prompt), damage)
    want = text(c.single.url, prompt)
    count, got_bytes = fetches(c.decode.url, result), fetched_bytes(c.decode.url)
    calls = c.fake.calls
    assert text(c.decode.url, prompt, c.fake.target) == want
    assert c.fake.calls == calls + 1
    assert fetches(c.decode.url, result) == count + 1
    assert fetched_bytes(c.decode.url) == got_bytes  # nothing was imported
    wait_idle(c.decode.url, 10)  # and nothing stays pinned


def test_the_decode_cache_holds_only_its_own_computation(cluster):
    """After the damaged imports above: the decode worker's cached blocks of those prompts
    (what it computed itself) give the same tokens as the aggregated worker's, same batch."""
    c = cluster
    prompts = [corruption_prompt(name) for name in CORRUPTIONS]
    hits = metric(c.decode.url, "vllm:prefix_cache_hits_total")
    got, want = (httpx.post(url + "/v1/completions", timeout=120, json={
        "model": BUNDLED_NAME, "prompt": prompts, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}) for url in (c.decode.url, c.single.url))
    assert got.status_code == want.status_code == 200
    assert got.json()["choices"] == want.json()["choices"]
    assert metric(c.decode.url, "vllm:prefix_cache_hits_total") > hits


def layer_pages(chunks: list[worker_pb2.PageChunk]) -> list:
    """Each layer's `[2, n, kvh, bs, hd]` pages, from a real gRPC page reply's data."""
    import torch

    from tests.kvtransfer.fake_prefill import LAYOUT

    h = chunks[0].header
    out = [bytearray(h.layer_bytes) for _ in range(h.num_layers)]
    for c in chunks:
        if c.WhichOneof("kind") == "data":
            out[c.data.layer][c.data.offset:c.data.offset + len(c.data.data)] = c.data.data
    return [torch.frombuffer(b, dtype=torch.float32).view(
        LAYOUT.layer_shape(len(h.block_hashes))) for b in out]


def shm_pages(chunks: list[worker_pb2.PageChunk], damaged_layer: int | None, used: list):
    """A behaviour that takes the decode worker's shared-memory offer and sends the real
    pages of `chunks` through its slots with the real `shm` sender; with `damaged_layer`,
    one byte of that layer's slot is flipped after the sender hashed it (as memory
    corrupted between the workers would be). `used` collects the segments it wrote to."""
    from tandem.kvtransfer.base import SendJob
    from tandem.kvtransfer.shm_backend import ShmBackend
    from tests.kvtransfer.fake_prefill import LAYOUT

    pages = layer_pages(chunks)

    async def behaviour(request, context):
        n = len(chunks[0].header.block_hashes)
        backend = ShmBackend()
        try:
            assert backend.transport(request, chunks[0].header.layer_bytes) == "shm"
            used.append(request.shm_segment)
            first = worker_pb2.PageChunk.FromString(chunks[0].SerializeToString())
            first.header.transport = "shm"
            yield first
            job = SendJob(request, LAYOUT, list(range(n)), lambda layer: pages[layer], 1e18)
            async for msg in backend.send(job):
                ended = ([msg.layer_end.layer] if msg.WhichOneof("kind") == "layer_end" else
                         [e.layer for e in msg.layer_ends.ends])
                if damaged_layer in ended:  # hashed by now, not yet read by the receiver
                    seg = backend._mapped(request)
                    seg.slot(damaged_layer % seg.slots, 4)[3] ^= 0xFF  # sign and exponent
                yield msg
        finally:
            await backend.close()

    return behaviour


def test_a_damaged_shared_memory_slot_is_refused_and_its_blocks_never_cached(cluster):
    """The decode worker offers shared memory to a prefill worker on its node; a stand-in
    takes the offer and sends real pages through the slots. Sound, they are imported
    (one fetch `ok`, every byte counted). With one byte of layer 7 flipped after the
    sender hashed it, the decode worker, which writes each layer into its pinned blocks
    while hashing it, finds the mismatch: the import is refused (`invalid`), the prompt is
    recomputed (the aggregated worker's tokens), nothing is imported or left pinned, and
    asking again gives the same tokens (no damaged block was ever cached)."""
    c = cluster
    fake, used = FakePrefillServer(free_port()), []  # a peer never seen answering by grpc
    try:
        sound = ids(900, 3 * BS + 5)
        fake.behaviour = shm_pages(real_pages(c, sound), None, used)
        ok, got_bytes = fetches(c.decode.url, "ok"), fetched_bytes(c.decode.url)
        assert text(c.decode.url, sound, fake.target) == text(c.single.url, sound)
        assert fetches(c.decode.url, "ok") == ok + 1 and len(used) == 1
        assert fetched_bytes(c.decode.url) == got_bytes + 3 * BLOCK_BYTES

        damaged = ids(901, 3 * BS + 5)
        fake.behaviour = shm_pages(real_pages(c, damaged), 7, used)
        want = text(c.single.url, damaged)
        bad, got_bytes = fetches(c.decode.url, "invalid"), fetched_bytes(c.decode.url)
        assert text(c.decode.url, damaged, fake.target) == want
        assert fetches(c.decode.url, "invalid") == bad + 1 and len(used) == 2
        assert fetched_bytes(c.decode.url) == got_bytes  # nothing was imported
        wait_idle(c.decode.url, 10)  # and nothing stays pinned
        hits = metric(c.decode.url, "vllm:prefix_cache_hits_total")
        assert text(c.decode.url, damaged) == want  # from what it computed itself
        assert metric(c.decode.url, "vllm:prefix_cache_hits_total") > hits
    finally:
        fake.stop()


def test_the_local_prefix_stays_pinned_while_the_rest_is_fetched(cluster):
    """The decode worker plans its fetch against the prefix it already holds and pins it at
    once: evicting that prefix before the request is admitted would waste every imported
    block after the gap. Here a request evicts whatever is not pinned while the pages are
    on their way; the P/D request still takes every prompt token but the last from cache."""
    c = cluster
    url = c.small.url
    prefix = ids(800, 2 * BS)
    text(url, prefix + [7])  # the small worker holds the prefix's 2 blocks
    # 21 blocks of other tokens: afterwards the prefix is next in line for eviction
    text(url, ids(801, 21 * BS - 8))
    prompt = prefix + ids(802, 3 * BS + 5)  # asks for blocks 2..4 and a 4-token tail
    stub = c.stub()
    chunks = list(stub.Prefill(prefill_request(prompt, first_block=2, num_blocks=3,
                                               tail_tokens=4), timeout=60))
    stub.ReleasePages(worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id),
                      timeout=10)
    gate = threading.Event()

    async def held_back(request, context):
        assert (request.first_block, request.num_blocks, request.tail_tokens) == (2, 3, 4)
        while not gate.is_set():
            await asyncio.sleep(0.02)
        for chunk in chunks:
            yield chunk

    c.fake.behaviour = held_back
    calls = c.fake.calls
    t, box = in_thread(post, url, prompt, c.fake.target)
    deadline = time.monotonic() + 30
    while c.fake.calls == calls:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)  # the pin runs at the engine's next step boundary (it is idle)
    text(url, ids(803, 2 * BS + 8))  # 3 blocks: the least recently used, if not pinned
    gate.set()
    t.join(BOUND + 30)
    r, _ = box[0]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text(c.single.url, prompt)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    wait_idle(url, 10)


def test_an_import_that_outlasts_the_timeout_leaves_nothing_pinned(cluster):
    """The pages arrive in time but the decode engine is busy with a long step, so the
    timeout fires while the import waits for the engine thread: the request recomputes, and
    the blocks the import pins when it does run are let go."""
    c = cluster
    prompt = ids(450, 3 * BS + 5)
    c.fake.behaviour = serve(real_pages(c, prompt), lambda ch: ch)
    want = text(c.single.url, prompt)
    timeouts = fetches(c.decode.url, "timeout")
    # one engine step of 2,000 tokens on the decode worker's one thread: ~5 s on a 2026 EPYC
    # core, well past the 2 s timeout
    t, busy = in_thread(post, c.decode.url, ids(451, 2000))
    time.sleep(0.3)
    assert text(c.decode.url, prompt, c.fake.target) == want
    t.join(BOUND + 30)
    assert busy[0][0].status_code == 200
    assert fetches(c.decode.url, "timeout") == timeouts + 1
    wait_idle(c.decode.url, 10)


def test_damaged_pages_under_the_fail_policy_are_a_502(cluster):
    c = cluster
    prompt = ids(600, 3 * BS + 5)
    c.fake.behaviour = serve(real_pages(c, prompt), CORRUPTIONS["bad checksum"][0])
    invalid = fetches(c.decode_fail.url, "invalid")
    r, took = post(c.decode_fail.url, prompt, c.fake.target)
    assert_502(r)
    assert "checksum" in r.json()["error"]["message"] and took < BOUND
    assert fetches(c.decode_fail.url, "invalid") == invalid + 1
    wait_idle(c.decode_fail.url, 10)
    # the worker still serves, and computes the prompt itself without the header
    assert text(c.decode_fail.url, prompt) == text(c.single.url, prompt)


# -- leases: a decode worker that never acknowledges ------------------------------------------

def prefill_request(prompt: list[int], lease_s: float = 30.0, **fields
                    ) -> worker_pb2.PrefillRequest:
    fields = {"request_id": "test", "model_id": BUNDLED_NAME, "token_ids": prompt,
              "block_size": BS, "first_block": 0, "num_blocks": len(prompt) // BS,
              "backend": "grpc", "lease_s": lease_s, **fields}
    return worker_pb2.PrefillRequest(**fields)


def usage(url: str) -> float:
    return metric(url, "vllm:kv_cache_usage_perc")


def wait_usage_zero(url: str, within: float) -> float:
    """Seconds until the worker's KV usage is 0 (fails after `within`)."""
    t0 = time.monotonic()
    while usage(url) > 0:
        assert time.monotonic() - t0 < within, f"KV usage still {usage(url)}"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_unacknowledged_pages_are_freed_when_the_lease_expires(cluster):
    c = cluster
    wait_idle(c.prefill.url, 10)
    stub = c.stub()
    t0 = time.monotonic()
    chunks = list(stub.Prefill(prefill_request(ids(700, 8 * BS), lease_s=1.0), timeout=60))
    assert chunks[0].WhichOneof("kind") == "header" and chunks[-1].WhichOneof("kind") == "trailer"
    assert usage(c.prefill.url) > 0  # the sent blocks are pinned for the decode worker
    wait_usage_zero(c.prefill.url, 1.0 + 3.0)
    assert time.monotonic() - t0 >= 1.0  # held for the lease, not less
    # the (dead) decode worker's late acknowledgement finds nothing
    lease = chunks[0].header.lease_id
    assert not stub.ReleasePages(worker_pb2.ReleasePagesRequest(lease_id=lease),
                                 timeout=10).released


def test_an_acknowledgement_frees_the_pages_at_once(cluster):
    c = cluster
    wait_idle(c.prefill.url, 10)
    stub = c.stub()
    chunks = list(stub.Prefill(prefill_request(ids(710, 8 * BS), lease_s=600), timeout=60))
    assert usage(c.prefill.url) > 0
    release = worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id)
    assert stub.ReleasePages(release, timeout=10).released
    assert wait_usage_zero(c.prefill.url, 1.0) < 1.0
    assert not stub.ReleasePages(release, timeout=10).released  # at most once


def test_a_stream_cancelled_midway_frees_the_pages_at_once(cluster):
    c = cluster
    wait_idle(c.prefill.url, 10)
    # 40 blocks x 30 layers: 29 MB, far more than gRPC buffers, so the stream is still open
    call = c.stub().Prefill(prefill_request(ids(720, 40 * BS), lease_s=600), timeout=60)
    assert next(call).WhichOneof("kind") == "header"
    assert next(call).WhichOneof("kind") == "data"
    assert usage(c.prefill.url) > 0
    call.cancel()
    assert wait_usage_zero(c.prefill.url, 3.0) < 3.0  # not the 600 s lease


def test_a_stream_cancelled_during_the_prefill_frees_the_pages(cluster):
    """The decode worker gives up (timeout, death) while the prefill is still computing:
    the finished prompt's blocks must not stay pinned with no lease to expire."""
    c = cluster
    wait_idle(c.prefill.url, 10)
    stub = c.stub()
    # ~2 s of prefill (two capped chunks): the cancel lands while it computes (and the
    # prompt is not finished until its last step is, so the next request is the way to
    # wait for it)
    call = stub.Prefill(prefill_request(ids(730, 500), lease_s=600), timeout=60)
    time.sleep(0.5)
    call.cancel()
    chunks = list(stub.Prefill(prefill_request(ids(731, 2 * BS), lease_s=600), timeout=60))
    assert chunks[-1].WhichOneof("kind") == "trailer"
    assert stub.ReleasePages(worker_pb2.ReleasePagesRequest(
        lease_id=chunks[0].header.lease_id), timeout=10).released
    assert wait_usage_zero(c.prefill.url, 3.0) < 3.0


# -- layer-by-layer sending ---------------------------------------------------------------------

def test_streamed_pages_leave_while_the_prompt_computes(cluster):
    """The header comes when the prompt's last step starts and pages follow as layers are
    written, well before that step ends; the pages are those of the whole-prompt sender
    (same checksum), and an acknowledgement frees them. The prefill workers run their role's
    default chunk cap, so the prompt takes more than one step."""
    c = cluster
    wait_idle(c.streamed.url, 10)
    prompt = ids(740, 500)  # ~2 s of prefill on one thread, in two capped chunks
    t0 = time.monotonic()
    arrivals: list[tuple[float, str]] = []
    chunks, whole = [], []
    try:
        for chunk in c.streamed_stub().Prefill(prefill_request(prompt, lease_s=600),
                                               timeout=60):
            arrivals.append((time.monotonic() - t0, chunk.WhichOneof("kind")))
            chunks.append(chunk)
        kinds = [k for _, k in arrivals]
        assert kinds[0] == "header" and kinds[-1] == "trailer"
        assert set(kinds[1:-1]) == {"data", "layer_end"}
        # layer 0 of the last step left long before its last layer was written
        header, first_data, end = arrivals[0][0], arrivals[1][0], arrivals[-1][0]
        assert first_data - header < 0.5 * (end - header), arrivals[:3]
        whole = list(c.stub().Prefill(prefill_request(prompt, lease_s=600), timeout=60))
        assert whole[-1].trailer.xxh3_64 == chunks[-1].trailer.xxh3_64
        assert [(m.WhichOneof("kind"), m.data.layer, m.layer_end.layer)
                for m in whole[1:-1]] == [
            (m.WhichOneof("kind"), m.data.layer, m.layer_end.layer) for m in chunks[1:-1]]
        assert [m.layer_end.xxh3_64 for m in whole[1:-1]] == [
            m.layer_end.xxh3_64 for m in chunks[1:-1]]
    finally:  # a failure above must not leave pages pinned for the next tests
        released = [stub.ReleasePages(worker_pb2.ReleasePagesRequest(
            lease_id=got[0].header.lease_id), timeout=10).released
            for stub, got in ((c.stub(), whole), (c.streamed_stub(), chunks)) if got]
    assert released == [True, True]
    assert wait_usage_zero(c.streamed.url, 3.0) < 3.0


def test_a_streamed_prefill_cancelled_while_computing_frees_its_blocks(cluster):
    c = cluster
    wait_idle(c.streamed.url, 10)
    call = c.streamed_stub().Prefill(prefill_request(ids(750, 500), lease_s=600), timeout=60)
    assert next(call).WhichOneof("kind") == "header"
    assert next(call).WhichOneof("kind") == "data"  # the first layers, the rest computing
    call.cancel()
    # the request is aborted, or it finishes and its kept blocks are released after it
    assert wait_usage_zero(c.streamed.url, 10.0) < 10.0
    chunks = list(c.streamed_stub().Prefill(prefill_request(ids(751, 2 * BS), lease_s=1),
                                            timeout=60))
    assert chunks[-1].WhichOneof("kind") == "trailer"  # and it keeps serving
    assert wait_usage_zero(c.streamed.url, 1.0 + 3.0) < 4.0  # the lease expires


# -- invalid requests ---------------------------------------------------------------------------

BASE = ids(800, 4 * BS + 3)
INVALID = {
    "wrong model": {"model_id": "other-model"},
    "empty model": {"model_id": ""},
    "wrong block size": {"block_size": 2 * BS},
    "zero block size": {"block_size": 0},
    "no blocks": {"num_blocks": 0},
    "past the prompt's full blocks": {"num_blocks": 5},
    "first block out of range": {"first_block": 4, "num_blocks": 1},
    "huge first block": {"first_block": 2**32 - 1},
    "token id = vocab size": {"token_ids": [*BASE[:-1], VOCAB]},
    "token id 2^32-1": {"token_ids": [2**32 - 1, *BASE[1:]]},
    "empty prompt": {"token_ids": []},
    "prompt over the context window": {"token_ids": ids(801, 8192), "num_blocks": 1},
    "prompt over the KV capacity": {"token_ids": ids(802, 256 * BS + 1), "num_blocks": 1},
    "unknown backend": {"backend": "carrier-pigeon"},
    "no backend": {"backend": ""},
    "lease too long": {"lease_s": 601.0},
    "negative lease": {"lease_s": -1.0},
    "NaN lease": {"lease_s": math.nan},
    "infinite lease": {"lease_s": math.inf},
    "request id too long": {"request_id": "r" * 300},
    "cache salt too long": {"cache_salt": "s" * 5000},
}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole-prompt", "layer-by-layer"])
def test_invalid_prefill_requests_are_invalid_argument(cluster, streamed):
    c = cluster
    stub, worker = (c.streamed_stub(), c.streamed) if streamed else (c.stub(), c.prefill)
    for name, fields in INVALID.items():
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Prefill(prefill_request(BASE, **fields), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value)
    # nothing was computed or pinned, and the worker keeps serving
    assert usage(worker.url) == 0
    assert httpx.get(worker.url + "/health", timeout=5).status_code == 200
    chunks = list(stub.Prefill(prefill_request(BASE, lease_s=5), timeout=60))
    assert chunks[0].header.block_hashes and chunks[-1].WhichOneof("kind") == "trailer"
    assert stub.ReleasePages(worker_pb2.ReleasePagesRequest(
        lease_id=chunks[0].header.lease_id), timeout=10).released


def test_prefill_calls_without_the_key_are_permission_denied(cluster):
    """A prefill worker with a worker auth key serves Prefill only to callers signing with
    it (as decode workers do): unsigned, wrong-key, other-request and stale signatures are
    refused before any compute, and the worker keeps serving signed calls."""
    c = cluster
    prompt = ids(770, 4 * BS + 3)
    req = prefill_request(prompt, lease_s=5)
    other = prefill_request(ids(771, 4 * BS + 3), lease_s=5)
    computed = metric(c.prefill.url, "vllm:prompt_tokens_total")
    raw = grpc.insecure_channel(c.target, options=CHANNEL_OPTIONS)
    try:
        stub = worker_pb2_grpc.KVTransferStub(raw)
        forged = {
            "unsigned": None,
            "malformed": "t=1,v1=zz",
            "wrong key": sign(b"k" * 32, rpc_body(req), PREFILL_RPC),
            "another request": sign(WORKER_KEY, rpc_body(other), PREFILL_RPC),
            "an HTTP signature": sign(WORKER_KEY, rpc_body(req), None),
            "stale": sign(WORKER_KEY, rpc_body(req), PREFILL_RPC, now=time.time() - 600),
        }
        for name, signature in forged.items():
            metadata = None if signature is None else ((SIGNATURE_HEADER, signature),)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Prefill(req, metadata=metadata, timeout=30))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, info.value)
            assert "decode worker holding the key" in info.value.details(), name
        assert metric(c.prefill.url, "vllm:prompt_tokens_total") == computed  # nothing ran
        assert usage(c.prefill.url) == 0
        good = sign(WORKER_KEY, rpc_body(req), PREFILL_RPC)
        chunks = list(stub.Prefill(req, metadata=((SIGNATURE_HEADER, good),), timeout=60))
        assert chunks[-1].WhichOneof("kind") == "trailer"
        release = worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id)
        with pytest.raises(grpc.RpcError) as info:  # unsigned: anyone could unpin pages
            stub.ReleasePages(release, timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert worker_pb2_grpc.KVTransferStub(signing_channel(raw)).ReleasePages(
            release, timeout=10).released
    finally:
        raw.close()
