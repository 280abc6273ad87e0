"""Peer pulls between two real engines of a tiny random model over a real gRPC socket: a
worker told (`x-tandem-kv-peer`) that another holds a prompt's prefix pulls the blocks it
lacks (`cached_only`: the holder computes nothing, pins them under a lease it releases on
the acknowledgement) and computes only the rest, with exactly the tokens of a cold run
(greedy and seeded); a holder that has part or none of them, one that is dead, stalls or
sends damaged pages, all end in local computation with the same tokens, the right counter
and no block left pinned on either side."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import grpc
import pytest

from tandem import SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.kvtransfer.client import RemotePrefill, RemotePrefillSettings
from tandem.kvtransfer.pages import engine_layout, header_for
from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service
from tandem.protocol import worker_pb2
from tandem.protocol.block_hash import HashKeys, hash_block_chain
from tandem.protocol.web import PEER_BLOCKS_HEADER, PEER_HEADER, PREFILL_HEADER
from tandem.serving.errors import APIError
from tandem.serving.metrics import ServerMetrics
from tandem.serving.pd import PrefillImports
from tandem.serving.peer_pull import PullCosts, peer_hint
from tests.engine.utils import make_tiny_model_dir
from tests.kvtransfer.fake_prefill import CHANNEL_OPTIONS, FakePrefillServer
from tests.serving.helpers import free_port

MODEL = "tiny-pull"
BS = 4  # tokens per block
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(holder, receiver, cold): three engines of one tiny random model."""
    path = tmp_path_factory.mktemp("pull")
    make_tiny_model_dir(path, "llama", seed=5)
    made = {}
    try:
        for name in ("holder", "receiver", "cold"):
            made[name] = AsyncLLMEngine(LLMEngine(EngineConfig(
                model=str(path), block_size=BS, num_kv_blocks=128, num_threads=1,
                served_model_name=MODEL)))
        yield made
    finally:
        for e in made.values():
            e.shutdown()


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def generate(engine: AsyncLLMEngine, prompt: list[int], rid: str,
                   params: SamplingParams = GREEDY) -> RequestOutput:
    _, q = await engine.add(prompt, params, rid)
    while not (out := await q.get()).finished:
        pass
    assert out.outputs[0].finish_reason == "length", out.error
    return out


async def stats(engine: AsyncLLMEngine):
    return await engine._call(lambda e: e.stats())


async def leases_active(engine: AsyncLLMEngine) -> int:
    return await engine._call(lambda e: e.kv.lease_stats().active)


class Peers:
    """The holder's KVTransfer on a local port; the receiver's request path
    (`serving.pd.PrefillImports`, which hands peer headers to `PeerPulls`)."""

    def __init__(self, engines: dict, timeout_s: float = 30.0, backend: str = "grpc") -> None:
        self.holder, self.receiver = engines["holder"], engines["receiver"]
        self.timeout_s = timeout_s
        self.backend = backend

    async def __aenter__(self) -> Peers:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        # a decode-role holder: its cache serves pulls all the same
        self.service = KVTransferService(lambda: self.holder, MODEL, "decode")
        add_kv_transfer_service(self.server, self.service)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        settings = RemotePrefillSettings(timeout_s=self.timeout_s, backend=self.backend)
        self.remote = RemotePrefill(self.receiver, MODEL, settings)
        self.metrics = ServerMetrics(MODEL, lambda: None)
        self.imports = PrefillImports(lambda: self.remote, settings, self.metrics, MODEL)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.remote.close()
        await self.service.close()
        await self.server.stop(0)

    def pulls(self, result: str) -> float:
        return self.metrics.registry.get_sample_value(
            "tandem_kv_peer_pulls_total", {"model_name": MODEL, "result": result}) or 0.0

    def pulled_blocks(self) -> float:
        return self.metrics.registry.get_sample_value(
            "tandem_kv_peer_pulled_blocks_total", {"model_name": MODEL}) or 0.0

    async def run(self, prompt: list[int], rid: str, headers: dict | None = None,
                  params: SamplingParams = GREEDY) -> RequestOutput:
        """The request as the worker serves one with `headers` (default: naming the
        holder as its KV peer)."""
        headers = {PEER_HEADER: self.target} if headers is None else headers
        imported = await self.imports.fetch(headers, self.receiver, rid, [prompt], "")
        try:
            return await generate(self.receiver, prompt, f"{rid}-0", params)
        finally:
            self.imports.unpin(imported)

    async def settled(self) -> None:
        """No lease left on the holder and no block in use on the receiver (within 5 s)."""
        deadline = time.monotonic() + 5
        while (await leases_active(self.holder) or (await stats(self.receiver)).kv_cache_usage):
            assert time.monotonic() < deadline, "pins were left behind"
            await asyncio.sleep(0.02)


