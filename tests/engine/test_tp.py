"""Tensor parallelism on a built model (`engine/parallel/tp.py`), over gloo in real local
processes: for TP = 2 and 3, with KV heads split, replicated (fewer than ranks) and grouped,
tied and untied embeddings and a vocabulary that does not divide evenly, every rank's
logits of a batched prefill and of decode steps through its own paged KV cache (its share
of the KV heads) equal the unsharded model's within float32 tolerance, and its greedy tokens
exactly; shapes that cannot be split are a ConfigError naming the reason; KV-head copy plans
between two TP sizes fill every receiving rank's heads exactly once."""

from __future__ import annotations

import os
import queue
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.engine.attention.base import AttentionSpec, BatchLayout
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.ops import Ops
from tandem.engine.parallel.tp import TPGroup, TPPlan, kv_heads
from tests.engine.tp_helpers import HeadCopy, apply_tp, reshard
from tests.serving.helpers import free_port

BS = 4  # tokens per KV block
PROMPTS = ([5, 17, 33, 2, 90, 41, 8, 8, 61, 77, 13], [40, 3, 96, 11, 54])
DECODE_STEPS = 3


def arch(kv_heads: int, tied: bool, heads: int = 6) -> ModelArchConfig:
    return ModelArchConfig(architecture="llama", vocab_size=97, hidden_size=48,
                           intermediate_size=96, num_layers=2, num_heads=heads,
                           num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=64,
                           tie_word_embeddings=tied)


def backend_for(cfg: ModelArchConfig, heads: int, kv_heads: int):  # noqa: ANN201
    spec = AttentionSpec(heads, kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)
    return TorchAttentionBackend(spec, BS, torch.float32, torch.device("cpu"))


def build(cfg: ModelArchConfig) -> tuple[LlamaForCausalLM, object]:
    """The same random model on every rank (seeded), with its full-heads backend."""
    torch.manual_seed(0)
    backend = backend_for(cfg, cfg.num_heads, cfg.num_kv_heads)
    model = LlamaForCausalLM(cfg, backend, max_positions=64, ops=Ops(native=False))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope.compute(torch.device("cpu"))
    return model.eval(), backend


