"""KV pages of a quantized cache: the header names the KV cache dtype (an older sender's
header without it means "auto"), a receiver refuses any other dtype than its own before a
byte touches its cache, pages of fp8/int8 caches (codes, then their float16 scales, in each page)
travel bit-exactly through both backends, and between two real engines with fp8 KV a
disaggregated request gives the aggregated worker's greedy tokens, while a pair whose KV
dtypes differ is refused and the decode side computes the prompt itself; a router does not
pair them where it knows both dtypes."""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
import pytest
import torch

from tandem import SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache.pages import gather_layer, scatter_layer
from tandem.engine.kv_cache.quant import dequantize_pages, quantize_pages
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.kvtransfer.base import SendJob
from tandem.kvtransfer.client import RemotePrefill, RemotePrefillSettings
from tandem.kvtransfer.grpc_backend import GrpcBackend, decode_chunk, serialize_chunk
from tandem.kvtransfer.pages import (
    KVTransferError,
    PageLayout,
    check_header,
    engine_layout,
    header_for,
    layer_page_views,
    tensor_bytes,
)
from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service
from tandem.protocol import worker_pb2
from tandem.protocol.block_hash import HashKeys, hash_block_chain
from tandem.protocol.web import PREFILL_HEADER
from tandem.router.pd import plan
from tandem.serving.metrics import ServerMetrics
from tandem.serving.pd import PrefillImports
from tests.engine.utils import make_tiny_model_dir
from tests.kvtransfer.fake_prefill import CHANNEL_OPTIONS, FakePrefillServer
from tests.kvtransfer.test_torch_backend import run as run_torch
from tests.kvtransfer.test_torch_backend import transfer as torch_transfer
from tests.router.test_pd_routing import MODEL as MODEL_R
from tests.router.test_pd_routing import W, build, parsed
from tests.serving.helpers import free_port

HASHES = [bytes([i]) * 32 for i in range(1, 4)]
KVH, BS, HD = 2, 4, 8


def layout(cache_dtype: str, dtype: torch.dtype = torch.float32, layers: int = 2
           ) -> PageLayout:
    store = torch.uint8 if cache_dtype != "auto" else dtype
    return PageLayout("m", layers, KVH, BS, HD, store, cache_dtype)


def quantized_caches(cache_dtype: str, layers: int, blocks: int, seed: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) `[blocks, KVH, BS * (HD + 2)]` uint8 pages quantized from random
    floats of widely varying magnitude (so the scales differ row by row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        kv = []
        for _ in range(2):
            x = torch.randn(blocks, KVH, BS, HD, generator=g)
            x *= torch.exp(4 * torch.randn(blocks, KVH, BS, 1, generator=g))
            kv.append(quantize_pages(x, cache_dtype))
        out.append((kv[0], kv[1]))
    return out


# -- layout and header ---------------------------------------------------------------------------

def test_a_quantized_layout_is_read_from_its_uint8_caches():
    caches = quantized_caches("fp8", 3, 5, seed=0)
    lay = PageLayout.of("m", caches, "fp8", BS)
    assert lay == PageLayout("m", 3, KVH, BS, HD, torch.uint8, "fp8")
    # a page: BS rows' codes, then their BS float16 scales
    assert (lay.code_bytes, lay.scale_bytes, lay.page_bytes, lay.row_bytes) == (
        BS * HD, 2 * BS, BS * (HD + 2), HD + 2)
    assert lay.page_shape == (BS * (HD + 2),)
    assert lay.block_layer_bytes == 2 * KVH * BS * (HD + 2) == 160
    assert lay.layer_shape(3) == (2, 3, KVH, BS * (HD + 2))
    f32, bf16 = layout("auto"), layout("auto", torch.bfloat16)
    assert (f32.page_shape, f32.scale_bytes, f32.block_layer_bytes, bf16.block_layer_bytes) == (
        (BS, HD), 0, 512, 256)
    assert PageLayout.of("m", [(torch.zeros(2, KVH, BS, HD),) * 2]) == layout("auto", layers=1)


@pytest.mark.parametrize(("cache_dtype", "tensor", "block_size", "why"), [
    ("fp8", torch.zeros(2, KVH, BS * (HD + 2)), BS, "cannot be stored as float32"),
    ("auto", torch.zeros(2, KVH, BS, HD, dtype=torch.uint8), None, "cannot be stored as uint8"),
    ("int8", torch.zeros(2, KVH, BS * 2, dtype=torch.uint8), BS, "has no head_dim"),
    ("int8", torch.zeros(2, KVH, BS * (HD + 2) + 1, dtype=torch.uint8), BS, "has no head_dim"),
    ("int8", torch.zeros(2, KVH, BS, HD + 2, dtype=torch.uint8), BS, "has no head_dim"),
    ("int8", torch.zeros(2, KVH, BS * (HD + 2), dtype=torch.uint8), None, "needs its block_s"),
    ("auto", torch.zeros(2, KVH, BS * HD), None, "is \\[blocks, kv_heads, block_size"),
    ("fp4", torch.zeros(2, KVH, BS, HD, dtype=torch.uint8), None, "must be one of"),
])
def test_caches_not_in_the_named_format_are_a_value_error(cache_dtype, tensor, block_size, why):
    with pytest.raises(ValueError, match=why):
        PageLayout.of("m", [(tensor, tensor)], cache_dtype, block_size)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "int8"])