@pytest.mark.parametrize(("params", "backend"),
                         [(GREEDY, "grpc"), (SEEDED, "grpc"), (GREEDY, "shm")],
                         ids=["greedy", "seeded", "greedy-shm"])
def test_a_pulled_prefix_gives_the_cold_tokens_and_the_holder_computes_nothing(
        engines, params, backend, caplog):
    """Over gRPC, and over shared memory (holder and puller share this node)."""
    seed = (10 if params is GREEDY else 20) + (100 if backend == "shm" else 0)
    doc = ids(seed, 13 * BS)
    prompt = doc + ids(seed + 1, 3)  # 13 full blocks + 2 tokens before the last one
    caplog.set_level(logging.INFO, logger="tandem.kvtransfer.pull_service")

    async def main() -> None:
        async with Peers(engines, backend=backend) as peers:
            await generate(peers.holder, doc + ids(seed + 2, 3), f"warm-{seed}")  # holds doc
            want = await generate(engines["cold"], prompt, f"cold-{seed}", params)
            before = await stats(peers.holder)
            got = await peers.run(prompt, f"pull-{seed}", params=params)
            after = await stats(peers.holder)
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.num_cached_tokens == 13 * BS  # the pulled tokens count as cached
            assert (peers.pulls("pulled"), peers.pulled_blocks()) == (1, 13)
            # the holder ran no request: no prompt token, no lookup, no sampled token
            assert (after.prompt_tokens, after.prefix_cache_queries,
                    after.generation_tokens) == (before.prompt_tokens,
                                                 before.prefix_cache_queries,
                                                 before.generation_tokens)
            await peers.settled()  # the acknowledgement released the holder's lease
            assert peers.imports.peer.costs.s_per_block > 0
            # pulled blocks are the receiver's own cache now: a repeat hits them locally
            again = await peers.run(prompt, f"again-{seed}", {}, params)
            assert again.outputs[0].token_ids == want.outputs[0].token_ids
            assert again.num_cached_tokens == 13 * BS
            assert peers.pulls("pulled") == 1  # no peer named: nothing asked

    asyncio.run(main())
    sent = [r.getMessage() for r in caplog.records if "peer pull: sent" in r.getMessage()]
    assert len(sent) == 1 and f"({backend})" in sent[0], sent


def test_part_held_none_held_and_a_local_head_start(engines):
    """The holder has 5 of the 12 missing blocks: those are pulled (`partial`), the rest
    computed here; it has none: `none_held`; the receiver holds the first 4 itself: only
    blocks from there on are asked for."""
    doc = ids(30, 12 * BS)

    async def main() -> None:
        async with Peers(engines) as peers:
            await generate(peers.holder, doc[: 5 * BS] + [7], "warm-part")
            cases = {"partial": (doc + ids(31, 5), 5 * BS), "none_held": (ids(32, 40), 0)}
            for result, (prompt, cached) in cases.items():
                want = await generate(engines["cold"], prompt, f"cold-{result}")
                got = await peers.run(prompt, result)
                assert got.outputs[0].token_ids == want.outputs[0].token_ids, result
                assert got.num_cached_tokens == cached, result
                assert peers.pulls(result) == 1, result
            await peers.settled()

            head = ids(40, 10 * BS)
            await generate(peers.receiver, head[: 4 * BS] + [9], "local-head")
            await generate(peers.holder, head + [9], "warm-head")
            prompt = head + ids(41, 3)
            want = await generate(engines["cold"], prompt, "cold-head")
            blocks = peers.pulled_blocks()
            got = await peers.run(prompt, "head")
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.num_cached_tokens == 10 * BS
            assert peers.pulled_blocks() == blocks + 6  # blocks 4..9 only
            # a router hint: as many blocks as it said is a full pull, not a partial one
            doc2 = ids(35, 8 * BS)
            await generate(peers.holder, doc2[: 5 * BS] + [7], "warm-hint")
            prompt = doc2 + ids(36, 5)
            want = await generate(engines["cold"], prompt, "cold-hint")
            got = await peers.run(prompt, "hint", {PEER_HEADER: peers.target,
                                                   PEER_BLOCKS_HEADER: "5"})
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.num_cached_tokens == 5 * BS
            assert peers.pulls("pulled") == 2 and peers.pulls("partial") == 1
            # a router hint that the peer holds no more than here skips the call
            prompt = head[: 4 * BS] + ids(42, 30)
            await peers.run(prompt, "hinted", {PEER_HEADER: peers.target,
                                               PEER_BLOCKS_HEADER: "3"})
            assert peers.pulls("pulled") == 2 and peers.pulls("none_held") == 1
            await peers.settled()

    asyncio.run(main())


