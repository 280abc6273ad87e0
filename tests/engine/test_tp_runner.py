"""One `ModelRunner` forward on every tensor-parallel rank (`rank_runner.RankRunner`):
ranks > 0 run the same forward from the step plan alone, so LoRA adapters and the decode
graphs compose with tensor parallelism, and the logits are gathered to rank 0 only.

- The bundled SmolLM2 at TP = 3 with two random PEFT adapters (each rank holding its shard:
  B's rows of q/k/v/gate/up, A's columns of o/down) and base requests in one batch gives
  exactly TP = 1's greedy tokens, the adapters' identities (digests) unchanged.
- A tiny model at TP = 2 with LoRA and the static decode buffers (`TANDEM_STATIC_DECODE=1`,
  the CPU stand-in for CUDA graphs) gives an eager TP = 1 engine's tokens, its base-only
  decode steps replayed over the static buffers.
- Adapter shards: the ranks' partial updates sum to the whole adapter's; the LORA_LOAD wire
  form round-trips and refuses malformed plans.
- `ParallelLMHead` gathers the logits to rank 0 (None elsewhere) over real gloo groups.
- `ModelRunner.timings` counts each step's host seconds.
"""

from __future__ import annotations

import datetime
import json
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tandem.engine.cuda_graphs import STATIC_DECODE_ENV
from tandem.engine.llm import LLM
from tandem.engine.lora.request import LoRARequest
from tandem.engine.lora.slots import (
    adapter_data,
    adapter_from_wire,
    adapter_ids,
    shard_adapter,
    wire_size,
)
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.parallel.tp import ParallelLMHead, TPGroup, TPPlan
from tandem.engine.sampling_params import SamplingParams
from tests.engine.utils import make_peft_adapter, make_tiny_model_dir

SHAPE = dict(hidden_size=96, intermediate_size=192, num_attention_heads=12,
             num_key_value_heads=6, vocab_size=512)
ENGINE = dict(block_size=4, num_kv_blocks=64, max_model_len=128, num_threads=1,
              dtype="float32")
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


def _adapters(root, cfg: dict, std: float) -> dict[str, LoRARequest]:
    """Two random adapters: every linear at rank 8, and q/v/down only at rank 4."""
    make_peft_adapter(root / "one", cfg, rank=8, alpha=16.0, seed=4, std=std)
    make_peft_adapter(root / "two", cfg, rank=4, alpha=8.0, seed=5, std=2 * std,
                      targets=("q_proj", "v_proj", "down_proj"))
    return {"one": LoRARequest("one", 1, str(root / "one")),
            "two": LoRARequest("two", 2, str(root / "two"))}


def _generate(llm: LLM, prompts: list, params: list, loras: list) -> list[list[int]]:
    return [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, lora_request=loras)]


def test_bundled_model_tp3_with_adapters_matches_tp1(bundled_gguf, tmp_path) -> None:
    """The real model (9 heads, 3 KV heads: one per rank): two adapters and the base model
    in one batch, TP = 3 tokens equal TP = 1's; rank 0 holds a third of the weights."""
    args = dict(num_kv_blocks=96, max_model_len=256, num_threads=1, **LORA)
    one = LLM(**args)
    arch = one.engine.arch
    cfg = {"hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
           "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
           "head_dim": arch.head_dim, "num_hidden_layers": arch.num_layers}
    reqs = _adapters(tmp_path, cfg, std=0.05)
    texts = ["The capital of France is", "def fibonacci(n):", "Tensor parallelism splits"]
    prompts = texts * 3
    loras = [reqs["one"]] * 3 + [reqs["two"]] * 3 + [None] * 3
    params = [SamplingParams(max_tokens=8, temperature=0.0)] * 9
    ref = _generate(one, prompts, params, loras)
    assert ref[0:3] != ref[6:9] and ref[3:6] != ref[6:9]  # each adapter changes the output
    digests = {n: one.engine.lora.digest(n) for n in reqs}
    whole = one.model_memory_bytes()
    del one
    llm = LLM(tensor_parallel_size=3, **args)
    try:
        got = _generate(llm, prompts, params, loras)
        assert {n: llm.engine.lora.digest(n) for n in reqs} == digests
        mine = llm.model_memory_bytes()
    finally:
        llm.engine.shutdown()
    assert got == ref
    # rank 0 holds a third of the weights (the norms whole): sharded while loading
    assert whole / 3 <= mine < whole / 3 * 1.01, (whole, mine)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, dict[str, LoRARequest]]:
    root = tmp_path_factory.mktemp("tp_runner")
    make_tiny_model_dir(root / "base", "llama", seed=5, **SHAPE)
    cfg = json.loads((root / "base" / "config.json").read_text())
    return str(root / "base"), _adapters(root, cfg, std=0.3)