def test_the_header_carries_the_kv_cache_dtype_through_the_wire(cache_dtype):
    lay = layout(cache_dtype)
    sent = header_for(lay, 1, HASHES[:2], "lease", 7, tail_tokens=3)
    got = worker_pb2.PageHeader.FromString(sent.SerializeToString())
    assert got.kv_cache_dtype == cache_dtype
    assert got.kv_page_format == (0 if cache_dtype == "auto" else 1)  # codes, then scales
    assert got.head_dim == HD  # the model's, whatever the row format
    assert got.dtype == ("float32" if cache_dtype == "auto" else "uint8")
    row_bytes = HD * 4 if cache_dtype == "auto" else HD + 2
    assert got.layer_bytes == 3 * 2 * KVH * BS * row_bytes  # 2 full blocks + the partial one
    offer = check_header(got, lay, 1, HASHES[:2], tail_tokens=3)
    assert (offer.num_full, offer.tail_tokens) == (2, 3)


@pytest.mark.parametrize(("sender", "receiver"), [
    ("fp8", "int8"), ("int8", "fp8"), ("fp8", "auto"), ("auto", "fp8"), ("int8", "auto"),
    ("auto", "int8")])
def test_a_header_of_another_kv_cache_dtype_is_refused(sender, receiver):
    header = header_for(layout(sender), 0, HASHES, "lease", 0)
    with pytest.raises(KVTransferError,
                       match=f"kv cache dtype {sender} on the sender, {receiver} here") as e:
        check_header(header, layout(receiver), 0, HASHES)
    assert e.value.reason == "invalid"


def test_a_header_without_the_field_is_an_auto_cache():
    """What an older sender writes: no field 13 at all."""
    header = header_for(layout("auto"), 0, HASHES, "lease", 0)
    header.ClearField("kv_cache_dtype")
    old = worker_pb2.PageHeader.FromString(header.SerializeToString())
    assert old.kv_cache_dtype == ""
    assert check_header(old, layout("auto"), 0, HASHES).num_full == 3
    with pytest.raises(KVTransferError, match="kv cache dtype auto on the sender, fp8 here"):
        check_header(old, layout("fp8"), 0, HASHES)
    # a quantized cache's pages claimed without the field: refused by their dtype name too
    header = header_for(layout("fp8"), 0, HASHES, "lease", 0)
    header.ClearField("kv_cache_dtype")
    with pytest.raises(KVTransferError, match="kv cache dtype auto on the sender, fp8 here"):
        check_header(header, layout("fp8"), 0, HASHES)