def test_dead_stalled_and_damaging_peers_are_computed_locally(engines):
    fake = FakePrefillServer(free_port())
    lay = engine_layout(MODEL, engines["receiver"].engine)

    async def damaged(request, context):  # a valid header, then pages not matching digests
        first, num = request.first_block, request.num_blocks
        hashes = hash_block_chain(list(request.token_ids[: (first + num) * BS]), BS,
                                  HashKeys(MODEL, "", ""))[first:]
        yield worker_pb2.PageChunk(header=header_for(lay, first, hashes, "fake", 0))
        for layer in range(lay.num_layers):
            yield worker_pb2.PageChunk(data=worker_pb2.PageData(
                layer=layer, offset=0, data=bytes(num * lay.block_layer_bytes)))
            yield worker_pb2.PageChunk(layer_end=worker_pb2.PageLayerEnd(layer=layer,
                                                                        xxh3_64=12345))

    async def stalls(request, context):
        await asyncio.Event().wait()
        yield worker_pb2.PageChunk()  # pragma: no cover

    async def main() -> None:
        async with Peers(engines, timeout_s=1.0) as peers:
            cases = [("failed", f"127.0.0.1:{free_port()}", None),  # nobody listens
                     ("failed", fake.target, damaged),
                     ("timeout", fake.target, stalls)]
            for i, (result, target, behaviour) in enumerate(cases):
                fake.behaviour = behaviour
                counted = peers.pulls(result)
                prompt = ids(50 + i, 9 * BS + 2)
                want = await generate(engines["cold"], prompt, f"cold-bad-{i}")
                t0 = time.monotonic()
                got = await peers.run(prompt, f"bad-{i}", {PEER_HEADER: target})
                assert time.monotonic() - t0 < 10
                assert got.outputs[0].token_ids == want.outputs[0].token_ids, i
                assert got.num_cached_tokens == 0, i  # no damaged page was served
                assert peers.pulls(result) == counted + 1, i
                await peers.settled()
            assert (peers.pulls("failed"), peers.pulls("timeout")) == (2, 1)
            assert peers.pulled_blocks() == 0

    try:
        asyncio.run(main())
    finally:
        fake.stop()


def test_random_pulls_and_cancellations_leave_no_lease_or_pin(engines):
    """Seeded: pulls that succeed, find nothing held, hit a dead or a stalling peer, or whose
    request is cancelled at a random point (in the pull or after it): after each, no lease is
    left on the holder and no block in use on the receiver."""
    fake = FakePrefillServer(free_port())

    async def stalls(request, context):
        await asyncio.Event().wait()
        yield worker_pb2.PageChunk()  # pragma: no cover

    fake.behaviour = stalls
    dead = f"127.0.0.1:{free_port()}"

    async def main() -> None:
        rng = random.Random(2042)
        async with Peers(engines, timeout_s=1.0) as peers:
            for i in range(14):
                kind = rng.choice(["held", "none", "dead", "stall", "cancel", "cancel"])
                doc = ids(900 + i, rng.randrange(3, 9) * BS)
                if kind != "none":
                    await generate(peers.holder, doc + [7], f"warm-rnd-{i}")
                prompt = doc + ids(2000 + i, rng.randrange(2, 6))
                target = {"dead": dead, "stall": fake.target}.get(kind, peers.target)
                # "partial": a suffix of BS tokens or more is a full block no peer holds
                before = peers.pulls("pulled") + peers.pulls("partial")
                task = asyncio.ensure_future(peers.run(prompt, f"rnd-{i}",
                                                       {PEER_HEADER: target}))
                if kind == "cancel":
                    await asyncio.sleep(rng.uniform(0.0, 0.04))
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    got = await task
                    # what was counted pulled was served (a busy machine may time out)
                    pulled = peers.pulls("pulled") + peers.pulls("partial") > before
                    assert pulled <= (kind in ("held", "cancel")), (i, kind)
                    assert got.num_cached_tokens == (len(doc) if pulled else 0), (i, kind)
                await peers.settled()
            assert peers.pulls("pulled") >= 1

    try:
        asyncio.run(main())
    finally:
        fake.stop()