def _tiny_batch(reqs: dict[str, LoRARequest]) -> tuple[list, list, list]:
    """Adapter requests stop after 4 tokens, base ones run to 12: the last decode steps
    hold base requests only (the static path's steps)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(4, 20, 6)]
    loras = [reqs["one"], None, reqs["two"], None, reqs["one"], reqs["two"]]
    params = [SamplingParams(max_tokens=12 if lora is None else 4, temperature=0.0,
                             ignore_eos=True) for lora in loras]
    return prompts, params, loras


def test_tiny_tp2_lora_with_static_decode_matches_eager_tp1(tiny, monkeypatch) -> None:
    path, reqs = tiny
    prompts, params, loras = _tiny_batch(reqs)
    ref = _generate(LLM(path, **ENGINE, **LORA), prompts, params, loras)
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")  # the ranks inherit it when spawned
    llm = LLM(path, tensor_parallel_size=2, attention_backend="triton", cuda_graph_sizes=(2, 4),
              **ENGINE, **LORA)
    try:
        got = _generate(llm, prompts, params, loras)
        runs = sum(llm.engine.runner.graphs.runs.values())
    finally:
        llm.engine.shutdown()
    assert got == ref
    assert runs >= 8  # base-only decode steps ran over the static buffers


def test_runner_timings_count_every_step(tiny) -> None:
    path, _ = tiny
    llm = LLM(path, **ENGINE)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    t = llm.engine.runner.timings
    assert t.steps == 5  # the prompt's step, then four decodes
    assert t.prepare_s > 0 and t.forward_s > 0 and t.sample_s > 0


ARCH = ModelArchConfig(architecture="llama", vocab_size=97, hidden_size=48,
                       intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=6,
                       head_dim=8, max_position_embeddings=64)


def _random_adapter(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    d, h, i = ARCH.head_dim, ARCH.hidden_size, ARCH.intermediate_size
    shapes = {"q_proj": (6 * d, h), "k_proj": (6 * d, h), "v_proj": (6 * d, h),
              "o_proj": (h, 6 * d), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    return {(layer, t): (torch.randn(r, n_in, generator=gen), torch.randn(n_out, r, generator=gen))
            for layer in range(2) for r, (t, (n_out, n_in)) in enumerate(shapes.items(), 1)}


@pytest.mark.parametrize("world", [2, 3])
def test_adapter_shards_sum_to_the_whole_update(world: int) -> None:
    """Column-parallel targets: the ranks' output rows concatenated; row-parallel ones: the
    ranks' partial products summed (what the all-reduce adds up) equal x A^T B^T."""
    weights = _random_adapter(0)
    x = torch.randn(5, ARCH.hidden_size)
    plans = [TPPlan.build(ARCH, r, world) for r in range(world)]
    shards = [shard_adapter(weights, ARCH, p) for p in plans]
    for (layer, target), (a, b) in weights.items():
        if target in ("o_proj", "down_proj"):
            xin = torch.randn(5, a.shape[1])
            n = a.shape[1] // world
            parts = [xin[:, p * n:(p + 1) * n] @ s[(layer, target)][0].T @ s[(layer, target)][1].T
                     for p, s in enumerate(shards)]
            torch.testing.assert_close(sum(parts), xin @ a.T @ b.T)
            assert all(s[(layer, target)][1] is b for s in shards)  # B whole
        else:
            rows = torch.cat([x @ s[(layer, target)][0].T @ s[(layer, target)][1].T
                              for s in shards], dim=1)
            torch.testing.assert_close(rows, x @ a.T @ b.T)
            assert all(s[(layer, target)][0] is a for s in shards)  # A whole


def test_lora_load_wire_round_trips_and_refuses_malformed_plans() -> None:
    weights = _random_adapter(1)
    ids = np.array(adapter_ids(1, weights), dtype=np.int64)
    data = adapter_data(weights)
    assert wire_size(ids, ARCH, 2, 8) == data.numel()
    slot, back = adapter_from_wire(ids, data, ARCH, 2, 8)
    assert slot == 1 and back.keys() == weights.keys()
    for key, (a, b) in weights.items():
        assert torch.equal(back[key][0], a) and torch.equal(back[key][1], b)
    bad = [ids[:-1],  # not whole (layer, target, rank) triples
           np.concatenate([[2], ids[1:]]),  # slot 2 of 2
           np.concatenate([ids[:1], [2, 0, 1]]),  # layer 2 of 2
           np.concatenate([ids[:1], [0, 7, 1]]),  # target 7 of 7
           np.concatenate([ids[:1], [0, 0, 9]])]  # rank 9 above max_lora_rank 8
    for b in bad:
        with pytest.raises(ValueError, match="malformed LoRA load plan"):
            wire_size(b, ARCH, 2, 8)
    with pytest.raises(ValueError, match="elements"):
        adapter_from_wire(ids, torch.cat([data, torch.zeros(1)]), ARCH, 2, 8)


def test_logits_are_gathered_to_rank_zero_only() -> None:
    """Three ranks (threads, each its own gloo process group over one store): rank 0 gets
    every rank's vocabulary rows in rank order, cut to the vocabulary; the others None."""
    world = 3
    store = dist.HashStore()
    heads = []
    for rank in range(world):
        torch.manual_seed(rank)
        heads.append(torch.nn.Linear(4, 3, bias=False))  # each rank's 3 vocabulary rows
    h = torch.arange(8.0).view(2, 4)
    got: dict[int, torch.Tensor | None] = {}

    def rank_main(rank: int) -> None:
        pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=30))
        with torch.no_grad():
            got[rank] = ParallelLMHead(heads[rank], 7, TPGroup(world, backend=pg))(h)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got[1] is None and got[2] is None
    with torch.no_grad():
        want = torch.cat([heads[r](h) for r in range(world)], dim=-1)[:, :7]
    torch.testing.assert_close(got[0], want)
