"""Disaggregated prefill with LoRA adapters between two real engines: the prefill worker
computes the prompt with the adapter the request names (the `lora_name` of the Prefill
call), its pages are hashed under that adapter on both sides, and the decode side's greedy
tokens equal the merged-weights model's; a prefill worker without the adapter refuses
before computing and the decode side computes the prompt itself; the base model's request
for the same prompt never receives the adapter's pages."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from tandem import SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.kvtransfer.client import RemotePrefill, RemotePrefillSettings
from tandem.kvtransfer.service import KVTransferService, add_kv_transfer_service
from tandem.protocol.web import PREFILL_HEADER
from tandem.serving.metrics import ServerMetrics
from tandem.serving.pd import PrefillImports
from tests.engine.utils import make_peft_adapter, make_tiny_model_dir, merge_adapter
from tests.kvtransfer.fake_prefill import CHANNEL_OPTIONS

MODEL = "tiny-lora"
BS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Async engines of one tiny model: prefill and decode with adapter `sql` (the prefill
    one also without it, and with other weights loaded as `sql`), and the merged `sql`
    model and the base model alone."""
    root = tmp_path_factory.mktemp("lora-pd")
    base = root / "base"
    make_tiny_model_dir(base, "llama", seed=4)
    cfg = json.loads((base / "config.json").read_text())
    w = make_peft_adapter(root / "sql", cfg, rank=8, alpha=16.0, seed=9)
    make_peft_adapter(root / "sql-other", cfg, rank=8, alpha=16.0, seed=10)
    merge_adapter(base, root / "merged", w, 2.0)
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8,
                lora_modules={"sql": str(root / "sql")})
    made = {}

    def engine(path, **kw) -> AsyncLLMEngine:
        return AsyncLLMEngine(LLMEngine(EngineConfig(
            model=str(path), block_size=BS, num_kv_blocks=128, num_threads=1,
            served_model_name=MODEL, **kw)))

    try:
        made["prefill"] = engine(base, **lora)
        made["decode"] = engine(base, **lora)
        made["prefill_plain"] = engine(base, enable_lora=True, max_lora_rank=8)
        made["prefill_other"] = engine(base, enable_lora=True, max_lora_rank=8,
                                       lora_modules={"sql": str(root / "sql-other")})
        made["merged"] = engine(root / "merged")
        made["base"] = engine(base)
        yield made
    finally:
        for e in made.values():
            e.shutdown()


async def greedy(engine: AsyncLLMEngine, prompt: list[int], rid: str,
                 lora: str | None = None) -> RequestOutput:
    _, q = await engine.add(prompt, GREEDY, rid, lora_name=lora)
    while not (out := await q.get()).finished:
        pass
    assert out.outputs[0].finish_reason == "length", out.error
    return out


async def disaggregated(prefill: AsyncLLMEngine, decode: AsyncLLMEngine,
                        jobs: list[tuple[list[int], str | None]]
                        ) -> tuple[list[tuple[RequestOutput, int]], ServerMetrics]:
    """Each (prompt, adapter) as a decode worker serves a request naming `prefill`'s
    KVTransfer service: (its output, page bytes imported) per job."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    service = KVTransferService(lambda: prefill, MODEL, "prefill")
    add_kv_transfer_service(server, service)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    settings = RemotePrefillSettings(backend="grpc", timeout_s=30)
    remote = RemotePrefill(decode, MODEL, settings)
    metrics = ServerMetrics(MODEL, lambda: None)
    imports = PrefillImports(lambda: remote, settings, metrics, MODEL)
    out = []
    try:
        for i, (prompt, lora) in enumerate(jobs):
            rid = f"pd-{id(prefill)}-{i}"
            imported = await imports.fetch({PREFILL_HEADER: target}, decode, rid, [prompt],
                                           "", lora)
            nbytes = sum(x.bytes for x in imported)
            try:
                got = await greedy(decode, prompt, f"{rid}-0", lora)
            finally:
                imports.unpin(imported)
            out.append((got, nbytes))
    finally:
        await remote.close()
        await service.close()
        await server.stop(0)
    return out, metrics


def test_adapter_prompts_prefilled_remotely_give_the_merged_tokens(engines):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (9, 23, 30)]

    async def main() -> None:
        jobs = [(p, "sql") for p in prompts] + [(prompts[1], None)]
        results, _ = await disaggregated(engines["prefill"], engines["decode"], jobs)
        for i, (got, nbytes) in enumerate(results):
            prompt, lora = jobs[i]
            ref = engines["merged"] if lora else engines["base"]
            want = await greedy(ref, prompt, f"ref-{i}")
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, i
            assert nbytes > 0 and got.num_cached_tokens == len(prompt) - 1, i
        # the base request's pages were its own: the adapter's never answer for it
        assert results[-1][0].outputs[0].token_ids != results[1][0].outputs[0].token_ids

    asyncio.run(main())


@pytest.mark.parametrize(("prefill", "seed", "why"), [
    ("prefill_plain", 6, "is not loaded here"),
    # the same name with other weights: its pages would carry KV of other weights
    ("prefill_other", 7, "has other weights here"),
])
def test_a_prefill_worker_without_the_adapters_weights_refuses_and_decode_computes(
        engines, caplog, prefill, seed, why):
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 49152) for _ in range(21)]
    if prefill == "prefill_other":
        assert engines[prefill].engine.lora.digests["sql"] != \
            engines["decode"].engine.lora.digests["sql"]

    async def main() -> None:
        [(got, nbytes)], metrics = await disaggregated(engines[prefill], engines["decode"],
                                                       [(prompt, "sql")])
        want = await greedy(engines["merged"], prompt, f"ref-{prefill}")
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert nbytes == 0 and got.num_cached_tokens == 0
        assert metrics.registry.get_sample_value("tandem_kvtransfer_fetches_total", {
            "model_name": MODEL, "result": "rpc", "backend": "grpc"}) == 1

    asyncio.run(main())
    assert why in caplog.text