def test_p_d_wins_over_a_peer_and_bad_peer_headers(engines):
    async def main() -> None:
        async with Peers(engines) as peers:
            prompt = ids(60, 6 * BS + 1)
            await generate(peers.holder, prompt, "warm-pd")
            # both named: the P/D fetch runs (a decode-role "prefill" worker refuses it and
            # the prompt is computed here); the peer is not asked
            await peers.run(prompt, "both", {PREFILL_HEADER: peers.target,
                                             PEER_HEADER: peers.target})
            assert peers.pulls("ignored") == 1 and peers.pulled_blocks() == 0

            with pytest.raises(APIError) as err:
                await peers.imports.fetch({PEER_HEADER: "no-port"}, peers.receiver, "bad",
                                          [prompt], "")
            assert err.value.status == 400 and err.value.param == PEER_HEADER
            await peers.settled()

    asyncio.run(main())


def test_a_cached_only_call_sends_full_blocks_only_and_says_how_many(engines):
    """Straight to the holder's gRPC: the header names the leading held run, its pages are
    pinned until ReleasePages, and a cached-only request for a partial block is refused."""
    async def main() -> None:
        async with Peers(engines) as peers:
            prompt = ids(70, 6 * BS + 1)
            await generate(peers.holder, prompt[: 3 * BS] + [5], "warm-rpc")
            async with grpc.aio.insecure_channel(peers.target, options=CHANNEL_OPTIONS) as ch:
                call = ch.unary_stream("/tandem.v1.KVTransfer/Prefill",
                                       request_serializer=worker_pb2.PrefillRequest
                                       .SerializeToString,
                                       response_deserializer=worker_pb2.PageChunk.FromString)
                req = worker_pb2.PrefillRequest(
                    request_id="r", model_id=MODEL, token_ids=prompt, block_size=BS,
                    first_block=1, num_blocks=5, backend="grpc", cached_only=True)
                chunks = [c async for c in call(req, timeout=10)]
                head = chunks[0].header
                assert (head.first_block, len(head.block_hashes)) == (1, 2)  # blocks 1, 2
                assert chunks[-1].WhichOneof("kind") == "trailer"
                assert await leases_active(peers.holder) == 1  # until acknowledged
                release = ch.unary_unary("/tandem.v1.KVTransfer/ReleasePages",
                                         request_serializer=worker_pb2.ReleasePagesRequest
                                         .SerializeToString,
                                         response_deserializer=worker_pb2.ReleasePagesResponse
                                         .FromString)
                ack = await release(worker_pb2.ReleasePagesRequest(lease_id=head.lease_id))
                assert ack.released
                await peers.settled()
                req.tail_tokens = 2
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [c async for c in call(req, timeout=10)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())


def test_pull_costs_and_the_hint_header():
    costs = PullCosts()
    costs.observe(0.4, 0)
    assert costs.s_per_block == 0.0
    costs.observe(0.4, 4)
    assert costs.s_per_block == pytest.approx(0.1)
    costs.observe(0.2, 1)
    assert costs.s_per_block == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))
    assert [peer_hint(h) for h in ({}, {PEER_BLOCKS_HEADER: "12"}, {PEER_BLOCKS_HEADER: "-1"},
                                   {PEER_BLOCKS_HEADER: "1" * 12})] == [None, 12, None, None]
