"""Disaggregated prefill between engines of different tensor-parallel sizes: the wire
carries every KV head of a page whatever either side's TP size, a TP prefill engine gathers
them from its ranks (`LLMEngine.export_kv`) and a TP decode engine hands each rank its own
heads (`import_kv`). Prefill at TP = 2 -> decode at TP = 1, the reverse, and TP = 3 -> 2
(12 query heads, 6 KV heads: 3 per rank vs 2) each give the aggregated TP = 1 engine's
greedy tokens, with the prompt's pages imported (the decode side computes only the last
prompt token). A TP = 2 prefill worker with `stream_layers` sends each layer as soon as its
ranks have written it (rank 0 gathers the heads layer by layer in the prompt's last step)
and gives the same tokens."""

from __future__ import annotations

import asyncio
import functools
import logging
import random

import pytest

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_connector.pd import PDWorker
from tandem.engine.llm_engine import LLMEngine
from tandem.kvtransfer.service import KVTransferService
from tests.engine.utils import make_tiny_model_dir
from tests.kvtransfer import test_lora_pd
from tests.kvtransfer.test_lora_pd import MODEL, disaggregated, greedy

SHAPE = dict(hidden_size=96, intermediate_size=192, num_attention_heads=12,
             num_key_value_heads=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp-pd") / "tiny"
    make_tiny_model_dir(path, "llama", seed=8, **SHAPE)
    return str(path)


def _engine(path: str, tp: int) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(EngineConfig(
        model=path, block_size=4, num_kv_blocks=96, num_threads=1, served_model_name=MODEL,
        tensor_parallel_size=tp)))


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (3, 2)])
def test_prefill_and_decode_at_different_tp_sizes(tiny: str, prefill_tp: int,
                                                  decode_tp: int) -> None:
    rng = random.Random(prefill_tp * 10 + decode_tp)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (6, 17, 29)]
    made = [_engine(tiny, 1), _engine(tiny, prefill_tp), _engine(tiny, decode_tp)]
    ref, prefill, decode = made

    async def main() -> None:
        results, _ = await disaggregated(prefill, decode, [(p, None) for p in prompts])
        await _equal_to_aggregated(ref, prompts, results)

    try:
        asyncio.run(main())
    finally:
        for e in made:
            e.shutdown()


async def _equal_to_aggregated(ref, prompts: list[list[int]], results: list) -> None:  # noqa: ANN001
    """Each disaggregated answer has the aggregated engine `ref`'s greedy tokens, with pages
    shipped and every prompt token but the last taken from them."""
    for i, (got, nbytes) in enumerate(results):
        want = await greedy(ref, prompts[i], f"ref-{i}")
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, i
        assert nbytes > 0 and got.num_cached_tokens == len(prompts[i]) - 1, i


def test_a_tp_prefill_worker_streams_layer_by_layer(tiny: str, monkeypatch, caplog) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (6, 17, 29)]
    monkeypatch.setattr(test_lora_pd, "KVTransferService",
                        functools.partial(KVTransferService, stream_layers=True))
    saved: list[tuple[int, tuple[int, ...] | None]] = []  # (layer, gathered pages' shape)
    save = PDWorker.save_kv_layer

    def record(self, request_id, layer, event, pages=None) -> None:
        saved.append((layer, None if pages is None else tuple(pages.shape)))
        save(self, request_id, layer, event, pages)

    monkeypatch.setattr(PDWorker, "save_kv_layer", record)
    made = [_engine(tiny, 1), _engine(tiny, 2), _engine(tiny, 1)]
    ref, prefill, decode = made

    async def main() -> None:
        with caplog.at_level(logging.INFO, logger="tandem.kvtransfer.service"):
            results, _ = await disaggregated(prefill, decode, [(p, None) for p in prompts])
        sent = [r.getMessage() for r in caplog.records if " sent " in r.getMessage()]
        assert len(sent) == len(prompts) and all("layer by layer" in m for m in sent), sent
        await _equal_to_aggregated(ref, prompts, results)

    try:
        asyncio.run(main())
        # every layer of each prompt's last step, in order, with all 6 KV heads of each of its
        # blocks gathered from the two ranks (3 heads each)
        layers = prefill.engine.arch.num_layers
        assert [layer for layer, _ in saved] == list(range(layers)) * len(prompts)
        blocks = [-(-len(p) // 4) for p in prompts]  # its block table: the prompt's blocks
        assert [shape[:3] for _, shape in saved] == [
            (2, n, 6) for n in blocks for _ in range(layers)]
    finally:
        for e in made:
            e.shutdown()
