"""Disaggregated prefill for every architecture: a prefill engine and a decode engine of each
family's tiny checkpoint (tests/engine/test_architectures.py's, built once per session)
exchange prompts' KV pages over the `pd` connector and the gRPC KVTransfer service, whole
or layer by layer. The decode side's greedy tokens equal transformers' (as do the prefill
engine's own); it computes only each prompt's last token, and exactly the blocks it lacks
travel, each layers x (K, V) x KV heads x block_size x head_dim float32 values (head dims
16 and 24, windows shorter than the prompts, mixed local/global layers, experts). Gemma 3
also goes from a TP = 2 prefill engine to a TP = 1 decode engine."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from tandem import SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.protocol.web import PREFILL_HEADER
from tests.engine.test_architectures import BLOCK, CASES, MAX_NEW, Case, build_case
from tests.kvtransfer.test_kv_dtype import MODEL, PD

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FAMILIES = [n for n in CASES if n not in ("llama-yarn", "phi4-mini")]  # their kin run here


def _engine(path: str, tp: int = 1) -> AsyncLLMEngine:
    """Prompts run in chunks of 8 tokens: a sliding model's prefill side passes its window
    before the prompt ends (and must keep the blocks it sends). Page transfer runs on one
    block table (`kv_cache_groups=False`, as P/D workers set it: Gemma 3's layers)."""
    return AsyncLLMEngine(LLMEngine(EngineConfig(
        model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=48, num_threads=1,
        max_num_batched_tokens=8, served_model_name=MODEL, tensor_parallel_size=tp,
        kv_cache_groups=False)))


async def _greedy(engine: AsyncLLMEngine, prompt: list[int], rid: str) -> RequestOutput:
    _, q = await engine.add(prompt, GREEDY, rid)
    while not (out := await q.get()).finished:
        pass
    assert out.outputs[0].finish_reason == "length", out.error
    return out


def _block_bytes(path: str) -> int:
    """One block's pages on the wire, from the checkpoint's config.json."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * BLOCK * head_dim * 4


async def _prefill_remotely(case: Case, prefill: AsyncLLMEngine, decode: AsyncLLMEngine,
                            caplog: pytest.LogCaptureFixture) -> None:
    """Prompt 0, then prompt 2 (its first two blocks, shared with prompt 0, are already on
    the decode side), then prompt 1 sent layer by layer as the prefill engine writes each:
    transformers' greedy tokens on the decode side and on the prefill engine, one prompt
    token computed by the decode side, exactly the missing blocks moved."""
    jobs = [(0, False), (2, False), (1, True)]
    shared = 9 // BLOCK
    async with PD(prefill, decode) as pd:
        for i, streamed in jobs:
            prompt = case.prompts[i]
            pd.service.stream_layers = streamed
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="tandem.kvtransfer.service"):
                imported = await pd.imports.fetch({PREFILL_HEADER: pd.target}, decode,
                                                  f"pd-{i}", [prompt], "")
            assert len(imported) == 1, "computed on the decode side (see the log)"
            (imp,) = imported
            (sent,) = [r.getMessage() for r in caplog.records if " sent " in r.getMessage()]
            assert ("layer by layer" in sent) == streamed, sent
            try:
                got = await _greedy(decode, prompt, f"pd-{i}-0")
            finally:
                pd.imports.unpin(imported)
            assert got.outputs[0].token_ids == case.greedy[i], i
            assert got.num_cached_tokens == len(prompt) - 1, i  # one token computed here
            lacked = (len(prompt) - 1) // BLOCK - (shared if i == 2 else 0)
            assert imp.num_transferred == lacked, i
            tail = (len(prompt) - 1) % BLOCK  # the staged partial block's tokens
            assert imp.tail_tokens == tail, i
            assert imp.bytes == (lacked + bool(tail)) * _block_bytes(case.path), i
            local = await _greedy(prefill, prompt, f"agg-{i}")
            assert local.outputs[0].token_ids == case.greedy[i], i
        assert pd.fetches("ok") == len(jobs)


@pytest.mark.parametrize("name", FAMILIES)
def test_prefilled_remotely_every_family_decodes_transformers_tokens(name, tmp_path_factory,
                                                                     caplog):
    case = build_case(name, tmp_path_factory)
    prefill, decode = _engine(case.path), _engine(case.path)
    try:
        asyncio.run(_prefill_remotely(case, prefill, decode, caplog))
        if name == "mistral":  # every layer slides: the imported chain's head is freed
            assert decode.engine.stats().kv_window_freed_blocks > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_tp_prefill_engine_feeds_a_single_rank_decode_engine(tmp_path_factory, caplog):
    """Gemma 3 at TP = 2 on the prefill side (one KV head of 24 dims per rank, local and
    global layers; layer by layer, rank 0 gathers both ranks' heads) -> TP = 1."""
    case = build_case("gemma3", tmp_path_factory)
    prefill, decode = _engine(case.path, tp=2), _engine(case.path)
    try:
        asyncio.run(_prefill_remotely(case, prefill, decode, caplog))
    finally:
        prefill.shutdown()
        decode.shutdown()