@pytest.mark.parametrize("cache_dtype", ["fp8", "int8"])
def test_quantized_pages_of_an_older_sender_are_refused(cache_dtype):
    """An older sender's quantized pages had each row's scale inline (no kv_page_format):
    the same sizes, other bytes, so the receiver refuses them before reading any."""
    header = header_for(layout(cache_dtype), 0, HASHES, "lease", 0)
    header.ClearField("kv_page_format")
    old = worker_pb2.PageHeader.FromString(header.SerializeToString())
    with pytest.raises(KVTransferError, match=f"{cache_dtype} pages in format 0 on the sender "
                       r"\(0: rows with their scale inline, an older version\), 1 here"):
        check_header(old, layout(cache_dtype), 0, HASHES)
    header.kv_page_format = 2
    with pytest.raises(KVTransferError, match="pages in format 2 on the sender"):
        check_header(header, layout(cache_dtype), 0, HASHES)


# -- pages ---------------------------------------------------------------------------------------

def grpc_pipe(job: SendJob):
    """The reply stream after the header as the receiver decodes it off the wire."""
    async def stream():
        async for msg in GrpcBackend().send(job):
            yield decode_chunk(serialize_chunk(msg))
    return stream()


@pytest.mark.parametrize("cache_dtype", ["fp8", "int8"])
def test_quantized_pages_travel_bit_exactly_codes_and_scales(cache_dtype):
    """Seeded random block sets of random caches, gathered (copied, and read in place) on
    one side, through the grpc backend, scattered into other block ids on the other side:
    every row's bytes arrive as they were, blocks not sent stay untouched."""
    layers, blocks = 3, 12
    for seed in range(4):
        rng = random.Random(seed)
        src = quantized_caches(cache_dtype, layers, blocks, seed)
        lay = PageLayout.of("m", src, cache_dtype, BS)
        n = rng.randint(1, 6)
        src_ids, dst_ids = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
        for layer in range(layers):
            pages = gather_layer(src, layer, src_ids)
            assert pages.shape == lay.layer_shape(n) and pages.dtype == torch.uint8
            for kv in range(2):
                assert torch.equal(pages[kv], src[layer][kv][src_ids])
            views = layer_page_views(src, layer, src_ids)
            assert b"".join(views) == bytes(tensor_bytes(pages))
        dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
        job = SendJob(worker_pb2.PrefillRequest(num_blocks=n), lay, src_ids,
                      lambda layer, ids=src_ids, c=src: gather_layer(c, layer, ids), 1e18,
                      (lambda layer, ids=src_ids, c=src: layer_page_views(c, layer, ids))
                      if seed % 2 else None)

        async def sink(layer, pages, dst=dst, ids=dst_ids):
            scatter_layer(dst, layer, ids, pages)

        asyncio.run(GrpcBackend().receive(job.request, lay, n, grpc_pipe(job), sink))
        untouched = sorted(set(range(blocks)) - set(dst_ids))
        for layer in range(layers):
            for kv in range(2):
                got, want = dst[layer][kv], src[layer][kv]
                assert torch.equal(got[dst_ids], want[src_ids])
                assert not got[untouched].any()
                assert torch.equal(
                    dequantize_pages(got[dst_ids], cache_dtype, BS, torch.float32),
                    dequantize_pages(want[src_ids], cache_dtype, BS, torch.float32))


def test_quantized_pages_through_the_torch_backend_over_gloo():
    lay = layout("int8", layers=3)
    src = quantized_caches("int8", 3, 9, seed=5)
    ids = [7, 0, 4, 2]
    pages = [gather_layer(src, layer, ids) for layer in range(3)]

    async def body(receiver, sender):
        got, _ = await torch_transfer(receiver, sender, pages, layout=lay)
        return got

    got = run_torch(body)
    for want, have in zip(pages, got, strict=True):
        assert have.dtype == torch.uint8 and have.shape == lay.layer_shape(4)
        assert torch.equal(have, want)


# -- between real engines ------------------------------------------------------------------------