def run(model: LlamaForCausalLM, backend) -> tuple[list[torch.Tensor], list[list[int]]]:  # noqa: ANN001
    """Prefill both prompts in one step, then greedy decode steps for both: the logits of
    every step and the tokens."""
    caches = [backend.allocate_kv_cache(8) for _ in model.layers]
    tables = [[0, 1, 2, 3], [4, 5, 6]]
    seqs = [list(p) for p in PROMPTS]
    logits_per_step = []
    with torch.inference_mode():
        ids = torch.tensor(seqs[0] + seqs[1])
        pos = torch.tensor(list(range(len(seqs[0]))) + list(range(len(seqs[1]))))
        slots = torch.tensor([tables[s][p // BS] * BS + p % BS
                              for s in (0, 1) for p in range(len(seqs[s]))])
        layout = BatchLayout([len(s) for s in seqs], [len(s) for s in seqs], tables, slots, 0,
                             BS)
        last = torch.tensor([len(seqs[0]) - 1, len(seqs[0]) + len(seqs[1]) - 1])
        for _ in range(DECODE_STEPS + 1):
            logits = model(ids, pos, caches, backend.build_metadata(layout), last)
            logits_per_step.append(logits.clone())
            nxt = logits.argmax(-1).tolist()
            for s, t in zip(seqs, nxt, strict=True):
                s.append(t)
            order = sorted((0, 1), key=lambda s: len(seqs[s]))  # decodes by context length
            ids = torch.tensor([seqs[s][-1] for s in order])
            pos = torch.tensor([len(seqs[s]) - 1 for s in order])
            slots = torch.tensor([tables[s][(len(seqs[s]) - 1) // BS] * BS
                                  + (len(seqs[s]) - 1) % BS for s in order])
            layout = BatchLayout([1, 1], [len(seqs[s]) for s in order],
                                 [tables[s] for s in order], slots, 2, BS)
            last = torch.tensor([order.index(0), order.index(1)])
    return logits_per_step, seqs


def _rank(rank: int, world: int, port: int, kv_heads: int, tied: bool, out) -> None:  # noqa: ANN001
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        cfg = arch(kv_heads, tied)
        model, backend = build(cfg)
        want, want_seqs = run(model, backend)
        plan = TPPlan.build(cfg, rank, world)
        local = backend_for(cfg, plan.num_heads, plan.num_kv_heads)
        model = apply_tp(model, plan, TPGroup(world), local)
        got, got_seqs = run(model, local)
        cache_heads = local.allocate_kv_cache(1)[0].shape[1]
        worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
        out.put((rank, worst, got_seqs == want_seqs, cache_heads, plan.num_kv_heads))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world", "kv_heads", "tied"), [
    (2, 6, False),  # KV heads split 3 + 3
    (2, 2, True),   # one KV head each, tied embeddings
    (2, 1, False),  # one KV head, replicated on both ranks
    (3, 6, True),   # 2 KV heads each
    (3, 3, False),  # one each
    (3, 1, True),   # replicated on all three
])
def test_tp_logits_equal_the_unsharded_model(world, kv_heads, tied):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, kv_heads, tied, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 120
    while len(results) < world:
        try:
            results.append(out.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"a rank failed: {dead}"
    results.sort()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, worst, same_tokens, cache_heads, local_kv in results:
        assert worst < 1e-4, (rank, worst)
        assert same_tokens, rank
        assert cache_heads == local_kv == max(kv_heads // world, 1)


def test_shapes_that_cannot_be_split_are_refused():
    with pytest.raises(ConfigError, match="one must divide the other"):
        TPPlan.build(arch(2, False), 0, 3)
    with pytest.raises(ConfigError, match="divide the model's 6 attention heads"):
        TPPlan.build(arch(6, False), 0, 4)
    with pytest.raises(ConfigError, match="rank 2 of 2"):
        TPPlan.build(arch(6, False), 2, 2)
    plan = TPPlan.build(arch(1, False), 2, 3)  # 97 tokens: shards of 33, the last padded
    assert (plan.kv_head_start, plan.vocab_start, plan.vocab_size) == (0, 66, 33)


@pytest.mark.parametrize("seed", range(3))
def test_kv_pages_reshard_between_tp_sizes(seed):
    """Random head counts and TP sizes (prefill pool at one, decode pool at another): each
    receiving rank's copy plan fills exactly its own KV heads, each once, in order, from a
    sender that holds them; the plan agrees with `TPPlan`'s split."""
    rng = random.Random(seed)
    for _ in range(300):
        kvh = rng.choice([1, 2, 3, 4, 6, 8, 12, 16])
        worlds = [w for w in range(1, 17) if kvh % w == 0 or w % kvh == 0]
        src, dst = rng.choice(worlds), rng.choice(worlds)
        held = {r: list(kv_heads(kvh, src, r)) for r in range(src)}
        for d, copies in enumerate(reshard(kvh, src, dst)):
            want = list(kv_heads(kvh, dst, d))
            got: list[int | None] = [None] * len(want)
            for c in copies:
                for k in range(c.count):
                    assert got[c.dst_head + k] is None  # each local head written once
                    got[c.dst_head + k] = held[c.src_rank][c.src_head + k]
            assert got == want, (kvh, src, dst, d, copies)
            cfg = arch(kvh, False, heads=48)
            if cfg.num_heads % dst == 0 and cfg.intermediate_size % dst == 0:
                plan = TPPlan.build(cfg, d, dst)
                assert (plan.kv_head_start, plan.num_kv_heads) == (want[0], len(want))
        assert reshard(kvh, src, src) == [[HeadCopy(r, 0, len(held[r]), 0)] for r in range(src)]
