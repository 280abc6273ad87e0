"""Tensor parallelism applied to a built model (as gpt-fast's `apply_tp`): the model code
stays single-device, `apply_tp` swaps each rank's share of the weights in.

Per rank r of N (`TPPlan`, plain values, checked up front):
- attention: query heads [r H/N, (r+1) H/N); KV heads split the same way when N divides
  KVH, else (N a multiple of KVH) each KV head replicated on the N/KVH ranks whose query
  heads read it; `qkv_proj` keeps those rows (column-parallel), `o_proj` the matching input
  columns (row-parallel: its partial outputs are summed by an all-reduce).
- MLP: `gate_up_proj` keeps rows [r I/N, (r+1) I/N) of both halves, `down_proj` those input
  columns (row-parallel, all-reduced).
- vocabulary: the embedding and the LM head keep rows [r V'/N, (r+1) V'/N) of the vocabulary
  padded to V' (a multiple of N): a token outside the shard embeds to 0 before the
  all-reduce; each rank's logits are all-gathered and the padding cut.
Each rank's KV cache holds its own KV heads only (its attention backend is built for the
local `AttentionSpec`). Collectives go through `TPGroup` (torch.distributed: NCCL on GPU,
gloo on CPU); with N = 1 nothing changes. Float `nn.Linear` weights only (before packing or
quantizing); biases follow their rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.parallel.reshard import kv_heads


@dataclass(frozen=True)
class TPPlan:
    """Rank `rank` of `world`: its heads, its MLP columns, its vocabulary rows."""

    rank: int
    world: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    q_head_start: int
    kv_head_start: int
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_size: int  # rows of this rank's (padded) vocabulary shard
    vocab: int  # the model's vocabulary (the gathered logits are cut to it)

    @classmethod
    def build(cls, arch: ModelArchConfig, rank: int, world: int) -> TPPlan:
        """ConfigError when the model cannot be split `world` ways."""
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"tensor-parallel rank {rank} of {world}")
        h, kvh, inter = arch.num_heads, arch.num_kv_heads, arch.intermediate_size
        if h % world:
            raise ConfigError(f"tensor_parallel_size {world} must divide the model's "
                              f"{h} attention heads")
        if inter % world:
            raise ConfigError(f"tensor_parallel_size {world} must divide the MLP's "
                              f"{inter} intermediate size")
        local_h = h // world
        mine = kv_heads(kvh, world, rank)  # ConfigError unless one divides the other
        shard = -(-arch.vocab_size // world)
        return cls(rank, world, local_h, len(mine), rank * local_h, mine.start,
                   rank * (inter // world), inter // world, rank * shard, shard,
                   arch.vocab_size)


class TPGroup:
    """The collectives of one tensor-parallel group: an unregistered `backend` (a
    `ProcessGroupGloo` / `ProcessGroupNCCL` of `parallel.comm.connect`), else `group` of
    the default world (None: the whole world)."""

    def __init__(self, world: int, group: dist.ProcessGroup | None = None,
                 backend: dist.Backend | None = None) -> None:
        self.world, self.group, self.backend = world, group, backend
        # with `timed` (bench/tp.py): wall seconds spent in collectives, and their count
        self.timed, self.seconds, self.calls = False, 0.0, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
        if self.backend is not None:
            self.backend.allreduce([x]).wait()
        else:
            dist.all_reduce(x, group=self.group)
        if self.timed:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world * n], rank order."""
        if self.world == 1:
            return x
        t0 = time.perf_counter() if self.timed else 0.0
        parts = [torch.empty_like(x) for _ in range(self.world)]
        if self.backend is not None:
            self.backend.allgather([parts], [x.contiguous()]).wait()
        else:
            dist.all_gather(parts, x.contiguous(), group=self.group)
        out = torch.cat(parts, dim=-1)
        if self.timed:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        return out


class RowParallel(nn.Module):
    """A linear holding some input columns: its partial output summed over the ranks."""

    def __init__(self, inner: nn.Module, comm: TPGroup) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the (padded) vocabulary; others embed to 0, then summed."""

    def __init__(self, weight: torch.Tensor, start: int, comm: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered and cut to the vocabulary."""

    def __init__(self, weight: torch.Tensor, vocab: int, comm: TPGroup) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
            weight, requires_grad=False)
        self.vocab, self.comm = vocab, comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(h @ self.weight.T)[..., : self.vocab]


def _rows(linear: nn.Linear, pieces: list[tuple[int, int]]) -> nn.Linear:
    """A new linear of `linear`'s output rows [start, start + n) for each piece, in order."""
    w = torch.cat([linear.weight.data[s:s + n] for s, n in pieces])
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    if linear.bias is not None:
        out.bias.data.copy_(torch.cat([linear.bias.data[s:s + n] for s, n in pieces]))
    return out


def _cols(linear: nn.Linear, start: int, n: int) -> nn.Linear:
    """A new linear of `linear`'s input columns [start, start + n) (no bias: row-parallel
    linears here have none)."""
    if linear.bias is not None:
        raise ConfigError("a row-parallel linear with a bias is not supported")
    w = linear.weight.data[:, start:start + n]
    out = nn.Linear(n, w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    return out


def _vocab_rows(weight: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """This rank's vocabulary rows, zero-padded past the vocabulary."""
    shard = weight.new_zeros(plan.vocab_size, weight.shape[1])
    end = min(plan.vocab_start + plan.vocab_size, plan.vocab)
    if end > plan.vocab_start:
        shard[: end - plan.vocab_start] = weight[plan.vocab_start:end]
    return shard


def apply_tp(model: nn.Module, plan: TPPlan, comm: TPGroup, backend: object) -> None:
    """Shard a built, loaded `LlamaForCausalLM` in place for `plan`'s rank; `backend` is
    the attention backend built for the local heads (every layer uses it)."""
    if plan.world == 1:
        return
    cfg = model.config
    d, q_all, kv_all = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q0, nq = plan.q_head_start * d, plan.num_heads * d
    k0, nk = plan.kv_head_start * d, plan.num_kv_heads * d
    i0, ni, inter = plan.inter_start, plan.inter_size, cfg.intermediate_size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _rows(attn.qkv_proj, [(q0, nq), (q_all + k0, nk),
                                              (q_all + kv_all + k0, nk)])
        attn.o_proj = RowParallel(_cols(attn.o_proj, q0, nq), comm)
        attn.num_heads, attn.num_kv_heads = plan.num_heads, plan.num_kv_heads
        attn.q_size, attn.kv_size = nq, nk
        attn.backend = backend
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(i0, ni), (inter + i0, ni)])
        mlp.down_proj = RowParallel(_cols(mlp.down_proj, i0, ni), comm)
    tied = model.lm_head.weight is model.embed_tokens.weight
    emb = _vocab_rows(model.embed_tokens.weight.data, plan)
    model.embed_tokens = VocabParallelEmbedding(emb, plan.vocab_start, comm)
    head = model.embed_tokens.weight if tied else _vocab_rows(model.lm_head.weight.data, plan)
    model.lm_head = ParallelLMHead(head, plan.vocab, comm)