MODEL = "tiny-kvq"
EBS = 4  # tokens per block of the engines below
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Async engines of one tiny random model: (prefill fp8, decode fp8, decode int8,
    aggregated fp8, aggregated int8)."""
    path = tmp_path_factory.mktemp("kvq")
    make_tiny_model_dir(path, "llama", seed=3)
    made = {}
    try:
        for name, kv in (("prefill", "fp8"), ("decode", "fp8"), ("decode_int8", "int8"),
                         ("single", "fp8"), ("single_int8", "int8")):
            made[name] = AsyncLLMEngine(LLMEngine(EngineConfig(
                model=str(path), block_size=EBS, num_kv_blocks=128, kv_cache_dtype=kv,
                num_threads=1, served_model_name=MODEL)))
        yield made
    finally:
        for e in made.values():
            e.shutdown()


async def greedy(engine: AsyncLLMEngine, prompt: list[int], rid: str) -> RequestOutput:
    _, q = await engine.add(prompt, GREEDY, rid)
    while not (out := await q.get()).finished:
        pass
    assert out.outputs[0].finish_reason == "length", out.error
    return out


class PD:
    """A prefill engine's KVTransfer service on a local gRPC port, and a decode engine's
    imports (`serving.pd.PrefillImports`, policy `recompute`) from it, in one event loop."""

    def __init__(self, prefill: AsyncLLMEngine | None, decode: AsyncLLMEngine,
                 backend: str = "grpc") -> None:
        self.prefill, self.decode, self.backend = prefill, decode, backend

    async def __aenter__(self) -> PD:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.service = KVTransferService(lambda: self.prefill, MODEL, "prefill")
        add_kv_transfer_service(self.server, self.service)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        settings = RemotePrefillSettings(backend=self.backend, timeout_s=30)
        self.remote = RemotePrefill(self.decode, MODEL, settings)
        self.metrics = ServerMetrics(MODEL, lambda: None)
        self.imports = PrefillImports(lambda: self.remote, settings, self.metrics, MODEL)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.remote.close()
        await self.service.close()
        await self.server.stop(0)

    def fetches(self, result: str) -> float:
        return self.metrics.registry.get_sample_value(
            "tandem_kvtransfer_fetches_total",
            {"model_name": MODEL, "result": result, "backend": self.backend}) or 0.0

    async def run(self, prompt: list[int], rid: str, target: str | None = None
                  ) -> tuple[RequestOutput, int]:
        """The request as the worker serves one naming a prefill worker: (its output, the
        page bytes imported)."""
        imported = await self.imports.fetch({PREFILL_HEADER: target or self.target},
                                            self.decode, rid, [prompt], "")
        try:
            return await greedy(self.decode, prompt, f"{rid}-0"), sum(i.bytes for i in imported)
        finally:
            self.imports.unpin(imported)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (EBS + 1, 7 * EBS, 45)]


@pytest.mark.parametrize("backend", ["grpc", "torch"])
def test_fp8_pages_between_engines_give_the_aggregated_tokens(engines, backend):
    """Greedy tokens through prefill (fp8) -> pages -> decode (fp8) equal an aggregated fp8
    engine's, token for token; the decode side computed only each prompt's last token, from
    pages of head_dim + 2 bytes per row (codes, and the row's scale after the page's codes)."""
    row = 16 + 2  # the tiny model's head_dim, plus the float16 scale
    block_bytes = 2 * 2 * 2 * EBS * row  # layers x (K, V) x kv heads x tokens x row

    async def main() -> None:
        async with PD(engines["prefill"], engines["decode"], backend) as pd:
            assert pd.remote.layout.cache_dtype == "fp8"
            for i, prompt in enumerate(prompts(7 if backend == "grpc" else 8)):
                want = await greedy(engines["single"], prompt, f"ref-{backend}-{i}")
                got, nbytes = await pd.run(prompt, f"pd-{backend}-{i}")
                assert got.outputs[0].token_ids == want.outputs[0].token_ids, i
                assert got.num_cached_tokens == len(prompt) - 1
                assert nbytes == -(-(len(prompt) - 1) // EBS) * block_bytes
            assert pd.fetches("ok") == 3

    asyncio.run(main())


def test_a_pair_of_different_kv_dtypes_is_refused_and_computed_locally(engines, caplog):
    """An int8 decode engine asking an fp8 prefill worker: refused before it computes
    anything; a sender that answers anyway with fp8 pages: its header is refused before a
    byte is written. Both times the request is answered by local prefill, with the int8
    aggregated engine's tokens."""
    fake = FakePrefillServer(free_port())
    fp8 = engine_layout(MODEL, engines["prefill"].engine)

    async def fp8_pages(request, context):
        first, num = request.first_block, request.num_blocks
        hashes = hash_block_chain(list(request.token_ids[: (first + num) * EBS]), EBS,
                                  HashKeys(MODEL, "", ""))[first:]
        yield worker_pb2.PageChunk(header=header_for(fp8, first, hashes, "fake", 0,
                                                     request.tail_tokens))
        yield worker_pb2.PageChunk(data=worker_pb2.PageData(data=bytes(64)))

    fake.behaviour = fp8_pages
    decode = engines["decode_int8"]

    async def main() -> None:
        async with PD(engines["prefill"], decode) as pd:
            for i, (prompt, target) in enumerate(zip(prompts(9)[1:], (None, fake.target),
                                                     strict=True)):
                want = await greedy(engines["single_int8"], prompt, f"ref-mixed-{i}")
                got, nbytes = await pd.run(prompt, f"mixed-{i}", target)
                assert got.outputs[0].token_ids == want.outputs[0].token_ids, i
                assert nbytes == 0 and got.num_cached_tokens == 0
            assert (pd.fetches("rpc"), pd.fetches("invalid"), pd.fetches("ok")) == (1, 1, 0)
            # the fp8 prefill worker computed (and so cached) nothing for the refused prompt
            chain = hash_block_chain(prompts(9)[1], EBS, HashKeys(MODEL, "", ""))
            held = await engines["prefill"]._call(lambda e: e.kv.cached_prefix(chain))
            assert held == []

    try:
        with caplog.at_level(logging.WARNING, logger="tandem.serving.pd"):
            asyncio.run(main())
    finally:
        fake.stop()
    assert fake.calls == 1
    text = caplog.text
    assert "kv cache dtype int8 on the decode worker, fp8 here" in text
    assert "kv cache dtype fp8 on the sender, int8 here" in text


# -- routing -------------------------------------------------------------------------------------

def test_the_router_pairs_a_decode_worker_only_with_prefill_workers_of_its_kv_dtype():
    prompt = parsed(320)
    router = build([W("d", role="decode"), W("p_int8", held=12), W("p_fp8", queue=3),
                    W("p_old", queue=5)], prompt)
    kv = {"d": "fp8", "p_int8": "int8", "p_fp8": "fp8", "p_old": None}
    workers = {w.id.removeprefix("http://").split(":")[0]: w for w in router.workers.values()}
    for name, w in workers.items():
        w.kv_cache_dtype = kv[name]
    # each plan below on a fresh prompt: the decode worker holds none of it
    route, _ = plan(router, prompt, MODEL_R, now=1.0)
    # the int8 one holds the prefix, but its pages would be refused: the fp8 one instead
    assert route.prefill.worker is workers["p_fp8"]
    kept = route.prefill
    workers["p_fp8"].ready = False  # gone: one of unknown dtype may serve
    route, _ = plan(router, parsed(320, seed=1), MODEL_R, now=1.1, keep_prefill=kept)
    assert route.prefill.worker is workers["p_old"]
    workers["p_old"].kv_cache_dtype = "auto"
    route, _ = plan(router, parsed(320, seed=2), MODEL_R, now=1.2)
    assert route.prefill is None and route.reason == "no_prefill_worker"
    # an earlier attempt's pick is not kept for a decode worker of another dtype
    workers["p_fp8"].ready, workers["d"].kv_cache_dtype = True, "int8"
    route, _ = plan(router, parsed(320, seed=3), MODEL_R, now=1.3, keep_prefill=kept)
    assert route.prefill.worker is workers["p_int8"]
